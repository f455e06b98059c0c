// spectool's trace viewer: one renderer for the notebook widget (anywidget) and the standalone report.
// It receives a header (run facts, the request list, whole-run series) and, per request, its
// per-iteration columns and its per-node arrays in chunks of consecutive iterations (typed arrays in
// a binary buffer; spectool.trace.viewdata builds them). Every step is rendered in the page from
// arrays already there: the report embeds every chunk, the notebook widget asks the kernel for a
// request or a chunk when it is first shown and for the next chunk before the player reaches it.
// Every string from a trace is set as text (textContent, or escaped for plotly's pseudo-HTML).

const STATUS = ['not visited', 'accepted', 'rejected'];
const COLORS = {accepted: '#2ca02c', rejected: '#d62728', 'not visited': '#b8b8b8', bonus: '#1f77b4'};
const HIGHLIGHT = '#ff7f0e';
const PHASE_NAMES = {draft_us: 'draft', index_us: 'index build', verify_us: 'verify', commit_us: 'commit',
                     trie_get_us: 'trie get', trie_put_us: 'trie put'};
const PHASE_COLORS = {draft_us: '#4e79a7', index_us: '#76b7b2', verify_us: '#e15759', commit_us: '#f28e2b',
                      trie_get_us: '#59a14f', trie_put_us: '#b07aa1'};
const SPEEDS = [1, 2, 5, 10, 20];
// Per-iteration plots of a longer request show bucket means with a min-max band (see fixedBuckets).
const MAX_POINTS = 1500;
// The picker lists at most this many matching requests (the search box narrows them).
const PICKER_MAX = 500;
// The text panel holds this many output tokens around the current iteration.
const TEXT_WINDOW = 1200;
// Ask for the next (previous) chunk this many iterations before its edge; keep this many chunks.
const PREFETCH = 64;
const KEEP_CHUNKS = 24;
// The tree's levels and the mask's rows share this many pixels, so both fit one screen with the player.
const HEIGHT = 500;
const CONFIG = {displaylogo: false, responsive: true, displayModeBar: 'hover',
                modeBarButtonsToRemove: ['select2d', 'lasso2d', 'autoScale2d', 'toggleSpikelines']};
const GLYPHS = {' ': '␣', '\n': '⏎', '\t': '⇥', '\r': '␍'};

// A token's text with whitespace and control characters as visible glyphs.
export function visible(s) {
  let out = '';
  for (const ch of String(s)) {
    const c = ch.codePointAt(0);
    if (GLYPHS[ch]) out += GLYPHS[ch];
    else if (c < 32) out += String.fromCodePoint(0x2400 + c);
    else if (c === 127) out += '␡';
    else if ((c >= 0x80 && c < 0xa0) || c === 0x200b || c === 0xfeff) out += `\\u${c.toString(16).padStart(4, '0')}`;
    else out += ch;
  }
  return out === '' ? '∅' : out;
}

// Plotly interprets a few tags in its text: trace strings go in with every tag character escaped.
const esc = (s) => String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
const clip = (s, n) => (s.length <= n ? s : s.slice(0, Math.max(1, n - 1)) + '…');

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') node.className = v;
    else if (k === 'style') node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);  // strings become text nodes
  return node;
}

const SVGNS = 'http://www.w3.org/2000/svg';
function svgEl(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c);  // strings become text nodes
  return node;
}

// The player's controls (Play / pause, speed, ◀ ▶, slider, label) and how they step, shared by the trace
// viewer and CompareView. `unit` names a position in the buttons' titles; `length()` and `position()`
// read the page's state, `goTo(k)` moves it, and while `loading()` Play waits: it never skips a position.
// `bindKeys(root)`: ← / → step while the focus is not in a field.
function makePlayer({unit, sliderLabel, length, position, goTo, loading}) {
  const play = h('button', {class: 'sv-play', title: 'play / pause'}, '▶ play');
  const speed = h('select', {class: 'sv-speed', 'aria-label': 'play speed'});
  SPEEDS.forEach((s) => speed.append(new Option(`${s} step/s`, String(s))));
  speed.value = '2';
  const prev = h('button', {class: 'sv-prev', title: `previous ${unit} (←)`}, '◀');
  const next = h('button', {class: 'sv-next', title: `next ${unit} (→)`}, '▶');
  const slider = h('input', {type: 'range', class: 'sv-slider', min: '0', max: '0', value: '0', 'aria-label': sliderLabel});
  const label = h('span', {class: 'sv-label'});
  let timer = null;
  function stop() { if (timer) { clearTimeout(timer); timer = null; } play.textContent = '▶ play'; }
  function tick() {
    if (position() >= length() - 1) { stop(); return; }
    if (loading()) { timer = setTimeout(tick, 50); return; }  // a chunk is on its way: wait, never skip it
    goTo(position() + 1);  // one step per tick
    timer = setTimeout(() => requestAnimationFrame(tick), 1000 / Number(speed.value));
  }
  slider.oninput = () => goTo(Number(slider.value));
  prev.onclick = () => goTo(position() - 1);
  next.onclick = () => goTo(position() + 1);
  play.onclick = () => {
    if (timer) { stop(); return; }
    if (position() >= length() - 1) goTo(0);
    play.textContent = '❚❚ pause';
    timer = setTimeout(tick, 1000 / Number(speed.value));
  };
  function bindKeys(root) {
    root.addEventListener('keydown', (e) => {
      if (e.target.tagName === 'INPUT' || e.target.tagName === 'SELECT') return;
      if (e.key === 'ArrowRight' || e.key === 'ArrowLeft') {
        goTo(position() + (e.key === 'ArrowRight' ? 1 : -1));
        e.preventDefault();
        e.stopPropagation();
      }
    });
  }
  return {play, speed, prev, next, slider, label, stop, bindKeys};
}

// Text with whitespace glyphs dimmed, line breaks kept (the text panel).
function appendVisible(node, s) {
  let run = '';
  const flush = () => { if (run) { node.append(run); run = ''; } };
  for (const ch of String(s)) {
    const c = ch.codePointAt(0);
    if (c < 32 || c === 127 || ch === ' ') {
      flush();
      node.append(h('span', {class: 'sv-ws'}, visible(ch)));
      if (ch === '\n') node.append('\n');
    } else run += ch;
  }
  flush();
}

const CSS = `
.spectool-viewer { font: 13px/1.35 system-ui, sans-serif; color: #222; outline: none; }
.spectool-viewer .sv-bar { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 2px 0 6px; }
.spectool-viewer .sv-bar input[type=range] { flex: 1 1 200px; min-width: 120px; }
/* ◀ slider ▶ wrap as one: a narrow bar breaks before them or after them, never between */
.spectool-viewer .sv-steps { display: flex; gap: 6px; align-items: center; flex: 1 1 240px; }
.spectool-viewer .sv-request-search { flex: none; font: 12px system-ui, sans-serif; box-sizing: border-box; }
.spectool-viewer .sv-label { font-variant-numeric: tabular-nums; }
.spectool-viewer .sv-main { display: grid; grid-template-columns: minmax(0, 1.15fr) minmax(0, 1fr); gap: 10px; }
.spectool-viewer .sv-lower { display: grid; grid-template-columns: repeat(auto-fit, minmax(360px, 1fr)); gap: 10px;
  margin-top: 8px; }
.spectool-viewer h4 { margin: 2px 0; font-size: 13px; font-weight: 600; overflow-wrap: anywhere; }
.spectool-viewer .sv-plot { position: relative; min-width: 0; }
.spectool-viewer .sv-plot-area { position: relative; }
/* Each panel lays out and paints on its own: a step redraws the tree and the mask, not the page. */
.spectool-viewer .sv-plot, .spectool-viewer .sv-text { contain: layout paint style; }
.spectool-viewer .sv-tree-area, .spectool-viewer .spectool-mask .sv-plot-area { will-change: transform; }
.spectool-viewer .sv-text { max-height: 4.4em; margin-bottom: 6px; overflow: auto; white-space: pre-wrap;
  font: 12px/1.4 ui-monospace, monospace; border: 1px solid #ddd; padding: 4px 6px; overflow-wrap: anywhere; }
.spectool-viewer .sv-text .sv-prompt { color: #888; }
.spectool-viewer .sv-text .sv-out { cursor: pointer; }
.spectool-viewer .sv-text .sv-out:hover { outline: 1px solid #999; }
.spectool-viewer .sv-text .sv-acc { background: #2ca02c40; border-bottom: 2px solid #2ca02c; }
.spectool-viewer .sv-text .sv-bonus { background: #1f77b440; border-bottom: 2px solid #1f77b4; }
.spectool-viewer .sv-ws { color: #aaa; }
.spectool-viewer .sv-legend { display: flex; flex-wrap: wrap; gap: 4px 12px; font-size: 12px; color: #444; }
.spectool-viewer .sv-chip { display: inline-block; width: 10px; height: 10px; border-radius: 50%;
  margin-right: 4px; border: 1px solid #333; vertical-align: -1px; }
/* The current-iteration marker moves on the compositor (a transform on its own layer): moving it
   repaints nothing of the plot under it, whose filled bands cost milliseconds to raster. */
.spectool-viewer .sv-marker { position: absolute; left: 0; width: 0; border-left: 2px solid ${HIGHLIGHT};
  pointer-events: none; display: none; will-change: transform; }
.spectool-viewer .sv-message { color: #a94442; }
.spectool-viewer .sv-note { color: #666; font-size: 12px; }
.spectool-viewer .sv-tree-area, .spectool-viewer .spectool-mask .sv-plot-area { overflow-x: auto; }
.spectool-viewer svg text { font-family: ui-monospace, monospace; }
.spectool-viewer .sv-node-label { font-size: 11px; fill: #333; pointer-events: none; }
.spectool-viewer .sv-axis { font-size: 11px; fill: #666; font-family: system-ui, sans-serif !important; }
.spectool-viewer .sv-tick { fill: #333; }
.spectool-viewer .sv-node { cursor: pointer; }
.spectool-viewer .sv-tip { position: absolute; z-index: 10; display: none; pointer-events: none; white-space: pre;
  background: #fff; border: 1px solid #888; padding: 4px 6px; font: 12px/1.35 ui-monospace, monospace;
  box-shadow: 0 1px 4px #0003; max-width: 520px; white-space: pre-wrap; overflow-wrap: anywhere; }
.spectool-viewer { position: relative; }
.spectool-viewer table.sv-facts td { padding: 0 12px 0 0; }
`;

// A chunk's typed arrays, views on its buffer.
function arrays(meta, buffer) {
  const types = {int32: Int32Array, uint8: Uint8Array, float32: Float32Array};
  const a = {};
  for (const [name, [dtype, off, len]] of Object.entries(meta.nodes)) a[name] = new types[dtype](buffer, off, len);
  return a;
}

// Consecutive iterations grouped into at most MAX_POINTS equal buckets: first x, mean, min and max of y.
export function fixedBuckets(x, y, max = MAX_POINTS) {
  const n = x.length, size = Math.max(1, Math.ceil(n / max));
  const out = {size, x: [], mean: [], min: [], max: []};
  for (let a = 0; a < n; a += size) {
    let sum = 0, lo = Infinity, hi = -Infinity, m = 0;
    for (let k = a; k < Math.min(n, a + size); k++) {
      const v = y[k] === null ? 0 : y[k];
      sum += v; m++; if (v < lo) lo = v; if (v > hi) hi = v;
    }
    out.x.push(x[a]); out.mean.push(sum / m); out.min.push(lo); out.max.push(hi);
  }
  return out;
}

// Tidy layout: children best score first, leaves left to right, a parent centred over its children.
// Padding nodes (and anything under them) are dropped; the bonus token is the last child of the
// deepest accepted node.
function layout(v) {
  const n = v.n, keep = new Uint8Array(n), depth = new Int32Array(n), kids = [];
  for (let i = 0; i < n; i++) kids.push([]);
  if (n) keep[0] = 1;
  for (let i = 1; i < n; i++) {
    const p = v.parents[i];
    if (v.valid[i] && p >= 0 && p < i && keep[p]) { keep[i] = 1; depth[i] = depth[p] + 1; kids[p].push(i); }
  }
  const score = (i) => (Number.isNaN(v.scores[i]) ? -Infinity : v.scores[i]);
  for (const k of kids) k.sort((a, b) => score(b) - score(a) || a - b);
  const last = v.path.length ? v.path[v.path.length - 1] : -1;
  const hasBonus = n > 0 && last >= 0 && v.bonus >= 0;
  if (hasBonus) kids[last].push(-1);
  const x = new Float64Array(n).fill(NaN);
  let bonusX = NaN, leaf = 0;
  const setX = (node, value) => { if (node < 0) bonusX = value; else x[node] = value; };
  const getX = (node) => (node < 0 ? bonusX : x[node]);
  const stack = n ? [[0, false]] : [];
  while (stack.length) {
    const [node, done] = stack.pop();
    const ch = node < 0 ? [] : kids[node];
    if (!ch.length) setX(node, leaf++);
    else if (done) setX(node, (getX(ch[0]) + getX(ch[ch.length - 1])) / 2);
    else { stack.push([node, true]); for (let j = ch.length - 1; j >= 0; j--) stack.push([ch[j], false]); }
  }
  const shown = [];
  for (let i = 0; i < n; i++) if (keep[i]) shown.push(i);
  let maxDepth = 0;
  for (const i of shown) maxDepth = Math.max(maxDepth, depth[i]);
  if (hasBonus) maxDepth = Math.max(maxDepth, depth[last] + 1);
  return {x, depth, shown, keep, leaves: leaf, maxDepth, bonus: hasBonus ? {x: bonusX, y: -(depth[last] + 1), parent: last} : null};
}

// A titled panel: a plot area and the current-iteration marker that moves over it (markCurrent).
function panel(cls, title) {
  const plot = h('div', {class: 'sv-plot-area'});
  const marker = h('div', {class: 'sv-marker'});
  const box = h('div', {class: `sv-plot ${cls}`}, h('h4', {}, title), plot, marker);
  return {box, plot, marker, title: box.firstChild};
}

// Move panel p's marker to x value `xval` of its plotly plot gd.
function markCurrent(p, gd, xval) {
  const full = gd._fullLayout;
  if (!full || !full.xaxis || !full.yaxis || xval === undefined) { p.marker.style.display = 'none'; return; }
  const xa = full.xaxis, ya = full.yaxis;
  // plotly's own numbers, no DOM reads: the marker lives inside the plot's div
  if (p.marker.parentNode !== gd) gd.append(p.marker);
  p.marker.style.transform = `translateX(${xa._offset + xa.l2p(xval) - 1}px)`;
  if (p.marker.style.display !== 'block' || p.markerTop !== ya._offset || p.markerHeight !== ya._length) {
    p.markerTop = ya._offset;
    p.markerHeight = ya._length;
    p.marker.style.top = `${ya._offset}px`;
    p.marker.style.height = `${ya._length}px`;
    p.marker.style.display = 'block';
  }
}

// The parts a view shows: all of them for the viewer; a standalone view names its own (opts.parts).
export const PARTS = ['tree', 'mask', 'text', 'find', 'plots'];

// opts: parts (what to show, default PARTS), fetch (ask the kernel for data), onState (where the player
// stands), initial ({request, position, selected}), height (pixels shared by the tree's levels and the
// mask's rows, default HEIGHT), player (false: no player of its own, stepped by goTo, as in a comparison).
export function mount(root, header, buffer, Plotly, opts = {}) {
  const parts = new Set(opts.parts && opts.parts.length ? opts.parts : PARTS);
  const ownPlayer = opts.player !== false, HEIGHT_PX = opts.height || HEIGHT;
  // ----- data: requests and chunks as they arrive (all of them at once in the report) -------
  const texts = Object.assign({}, header.texts || {});
  const reqs = new Map(), chunks = new Map(), asked = new Set();
  const chunkKey = (id, c) => `${id}:${c}`;
  function addChunk(id, c, meta, buf) {
    Object.assign(texts, meta.texts);
    meta.a = arrays(meta, buf);
    chunks.set(chunkKey(id, c), meta);
    asked.delete(`chunk ${chunkKey(id, c)}`);
    if (opts.fetch && chunks.size > KEEP_CHUNKS) {  // the kernel can send them again: keep the near ones
      const far = [...chunks.keys()].filter((k) => k !== chunkKey(id, c) && (!R || !k.startsWith(`${R.id}:`) ||
        Math.abs(Number(k.split(':')[1]) - Math.floor(pos / R.chunk)) > 1));
      for (const k of far.slice(0, chunks.size - KEEP_CHUNKS)) chunks.delete(k);
    }
  }
  function addRequest(data, buf) {
    Object.assign(texts, data.texts);
    if (data.text) Object.assign(texts, data.text.texts);
    for (const [c, meta] of Object.entries(data.loaded || {})) addChunk(data.id, Number(c), meta, buf);
    delete data.loaded;
    reqs.set(data.id, data);
    asked.delete(`request ${data.id}`);
  }
  for (const data of header.loaded || []) addRequest(data, buffer);
  function ask(msg) {  // at most one question in flight per thing asked
    const key = msg.kind === 'chunk' ? `chunk ${chunkKey(msg.request, msg.chunk)}` : `${msg.kind} ${msg.request}`;
    if (!opts.fetch || asked.has(key)) return;
    asked.add(key);
    opts.fetch(msg);
  }
  const text = (id) => (texts[id] !== undefined ? texts[id] : '#' + id);
  const vtext = (id) => visible(text(id));
  root.classList.add('spectool-viewer');
  if (ownPlayer) root.tabIndex = 0;
  root.replaceChildren(h('style', {}, CSS));
  const message = h('div', {class: 'sv-message'});
  root.append(message);
  if (!header.has_tokenizer) root.append(h('div', {class: 'sv-note'}, 'this trace has no tokenizer: tokens are shown as ids'));
  if (!header.requests.length) {
    message.textContent = header.error || 'this trace has no draft iterations (empty trace)';
    return {goTo() {}, showRequest() {}, receive() {}, select() {}, destroy() {}, state: () => ({})};
  }

  // ----- controls ---------------------------------------------------------------------------
  const picker = h('select', {class: 'sv-request', 'aria-label': 'request'});
  // The box is as wide as its placeholder (in its own font, 'ch' of digits and letters alike) plus the
  // search field's clear button, and never shrinks: the text stays whole at any width of the bar.
  const hint = `find request (${header.requests.length})`;
  const search = h('input', {type: 'search', class: 'sv-request-search', placeholder: hint,
                             'aria-label': 'find request', style: `width: calc(${hint.length + 1}ch + 24px)`});
  const ctl = makePlayer({unit: 'iteration', sliderLabel: 'iteration', length: () => R.iteration.length,
                         position: () => pos, goTo: (k) => goTo(k), loading: () => Boolean(waiting)});
  const {play, speed, prev, next, slider, label, stop} = ctl;
  const player = h('div', {class: 'sv-bar spectool-player'}, search, picker, play, speed,
                   h('span', {class: 'sv-steps'}, prev, slider, next), label);
  const findKind = h('select', {class: 'sv-find-kind', 'aria-label': 'find'});
  [['zero', 'accept length 0'], ['depth', 'first rejection at depth'], ['confident', 'rejected draft with score ≥'],
   ['slowest', 'slowest iteration']].forEach(([v, t]) => findKind.append(new Option(t, v)));
  const findArg = h('input', {type: 'number', class: 'sv-find-arg', value: '1', step: '1', style: 'width: 5em', 'aria-label': 'find argument'});
  const findPrev = h('button', {class: 'sv-find-prev', title: 'previous match'}, '◀ find');
  const findNext = h('button', {class: 'sv-find-next', title: 'next match'}, 'find ▶');
  const findNote = h('span', {class: 'sv-note sv-find-note'});
  const rowPick = h('select', {class: 'sv-row', 'aria-label': 'mask row'});
  const findLabel = h('span', {}, 'find: ');
  const finder = h('div', {class: 'sv-bar sv-find'}, findLabel, findKind, findArg, findPrev, findNext, findNote,
                   h('span', {style: 'flex: 1'}), 'mask row ', rowPick);

  // ----- panels -----------------------------------------------------------------------------
  const tree = panel('spectool-tree', 'draft tree');
  const legend = h('div', {class: 'sv-legend'});
  for (const [name, what] of [['accepted', 'accepted: the target agreed'],
    ['rejected', 'rejected: the target chose another token'],
    ['not visited', 'not visited: under a rejected node, or a sibling after the accepted child'],
    ['bonus', 'bonus: the target\'s own next token']]) {
    legend.append(h('span', {}, h('span', {class: 'sv-chip', style: `background:${COLORS[name]}`}), what));
  }
  tree.box.append(legend);
  const mask = panel('spectool-mask', 'tree mask');
  const textPanel = h('div', {class: 'sv-text spectool-text', tabindex: '-1'});
  const main = h('div', {class: 'sv-main'}, tree.box, mask.box);
  const accept = panel('spectool-acceptance', 'accept length per iteration');
  const timing = panel('spectool-timing', 'time per iteration by phase');
  const depthPanel = panel('spectool-depth', 'acceptance by depth');
  const calib = panel('spectool-calibration', 'calibration: draft score against acceptance (whole trace)');
  const whole = panel('spectool-aggregate', 'whole run: mean accept length per iteration (all requests)');
  const lower = h('div', {class: 'sv-lower'}, accept.box, timing.box, depthPanel.box, calib.box, whole.box);
  const facts = h('table', {class: 'sv-facts'});
  for (const [k, v] of header.facts || []) facts.append(h('tr', {}, h('td', {}, k), h('td', {}, v)));
  const details = h('details', {}, h('summary', {}, 'run'), facts);
  if (!parts.has('find')) for (const el of [findLabel, findKind, findArg, findPrev, findNext, findNote]) el.style.display = 'none';
  if (!parts.has('mask')) rowPick.style.display = 'none';
  main.replaceChildren(...[tree.box, mask.box].filter((_, j) => parts.has(['tree', 'mask'][j])));
  if (main.children.length === 1) main.style.gridTemplateColumns = 'minmax(0, 1fr)';
  if (ownPlayer) root.append(player);
  if (parts.has('find') || parts.has('mask')) root.append(finder);
  if (parts.has('text')) root.append(textPanel);
  root.append(main);
  if (parts.has('plots')) root.append(lower, details);

  // ----- state ------------------------------------------------------------------------------
  let R = null, ri = 0, pos = 0, chosen = null, tokIter = null, spans = [], lit = [];
  let view = null, lay = null, waiting = null, textLo = 0;

  // Iteration k of the current request from its chunk (null while the chunk is on its way).
  function slice(k) {
    const c = Math.floor(k / R.chunk), C = chunks.get(chunkKey(R.id, c));
    if (!C) return null;
    const j = k - c * R.chunk, A = C.a;
    const a = C.offsets[j], b = C.offsets[j + 1], n = b - a;
    const sub = (arr) => arr.subarray(a, b);
    const topk = {};
    const K = C.topk_k[j];
    C.path[j].forEach((node, m) => {
      const s = C.topk_start[j] + m * K, out = [];
      for (let q = 0; q < K; q++) out.push([A.topk[s + q], A.topk_p[s + q]]);
      topk[node] = out;
    });
    return {k, n, tokens: sub(A.tokens), parents: sub(A.parents), scores: sub(A.scores), valid: sub(A.valid),
            status: sub(A.status), argmax: sub(A.argmax), argmax_p: sub(A.argmax_p), topk, path: C.path[j],
            bonus: R.bonus[k], iteration: R.iteration[k], accept_length: R.accept_length[k], mask: C.masks[j]};
  }

  // The chunks next to the current one, asked for before the player gets there.
  function prefetch(k) {
    const c = Math.floor(k / R.chunk), j = k - c * R.chunk;
    const want = [c];
    if (j >= R.chunk - PREFETCH && c + 1 < R.chunks) want.push(c + 1);
    if (j < PREFETCH && c > 0) want.push(c - 1);
    for (const w of want) if (!chunks.has(chunkKey(R.id, w))) ask({kind: 'chunk', request: R.id, chunk: w});
  }

  function maskBit(v, q, c) {
    if (!v.mask) {  // the mask is the ancestors of parents (the recorded one differed otherwise)
      for (let i = q; i >= 0; i = v.parents[i]) { if (i === c) return 1; if (v.parents[i] >= i) break; }
      return 0;
    }
    if (!v.bits) v.bits = atob(v.mask);
    const i = q * v.n + c;
    return i >> 3 < v.bits.length ? (v.bits.charCodeAt(i >> 3) >> (7 - (i & 7))) & 1 : 0;
  }

  function ancestors(v, node) {
    const out = [node];
    while (v.parents[out[out.length - 1]] >= 0 && out.length <= v.n) out.push(v.parents[out[out.length - 1]]);
    return out.reverse();
  }

  function selectedNode(v) {
    if (chosen !== null && chosen < v.n && lay.keep[chosen]) return chosen;
    return v.path.length ? v.path[v.path.length - 1] : 0;
  }

  // The tree and the mask are drawn as plain SVG (a few hundred elements, no layout measuring): a step
  // of a 64-node tree costs a few milliseconds where plotly's text and tick layout costs hundreds.
  function renderTree(v, sel) {
    const {x, depth, shown, bonus} = lay;
    const avail = Math.max(240, widths.tree || 600);
    const left = 34, right = 16, top = 16, levelH = Math.max(36, Math.min(60, Math.floor(HEIGHT_PX / (lay.maxDepth + 1))));
    const spacing = Math.max(8, (avail - left - right) / Math.max(lay.leaves, 1));
    const W = left + right + spacing * Math.max(lay.leaves, 1), H = top + levelH * (lay.maxDepth + 1) + 24;
    const X = (xv) => left + spacing * (xv + 0.5), Y = (d) => top + 10 + levelH * d;
    const rotate = spacing < 34;  // dense levels: labels turn downward instead of overlapping
    const chars = rotate ? 8 : Math.max(1, Math.min(10, Math.floor(spacing / 6.8)));
    const svg = svgEl('svg', {width: W, height: H, class: 'sv-tree-svg'});
    for (let d = 0; d <= lay.maxDepth; d++) {
      svg.append(svgEl('text', {x: 4, y: Y(d) + 4, class: 'sv-axis'}, String(d)));
    }
    let edges = '';
    for (const i of shown) if (i > 0) edges += `M${X(x[v.parents[i]])},${Y(depth[v.parents[i]])}L${X(x[i])},${Y(depth[i])}`;
    svg.append(svgEl('path', {d: edges, stroke: '#999', 'stroke-width': 1, fill: 'none'}));
    const path = ancestors(v, sel).filter((i) => lay.keep[i]);
    let hl = '';
    for (let j = 1; j < path.length; j++) hl += `M${X(x[path[j - 1]])},${Y(depth[path[j - 1]])}L${X(x[path[j]])},${Y(depth[path[j]])}`;
    svg.append(svgEl('path', {d: hl, stroke: HIGHLIGHT, 'stroke-width': 4, fill: 'none'}));
    if (bonus) {
      svg.append(svgEl('path', {d: `M${X(x[bonus.parent])},${Y(depth[bonus.parent])}L${X(bonus.x)},${Y(-bonus.y)}`,
                                stroke: COLORS.bonus, 'stroke-width': 1.5, 'stroke-dasharray': '3,3', fill: 'none'}));
    }
    for (const i of path) svg.append(svgEl('circle', {cx: X(x[i]), cy: Y(depth[i]), r: 11, fill: 'none', stroke: HIGHLIGHT, 'stroke-width': 3}));
    const label = (cx, cy, s) => {
      const t = svgEl('text', rotate ? {x: cx + 3, y: cy + 12, class: 'sv-node-label', style: `font-size:${Math.max(8, Math.min(11, spacing * 0.95)).toFixed(1)}px`,
                                        transform: `rotate(70 ${cx + 3} ${cy + 12})`}
                                     : {x: cx, y: cy + 24, class: 'sv-node-label', 'text-anchor': 'middle'}, clip(s, chars));
      svg.append(t);
    };
    for (const i of shown) {
      const c = svgEl('circle', {cx: X(x[i]), cy: Y(depth[i]), r: 7, fill: COLORS[STATUS[v.status[i]]] || '#fff',
                                 stroke: '#333', 'stroke-width': 1, class: `sv-node sv-${['unvisited', 'accepted', 'rejected'][v.status[i]]}`,
                                 'data-node': i});
      svg.append(c);
      label(X(x[i]), Y(depth[i]), vtext(v.tokens[i]));
    }
    if (bonus) {
      const cx = X(bonus.x), cy = Y(-bonus.y), r = 9, pts = [];
      for (let j = 0; j < 10; j++) {
        const a = -Math.PI / 2 + j * Math.PI / 5, rr = j % 2 ? r * 0.45 : r;
        pts.push(`${(cx + rr * Math.cos(a)).toFixed(1)},${(cy + rr * Math.sin(a)).toFixed(1)}`);
      }
      svg.append(svgEl('polygon', {points: pts.join(' '), fill: COLORS.bonus, stroke: '#333', 'stroke-width': 1,
                                   class: 'sv-node sv-bonus-node', 'data-node': -1}));
      label(cx, cy, vtext(v.bonus));
    }
    tree.plot.replaceChildren(svg);
    const drafted = shown.length - 1, padding = v.n - shown.length;
    tree.title.textContent = `draft tree · iteration ${v.iteration} · ` + (drafted > 0
      ? `${drafted} drafted node${drafted === 1 ? '' : 's'}` + (padding ? ` (${padding} padding not shown)` : '')
      : 'only the root: nothing was drafted this iteration');
  }

  function treeTip(v, i) {
    if (i < 0) return [`bonus token ${vtext(v.bonus)} (id ${v.bonus})`, `the target's own token after node ${lay.bonus.parent}`];
    const lines = [`node ${i} · ${vtext(v.tokens[i])} (id ${v.tokens[i]})`,
      `depth ${lay.depth[i]} · score ${Number.isNaN(v.scores[i]) ? 'nan' : +v.scores[i].toPrecision(4)} · ${STATUS[v.status[i]] || '?'}`,
      `target argmax at this node: ${vtext(v.argmax[i])} p=${v.argmax_p[i].toFixed(3)}`];
    const p = v.parents[i];
    if (p >= 0 && v.topk[p]) {  // what the target wanted in this node's place: why it was kept or rejected
      lines.push(`target top-${v.topk[p].length} after node ${p}:`);
      for (const [t, q] of v.topk[p]) lines.push(`  ${vtext(t)}  ${q.toFixed(3)}`);
    }
    return lines;
  }

  function renderMask(v, sel) {
    const rows = lay.shown, m = rows.length;
    const labels = rows.map((i) => `${i} ${clip(vtext(v.tokens[i]), 8)}`);
    const avail = Math.max(200, widths.mask || 500);
    const left = 92, topM = 6, bottom = 78;
    const cell = Math.max(4, Math.min(26, Math.floor((avail - left - 10) / Math.max(m, 1)), Math.floor(HEIGHT_PX / Math.max(m, 1))));
    const side = cell * m;
    const svg = svgEl('svg', {width: left + side + 10, height: topM + side + bottom, class: 'sv-mask-svg',
                              'data-nodes': rows.join(',')});  // the query rows (= key columns), in order
    let seen = '', mine = '';
    for (let r = 0; r < m; r++) {
      for (let c = 0; c <= r; c++) {  // topological order: a node sees only itself and earlier nodes
        if (!maskBit(v, rows[r], rows[c])) continue;
        const d = `M${left + c * cell + 0.5},${topM + r * cell + 0.5}h${cell - 1}v${cell - 1}h${1 - cell}z`;
        if (rows[r] === sel) mine += d; else seen += d;
      }
    }
    svg.append(svgEl('rect', {x: left, y: topM, width: side, height: side, fill: '#fff', stroke: '#ccc'}));
    svg.append(svgEl('path', {d: seen, fill: '#9ecae1'}));
    svg.append(svgEl('path', {d: mine, fill: HIGHLIGHT}));
    // Labels stay readable (>= 8 px): when cells are smaller, every `every`-th row and column is labelled
    // (the tooltip names every cell).
    const font = Math.min(11, Math.max(8, cell - 2)), every = Math.ceil((font + 1) / cell);
    rows.forEach((node, r) => {
      if (r % every) return;
      svg.append(svgEl('text', {x: left - 4, y: topM + r * cell + cell / 2 + font / 3, 'text-anchor': 'end',
                                class: 'sv-tick', 'font-size': font, 'data-row': r}, labels[r]));
      const cx = left + r * cell + cell / 2 + font / 3, cy = topM + side + 6;
      svg.append(svgEl('text', {x: cx, y: cy, 'text-anchor': 'end', class: 'sv-tick', 'font-size': font,
                                transform: `rotate(-60 ${cx} ${cy})`}, labels[r]));
    });
    svg.append(svgEl('text', {x: left + side / 2, y: topM + side + bottom - 4, 'text-anchor': 'middle', class: 'sv-axis'},
                     'key node (coloured: visible to the query row)'));
    mask.plot.replaceChildren(svg);
    mask.geometry = {left, top: topM, cell, m};
    mask.title.textContent = `tree mask · ${m} node${m === 1 ? '' : 's'} (query rows, key columns) · row ${sel} ${vtext(v.tokens[sel] ?? 0)} selected`;
    rowPick.replaceChildren(new Option('accepted path (deepest accepted node)', '-1'));
    for (const i of rows) rowPick.append(new Option(`${i} ${vtext(v.tokens[i])}`, String(i)));
    rowPick.value = chosen !== null && lay.keep[chosen] ? String(chosen) : '-1';
  }

  function maskCell(e) {
    const g = mask.geometry, rect = mask.plot.firstChild.getBoundingClientRect();
    const c = Math.floor((e.clientX - rect.left - g.left) / g.cell), r = Math.floor((e.clientY - rect.top - g.top) / g.cell);
    return r >= 0 && r < g.m && c >= 0 && c < g.m ? [lay.shown[r], lay.shown[c]] : null;
  }

  function showTip(e, lines) {
    if (!lines) { tip.style.display = 'none'; return; }
    tip.textContent = lines.join('\n');
    const rect = root.getBoundingClientRect();
    tip.style.left = `${e.clientX - rect.left + 14}px`;
    tip.style.top = `${e.clientY - rect.top + 14}px`;
    tip.style.display = 'block';
  }

  function renderText(v) {
    for (const s of lit) s.classList.remove('sv-acc', 'sv-bonus');
    lit = [];
    const T = R.text;
    if (!T) return;
    const start = T.out_start[v.k], count = T.out_count[v.k];
    if (T.output.length > TEXT_WINDOW && (start < textLo || start + count > textLo + TEXT_WINDOW)) buildText(start);
    for (let j = 0; j < count; j++) {
      const s = spans[start + j - textLo];
      if (!s) continue;
      s.classList.add(j < v.accept_length ? 'sv-acc' : 'sv-bonus');
      lit.push(s);
    }
    if (lit.length) {  // scroll the panel (only the panel) to this iteration's tokens, after the paint
      const first = lit[0];
      requestAnimationFrame(() => {
        const top = first.offsetTop - textPanel.offsetTop, bottom = top + first.offsetHeight;
        if (top < textPanel.scrollTop || bottom > textPanel.scrollTop + textPanel.clientHeight) {
          textPanel.scrollTop = Math.max(0, top - textPanel.clientHeight / 3);
        }
      });
    }
  }

  function render() {
    prefetch(pos);
    const v = slice(pos);
    slider.value = String(pos);
    if (!v) {  // its chunk is on its way from the kernel: drawn when it arrives
      waiting = {request: R.id, position: pos};
      label.textContent = `iteration ${R.iteration[pos]} (${pos + 1}/${R.iteration.length}) · loading…`;
      return;
    }
    waiting = null;
    view = v;
    lay = layout(view);
    const sel = selectedNode(view);
    if (parts.has('tree')) renderTree(view, sel);
    if (parts.has('mask')) renderMask(view, sel);
    if (parts.has('text')) renderText(view);
    if (parts.has('plots')) {
      markCurrent(accept, accept.plot, R.iteration[pos]);
      markCurrent(timing, timing.plot, R.iteration[pos]);
    }
    const extra = R.match_len[pos] >= 0 ? ` · match ${R.match_len[pos]}, breadth ${R.breadth[pos]}` : '';
    label.textContent = `iteration ${view.iteration} (${pos + 1}/${R.iteration.length}) · seq_len ${R.seq_len[pos]} · ` +
      `accept length ${view.accept_length}${extra}`;
    if (opts.onState) opts.onState({request: R.id, position: pos, iteration: view.iteration});
  }

  // The prompt's tail, then the output: all of it, or TEXT_WINDOW tokens around output position `around`.
  function buildText(around = 0) {
    spans = [];
    const T = R.text;
    if (!T) { textPanel.replaceChildren(h('b', {}, 'text '), h('span', {class: 'sv-note'}, 'loading…')); return; }
    const prompt = h('span', {class: 'sv-prompt', title: 'prompt (last tokens)'});
    if (T.prompt_len > T.prompt_tail.length) prompt.append('… ');
    for (const t of T.prompt_tail) appendVisible(prompt, text(t));
    const out = h('span', {class: 'sv-output'});
    if (!tokIter || tokIter.owner !== R) {
      tokIter = new Int32Array(T.output.length).fill(-1);
      tokIter.owner = R;
      T.out_start.forEach((s, k) => { for (let j = 0; j < T.out_count[k]; j++) tokIter[s + j] = k; });
    }
    textLo = T.output.length > TEXT_WINDOW ? Math.max(0, Math.min(around - TEXT_WINDOW / 3, T.output.length - TEXT_WINDOW)) : 0;
    textLo = Math.floor(textLo);
    const hi = Math.min(T.output.length, textLo + TEXT_WINDOW);
    if (textLo > 0) out.append(h('span', {class: 'sv-note'}, `… ${textLo} earlier output tokens … `));
    for (let j = textLo; j < hi; j++) {
      const s = h('span', {class: 'sv-out', 'data-pos': String(j),
        title: tokIter[j] >= 0 ? `iteration ${R.iteration[tokIter[j]]}` : 'from prefill'});
      appendVisible(s, text(T.output[j]));
      spans.push(s);
      out.append(s);
    }
    if (hi < T.output.length) out.append(h('span', {class: 'sv-note'}, ` … ${T.output.length - hi} more output tokens`));
    textPanel.replaceChildren(h('b', {}, 'text '), prompt, out);
    if (!T.output.length) textPanel.append(h('span', {class: 'sv-note'}, ' (no output recorded for this request)'));
  }

  // A band between min and max of each bucket, under its mean (only when buckets hold several iterations).
  function bandTraces(B, color, name) {
    if (B.size <= 1) return [];
    return [{type: 'scatter', x: B.x, y: B.max, mode: 'lines', line: {width: 0}, hoverinfo: 'skip', showlegend: false},
            {type: 'scatter', x: B.x, y: B.min, mode: 'lines', line: {width: 0}, fill: 'tonexty', fillcolor: color + '33',
             hoverinfo: 'skip', name: `${name} min-max`, showlegend: false}];
  }

  function renderRequestPlots() {
    const it = R.iteration, n = it.length, dense = n > 600;
    // Longer requests are drawn as bucket means (fixedBuckets) with their min-max band: a plot of
    // thousands of points costs the page seconds and shows no more than its width in pixels.
    const acc = fixedBuckets(it, R.accept_length);
    const bucketNote = acc.size > 1 ? ` · means of ${acc.size} iterations, band min-max` : '';
    Plotly.react(accept.plot, [...bandTraces(acc, COLORS.accepted, 'accept length'),
      {type: 'scatter', x: acc.x, y: acc.mean, mode: dense ? 'lines' : 'lines+markers',
       line: {color: COLORS.accepted, width: 1}, marker: {size: 5},
       hovertemplate: acc.size > 1 ? `iterations %{x}+${acc.size}: mean accept length %{y:.2f}<extra></extra>`
         : 'iteration %{x}: accept length %{y}<extra></extra>'}], {
      height: 260, margin: {l: 56, r: 12, t: 8, b: 44}, plot_bgcolor: 'white', showlegend: false,
      xaxis: {title: {text: 'iteration'}, tickformat: 'd'},
      yaxis: {title: {text: 'accept length (tokens)'}, rangemode: 'tozero', tickformat: acc.size > 1 ? '' : 'd'}}, CONFIG);
    accept.title.textContent = 'accept length per iteration' + bucketNote;
    const phases = header.phases.filter((p) => R.phases[p] && R.phases[p].some((t) => t !== null && t > 0));
    const ms = (p) => R.phases[p].map((t) => (t === null ? 0 : t / 1000));
    const tr = phases.map((p) => {
      const B = fixedBuckets(it, ms(p));
      return dense
        ? {type: 'scatter', mode: 'lines', stackgroup: 'one', x: B.x, y: B.mean, line: {width: 0.5, color: PHASE_COLORS[p]},
           name: PHASE_NAMES[p]}
        : {type: 'bar', x: B.x, y: B.mean, name: PHASE_NAMES[p], marker: {color: PHASE_COLORS[p]}};
    });
    tr.forEach((t) => { t.hovertemplate = `${t.name}: %{y:.3f} ms (iteration %{x})<extra></extra>`; });
    const share = phases.map((p) => [p, R.phases[p].reduce((s, t) => s + (t || 0), 0)]);
    const total = share.reduce((s, [, t]) => s + t, 0);
    Plotly.react(timing.plot, tr, {
      height: 260, barmode: 'stack', bargap: 0.1, margin: {l: 56, r: 12, t: 8, b: 44}, plot_bgcolor: 'white',
      legend: {orientation: 'h', y: 1.02, yanchor: 'bottom', x: 0, font: {size: 11}},
      xaxis: {title: {text: 'iteration'}, tickformat: 'd'}, yaxis: {title: {text: 'time (ms)'}, rangemode: 'tozero'}}, CONFIG);
    timing.title.textContent = (total > 0
      ? 'time per iteration by phase · ' + share.sort((a, b) => b[1] - a[1]).slice(0, 3)
        .map(([p, t]) => `${PHASE_NAMES[p]} ${(100 * t / total).toFixed(0)}%`).join(', ')
      : 'time per iteration by phase · no timings recorded') + (acc.size > 1 ? ` · means of ${acc.size} iterations` : '');
    // Acceptance by depth over the trees that reach that depth (R.deepest: the deepest drawn node).
    const reach = [], hit = [];
    for (let k = 0; k < n; k++) {
      for (let d = 1; d <= R.deepest[k]; d++) { reach[d] = (reach[d] || 0) + 1; if (R.accept_length[k] >= d) hit[d] = (hit[d] || 0) + 1; }
    }
    const layer = R.method === 'multi_layer_eagle';
    const ds = [];
    for (let d = 1; d < reach.length; d++) if (reach[d]) ds.push(d);
    Plotly.react(depthPanel.plot, [{type: 'bar', x: ds.map((d) => (layer ? `layer ${d - 1}` : `${d}`)),
      y: ds.map((d) => (hit[d] || 0) / reach[d]), customdata: ds.map((d) => [hit[d] || 0, reach[d]]),
      marker: {color: ds.map((d) => depthColor(d, ds.length))},
      hovertemplate: '%{x}: %{customdata[0]} of %{customdata[1]} trees reaching it (%{y:.1%})<extra></extra>'}], {
      height: 260, margin: {l: 56, r: 12, t: 8, b: 44}, plot_bgcolor: 'white',
      xaxis: {title: {text: layer ? 'draft layer' : 'depth in the draft tree'}, type: 'category'},
      yaxis: {title: {text: 'accepted (%)'}, tickformat: '.0%', range: [0, 1]}}, CONFIG);
    depthPanel.title.textContent = layer ? 'acceptance by layer (% of trees reaching it, this request)'
      : 'acceptance by depth (% of trees reaching it, this request)';
  }

  // Every request together: mean accept length per iteration, in Trace.aggregates' buckets with their band.
  function renderWhole() {
    const G = header.aggregate;
    if (!G || !G.iteration.length) { whole.box.style.display = 'none'; return; }
    const B = {size: G.bucket_size, x: G.iteration, mean: G.accept_length.mean, min: G.accept_length.min, max: G.accept_length.max};
    const per = G.bucket_size > 1 ? `iterations %{x}+${G.bucket_size}` : 'iteration %{x}';
    Plotly.react(whole.plot, [...bandTraces(B, '#1f77b4', 'accept length'),
      {type: 'scatter', mode: 'lines', x: B.x, y: B.mean, line: {color: '#1f77b4', width: 1},
       customdata: G.batch.mean, hovertemplate: `${per}: mean accept length %{y:.2f} over %{customdata:.1f} requests<extra></extra>`}], {
      height: 260, margin: {l: 56, r: 12, t: 8, b: 44}, plot_bgcolor: 'white', showlegend: false,
      xaxis: {title: {text: 'iteration'}, tickformat: 'd'},
      yaxis: {title: {text: 'mean accept length (tokens)'}, rangemode: 'tozero'}}, CONFIG);
    const all = header.requests.length === 1 ? 'its one request' : `all ${header.requests.length} requests`;
    whole.title.textContent = `whole run: mean accept length per iteration over ${all}` +
      (G.bucket_size > 1 ? ` · means of ${G.bucket_size} iterations, band min-max` : '');
  }

  function renderCalibration() {
    const C = header.calibration;
    const traces = [];
    if (C.probability && C.groups.length) {
      traces.push({type: 'scatter', x: [0, 1], y: [0, 1], mode: 'lines', line: {color: '#bbb', dash: 'dash'},
                   hoverinfo: 'skip', name: 'calibrated'});
    }
    const top = Math.max(1, ...C.groups.map((g) => g.depth));
    for (const g of C.groups) {
      traces.push({type: 'scatter', mode: 'lines+markers', name: g.label, x: g.score,
        y: g.accepted.map((a, j) => a / g.count[j]), customdata: g.count.map((c, j) => [g.accepted[j], c]),
        marker: {size: g.count.map((c) => 5 + Math.min(14, Math.sqrt(c))), color: depthColor(g.depth, top)},
        line: {color: depthColor(g.depth, top), width: 1.5},
        hovertemplate: `${g.label} · mean score %{x:.3f}: %{customdata[0]} of %{customdata[1]} accepted (%{y:.0%})<extra></extra>`});
    }
    Plotly.react(calib.plot, traces, {
      height: 260, margin: {l: 56, r: 12, t: 8, b: 44}, plot_bgcolor: 'white',
      legend: {font: {size: 11}, title: {text: C.unit}},
      xaxis: {title: {text: C.probability ? 'draft score (probability)' : 'draft score'}},
      yaxis: {title: {text: 'accepted (%)'}, tickformat: '.0%', range: [0, 1.02]}}, CONFIG);
    const of = C.sampled ? `a sample of ${C.sampled[0].toLocaleString('en')} of ${C.sampled[1].toLocaleString('en')} records`
      : 'whole trace';
    calib.title.textContent = C.groups.length
      ? `calibration by ${C.unit}: draft score against acceptance (${of}; marker size = count)`
      : 'calibration: no judged draft nodes in this trace';
  }

  // The tree and mask boxes keep one height for the whole request (its deepest tree, its largest mask),
  // so a step never changes the page's layout (JupyterLab would re-measure every cell of the notebook).
  function fixHeights() {
    let levels = 1, rows = 1;
    for (let k = 0; k < R.iteration.length; k++) {
      levels = Math.max(levels, R.deepest[k] + 2);  // + the bonus token's level
      rows = Math.max(rows, R.shown[k]);
    }
    const levelH = Math.max(36, Math.min(60, Math.floor(HEIGHT_PX / levels)));
    tree.plot.style.height = `${16 + levelH * levels + 24 + 40}px`;
    const cell = Math.max(4, Math.min(26, Math.floor(((widths.mask || 500) - 102) / rows), Math.floor(HEIGHT_PX / rows)));
    mask.plot.style.height = `${cell * rows + 6 + 78 + 4}px`;
  }

  // The picker lists the requests whose label holds the search text (an exact id first).
  function fillPicker() {
    const q = search.value.trim().toLowerCase();
    const hits = [];
    header.requests.forEach((r, i) => {
      if (String(r.id) === q) hits.unshift(i);
      else if (!q || r.label.toLowerCase().includes(q)) hits.push(i);
    });
    const shown = hits.slice(0, PICKER_MAX);
    if (!shown.includes(ri)) shown.unshift(ri);  // the request on show stays selectable
    picker.replaceChildren(...shown.map((i) => new Option(header.requests[i].label, String(i))));
    if (hits.length > PICKER_MAX) picker.append(new Option(`… ${hits.length - PICKER_MAX} more: refine the search`, '', false, false));
    picker.lastChild.disabled = hits.length > PICKER_MAX;
    picker.value = String(ri);
    search.title = `${hits.length} of ${header.requests.length} requests match`;
    return hits;
  }

  function showRequest(i, position = 0) {
    ri = i;
    const id = header.requests[i].id;
    picker.value = String(i);
    if (!reqs.has(id)) {  // asked from the kernel; shown when it arrives
      waiting = {request: id, position, index: i};
      message.textContent = `loading request ${id}…`;
      ask({kind: 'request', request: id, position});  // the reply brings that position's chunk
      return;
    }
    R = reqs.get(id);
    if (!R.text && parts.has('text')) ask({kind: 'text', request: id});
    chosen = null;
    tokIter = null;
    slider.max = String(Math.max(R.iteration.length - 1, 0));
    buildText();
    if (parts.has('plots')) renderRequestPlots();
    fixHeights();
    if (!R.iteration.length) { message.textContent = `request ${R.id} has no draft iterations`; return; }
    message.textContent = '';
    pos = Math.max(0, Math.min(R.iteration.length - 1, position));
    render();
  }

  function goTo(p) {
    const q = Math.max(0, Math.min(R.iteration.length - 1, p));
    if (q === pos && view) return;
    pos = q;
    chosen = null;  // a row chosen in one tree means nothing in another: back to the accepted path
    render();
  }

  function matches(k) {
    const kind = findKind.value, arg = Number(findArg.value);
    if (kind === 'zero') return R.accept_length[k] === 0;
    if (kind === 'depth') return R.first_reject_depth[k] === arg;
    if (kind === 'confident') return R.max_rejected_score[k] >= arg;
    return false;
  }

  function find(dir) {
    const n = R.iteration.length;
    if (findKind.value === 'slowest') {
      let best = -1, bestT = -Infinity;
      R.iteration_us.forEach((t, k) => { if (t !== null && t > bestT) { bestT = t; best = k; } });
      findNote.textContent = best < 0 ? 'no timings recorded' : `slowest: ${(bestT / 1000).toFixed(2)} ms`;
      if (best >= 0) goTo(best);
      return;
    }
    let count = 0;
    for (let k = 0; k < n; k++) if (matches(k)) count++;
    for (let step = 1; step <= n; step++) {
      const k = pos + dir * step;
      if (k < 0 || k >= n) break;
      if (matches(k)) { findNote.textContent = `${count} matching iteration${count === 1 ? '' : 's'}`; goTo(k); return; }
    }
    findNote.textContent = count ? `no further match (${count} in all)` : 'no matching iteration';
  }

  picker.onchange = () => { if (picker.value === '') return; stop(); showRequest(Number(picker.value)); };
  search.oninput = () => fillPicker();
  search.addEventListener('keydown', (e) => {
    if (e.key !== 'Enter') return;
    const hits = fillPicker();
    if (hits.length) { stop(); showRequest(hits[0]); fillPicker(); }
  });
  findKind.onchange = () => { findArg.step = findKind.value === 'confident' ? '0.05' : '1';
    findArg.value = findKind.value === 'confident' ? '0.5' : '1'; findNote.textContent = ''; };
  findNext.onclick = () => find(1);
  findPrev.onclick = () => find(-1);
  rowPick.onchange = () => { chosen = Number(rowPick.value) < 0 ? null : Number(rowPick.value); render(); };
  if (ownPlayer) ctl.bindKeys(root);
  textPanel.addEventListener('click', (e) => {
    const s = e.target.closest('.sv-out');
    if (!s) return;
    const k = tokIter[Number(s.dataset.pos)];
    if (k >= 0) goTo(k);
  });

  const tip = h('div', {class: 'sv-tip', role: 'tooltip'});
  root.append(tip);
  tree.plot.classList.add('sv-tree-area');
  tree.plot.addEventListener('mousemove', (e) => {
    const node = e.target.closest && e.target.closest('.sv-node');
    showTip(e, node ? treeTip(view, Number(node.dataset.node)) : null);
  });
  tree.plot.addEventListener('mouseleave', () => showTip(null, null));
  tree.plot.addEventListener('click', (e) => {
    const node = e.target.closest && e.target.closest('.sv-node');
    if (node && Number(node.dataset.node) >= 0) { chosen = Number(node.dataset.node); render(); }
  });
  mask.plot.addEventListener('mousemove', (e) => {
    const qc = maskCell(e);
    showTip(e, qc && [`query ${qc[0]} ${vtext(view.tokens[qc[0]])}`,
                      `${maskBit(view, qc[0], qc[1]) ? 'sees' : 'does not see'} key ${qc[1]} ${vtext(view.tokens[qc[1]])}`]);
  });
  mask.plot.addEventListener('mouseleave', () => showTip(null, null));
  mask.plot.addEventListener('click', (e) => {
    const qc = maskCell(e);
    const row = e.target.dataset && e.target.dataset.row !== undefined ? lay.shown[Number(e.target.dataset.row)] : qc && qc[0];
    if (row !== null && row !== undefined) { chosen = row; render(); }
  });
  const plots = parts.has('plots') ? [accept, timing, depthPanel, calib, whole] : [];
  for (const p of plots) Plotly.newPlot(p.plot, [], {}, CONFIG);
  for (const p of plots.slice(0, 2)) {
    p.plot.on('plotly_click', (e) => { const k = R.iteration.indexOf(e.points[0].x); if (k >= 0) goTo(k); });
  }

  // Figures take the width they are given: redraw when the page or a side panel resizes us.
  // Widths are read here, never while rendering a step: a read after a write forces a layout.
  let lastWidth = 0;
  const widths = {tree: 0, mask: 0};
  const measure = () => { widths.tree = tree.box.clientWidth; widths.mask = mask.box.clientWidth; };
  const resize = new ResizeObserver(() => {
    const w = root.clientWidth;
    if (!w || Math.abs(w - lastWidth) < 4 || !R) return;
    lastWidth = w;
    measure();
    for (const p of plots) Plotly.Plots.resize(p.plot);
    fixHeights();  // the mask's cells follow its width
    if (R.iteration.length) render();
  });
  resize.observe(root);

  measure();
  const initial = opts.initial || {};
  const start = Math.max(0, header.requests.findIndex((r) => r.id === initial.request));
  ri = start;
  fillPicker();
  showRequest(start, initial.position || 0);
  if (initial.selected >= 0) select(initial.selected);
  if (parts.has('plots')) { renderCalibration(); renderWhole(); }

  // Mark a node and its ancestors (a negative node: back to the accepted path) until the next step.
  function select(node) {
    chosen = node >= 0 ? node : null;
    if (view) render();
  }

  // A reply from the kernel: a request's columns, a chunk (its arrays in `buf`) or a request's text.
  function receive(msg, buf) {
    if (msg.kind === 'request') {
      addRequest(msg.data, buf);
      if (waiting && waiting.request === msg.data.id && waiting.index !== undefined) showRequest(waiting.index, waiting.position);
    } else if (msg.kind === 'chunk') {
      addChunk(msg.request, msg.chunk, msg.data, buf);
      if (waiting && R && waiting.request === R.id && waiting.position === pos) render();
    } else if (msg.kind === 'text') {
      const data = reqs.get(msg.request);
      if (!data) return;
      data.text = msg.data;
      Object.assign(texts, msg.data.texts);
      if (R === data) { buildText(data.text.out_start[pos] || 0); if (view) renderText(view); }
    }
  }

  return {
    goTo, showRequest, receive, select,
    state: () => ({request: R ? R.id : null, position: pos, iteration: R ? R.iteration[pos] : null,
                   selected: view ? selectedNode(view) : null, loading: Boolean(waiting)}),
    destroy() { stop(); resize.disconnect(); for (const p of plots) Plotly.purge(p.plot); },
  };
}

// ----- two runs compared by output position ------------------------------------------------------
// `compare` (widgets/compare.py): the sides' labels, the requests both ran, and per request and side the
// player position (`step`, -1: prefill), iteration and accept length of every output position. Each side
// is `mount`'s tree view of its own trace (`sides[j]`, `buffers[j]`), without a player: one player steps
// both through output positions, so a step draws two trees from arrays already in the page.
const SIDE_COLORS = ['#1f77b4', '#d62728'];
const COMPARE_PLOT = 190;
const COMPARE_CSS = `
.spectool-compare-page .spectool-compare-plot .sv-plot-area { height: ${COMPARE_PLOT}px; }  /* plotly resized may say 100% */
.spectool-compare-page .sv-compare-top { display: grid; grid-template-columns: minmax(0, 1.5fr) minmax(0, 1fr); gap: 10px; }
.spectool-compare-page .spectool-compare-summary { font-size: 12px; line-height: 1.45; overflow-wrap: anywhere; }
.spectool-compare-page .spectool-compare-first { color: ${COLORS.rejected}; font-weight: 600; }
.spectool-compare-page .sv-compare-sides { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 10px;
  margin-top: 6px; }
.spectool-compare-page .sv-compare-side { min-width: 0; border-top: 3px solid var(--side); padding-top: 2px; }
.spectool-compare-page .sv-compare-side > h4 { color: var(--side); }
.spectool-compare-page .sv-compare-note { font-weight: normal; margin-left: 8px; }
.spectool-compare-page .sv-compare-tree h4 { font-size: 12px; font-weight: 500; }
.spectool-compare-page .sv-compare-side-b .sv-legend { display: none; }  /* the same as side A's */
.spectool-compare-page .spectool-compare-jump { margin-left: 6px; }
.spectool-compare-page .sv-compare-idle .sv-compare-tree { visibility: hidden; }
`;
// The tree's levels share fewer pixels than in the viewer: plot, summary and both trees fit one screen.
const COMPARE_HEIGHT = 300;

export function mountCompare(root, compare, sides, buffers, Plotly, opts = {}) {
  root.classList.add('spectool-viewer', 'spectool-compare-page');
  root.tabIndex = 0;
  root.replaceChildren(h('style', {}, CSS + COMPARE_CSS));
  const message = h('div', {class: 'sv-message'});
  root.append(message);
  if (compare.error || !compare.requests.length) {
    message.textContent = compare.error || 'the two traces share no request ids';
    return {goTo() {}, showRequest() {}, receive() {}, plotly() {}, destroy() {}, state: () => ({})};
  }
  const aligned = new Map(Object.entries(compare.aligned || {}).map(([id, d]) => [Number(id), d]));

  // ----- controls, summary, plot and the two sides ----------------------------------------------
  const picker = h('select', {class: 'sv-request', 'aria-label': 'request'});
  compare.requests.forEach((r, i) => picker.append(new Option(r.label, String(i))));
  const ctl = makePlayer({unit: 'output token', sliderLabel: 'output position', length: () => C.length,
                         position: () => pos, goTo: (k) => goTo(k), loading: () => ctls.some((c) => c.state().loading)});
  const {play, speed, prev, next, slider, label, stop} = ctl;
  // One click from the summary's line that names the first difference.
  const jump = h('button', {class: 'spectool-compare-jump', title: 'the first output token where the runs differ'},
                 'go to first difference');
  root.append(h('div', {class: 'sv-bar spectool-player'}, picker, play, speed,
                 h('span', {class: 'sv-steps'}, prev, slider, next), label));
  const plot = panel('spectool-compare-plot', 'accept length of the iteration that produced each output token');
  const summary = h('div', {class: 'spectool-compare-summary'});
  root.append(h('div', {class: 'sv-compare-top'}, plot.box, summary));
  if (!Plotly) plot.plot.append(h('div', {class: 'sv-note'}, 'the plot is drawn when the kernel sends plotly.js'));
  const views = [], ctls = [];
  for (let j = 0; j < 2; j++) {
    const note = h('span', {class: 'sv-note sv-compare-note'});
    const tree = h('div', {class: 'sv-compare-tree'});
    const box = h('div', {class: `sv-compare-side sv-compare-side-${'ab'[j]}`, style: `--side: ${SIDE_COLORS[j]}`},
                  h('h4', {}, h('span', {class: 'sv-compare-label'}, compare.labels[j]), note), tree);
    views.push({box, note, tree});
  }
  root.append(h('div', {class: 'sv-compare-sides'}, ...views.map((v) => v.box)));
  const initial = opts.initial || {};
  const start = Math.max(0, compare.requests.findIndex((r) => r.id === initial.request));
  views.forEach((v, j) => ctls.push(mount(v.tree, sides[j], buffers[j], null, {
    parts: ['tree'], player: false, height: COMPARE_HEIGHT, initial: {request: compare.requests[start].id, position: -1},
    fetch: opts.fetch && ((msg) => opts.fetch({...msg, side: j})),
  })));

  // ----- state ----------------------------------------------------------------------------------
  let ci = 0, C = null, pos = 0, waiting = null, P = Plotly;

  function showRequest(i, position) {
    ci = i;
    picker.value = String(i);
    const id = compare.requests[i].id;
    if (!aligned.has(id)) {  // asked from the kernel; shown when it arrives
      waiting = {index: i, position};
      message.textContent = `loading request ${id}…`;
      if (opts.fetch) opts.fetch({kind: 'compare', request: id});
      return;
    }
    waiting = null;
    message.textContent = '';
    C = aligned.get(id);
    slider.max = String(Math.max(C.length - 1, 0));
    summary.replaceChildren(...C.summary.map((line) => h('div', line.first ? {class: 'spectool-compare-first'} : {},
      ...(line.label ? [h('b', {}, line.label)] : []), line.text, ...(line.first ? [jump] : []))));
    drawPlot();
    pos = -1;
    goTo(position === undefined || position === null ? C.start : position);
  }

  function goTo(p) {
    if (!C) return;
    const q = Math.max(0, Math.min(C.length - 1, p));
    if (q === pos) return;
    pos = q;
    render();
  }

  function render() {
    slider.value = String(pos);
    const id = C.id;
    views.forEach((v, j) => {
      const S = C.sides[j], k = pos < S.step.length ? S.step[pos] : null;
      const index = sides[j].requests.findIndex((r) => r.id === id);
      let why = null;
      if (index < 0) why = `request ${id} has no draft iterations in this run`;
      else if (k === null) why = `no output token ${pos}: this run's output has ${S.step.length} tokens`;
      else if (k < 0) why = `output token ${pos} came from prefill`;
      v.box.classList.toggle('sv-compare-idle', why !== null);
      if (why !== null) { v.note.textContent = why; return; }
      v.note.textContent = `from iteration ${S.iteration[pos]} · accept length ${S.accept_length[pos]}`;
      if (ctls[j].state().request === id) ctls[j].goTo(k);
      else ctls[j].showRequest(index, k);  // its data may be on its way: drawn when it arrives
    });
    label.textContent = `output token ${pos} (${pos + 1}/${C.length})` + (pos === C.first ? ' · first difference' : '');
    if (P) markCurrent(plot, plot.plot, pos);
    if (opts.onState) opts.onState({request: C.id, position: pos});
  }

  function drawPlot() {
    if (!P || !C) return;
    const traces = C.sides.map((S, j) => ({
      type: 'scatter', mode: 'lines', name: esc(clip(compare.labels[j], 60)), x: S.accept_length.map((_, t) => t).slice(1),
      y: S.accept_length.slice(1), customdata: S.iteration.slice(1), line: {color: SIDE_COLORS[j], shape: 'hv', width: 1.5},
      hovertemplate: 'output token %{x}: iteration %{customdata}, accept length %{y}<extra></extra>'}));
    const first = C.first === null ? [] : [{type: 'line', xref: 'x', yref: 'paper', x0: C.first, x1: C.first, y0: 0, y1: 1,
                                           line: {color: COLORS.rejected, width: 2, dash: 'dash'}}];
    P.react(plot.plot, traces, {
      height: COMPARE_PLOT, margin: {l: 56, r: 12, t: 22, b: 40}, plot_bgcolor: 'white', shapes: first,
      legend: {orientation: 'h', x: 0, y: 1.02, yanchor: 'bottom', font: {size: 11}},
      annotations: C.first === null ? [] : [{x: C.first, y: 0, yref: 'paper', yanchor: 'bottom', xanchor: 'left', showarrow: false,
        text: ` outputs differ from token ${C.first}`, font: {color: COLORS.rejected, size: 11}}],
      xaxis: {title: {text: 'output position (token index)'}, tickformat: 'd', range: [0, Math.max(C.length - 1, 1)]},
      yaxis: {title: {text: 'accept length (tokens)'}, rangemode: 'tozero', tickformat: 'd'}}, CONFIG);
    if (!plot.clicks) {
      plot.clicks = true;
      plot.plot.on('plotly_click', (e) => { stop(); goTo(Math.round(e.points[0].x)); });
    }
  }

  picker.onchange = () => { stop(); showRequest(Number(picker.value)); };
  jump.onclick = () => { stop(); if (C && C.first !== null) goTo(C.first); };
  ctl.bindKeys(root);
  // The plot takes the width it is given; not while hidden (JupyterLab hides cells scrolled far away), when
  // plotly would size it to nothing.
  let lastWidth = 0;
  const resize = new ResizeObserver(() => {
    const w = root.clientWidth;
    if (!w || Math.abs(w - lastWidth) < 4 || !P || !C) return;
    lastWidth = w;
    P.Plots.resize(plot.plot).then(() => markCurrent(plot, plot.plot, pos));
  });
  resize.observe(root);

  showRequest(start, initial.position);

  // A reply from the kernel: a request's alignment, or a side's request, chunk or text.
  function receive(msg, buf) {
    if (msg.kind === 'compare') {
      aligned.set(msg.data.id, msg.data);
      if (waiting && compare.requests[waiting.index].id === msg.data.id) showRequest(waiting.index, waiting.position);
    } else if (msg.side === 0 || msg.side === 1) {
      ctls[msg.side].receive(msg, buf);
    }
  }

  return {
    goTo, receive,
    showRequest(i, position) { stop(); showRequest(i, position); },
    // plotly.js arrived (the trees never wait for it)
    plotly(p) { if (P) return; P = p; plot.plot.replaceChildren(); drawPlot(); if (C) markCurrent(plot, plot.plot, pos); },
    state: () => ({request: C ? C.id : null, position: pos, loading: Boolean(waiting) || ctls.some((c) => c.state().loading),
                   iterations: C ? C.sides.map((S) => (pos < S.iteration.length ? S.iteration[pos] : null)) : []}),
    destroy() { stop(); resize.disconnect(); ctls.forEach((c) => c.destroy()); if (P) P.purge(plot.plot); },
  };
}

// Depth colours from one continuous scale, so deep levels never repeat shallow ones.
function depthColor(d, top) {
  const t = top <= 1 ? 0 : (d - 1) / (top - 1);
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const s = Math.min(stops.length - 2, Math.floor(t * (stops.length - 1)));
  const f = t * (stops.length - 1) - s;
  const c = stops[s].map((v, j) => Math.round(v + f * (stops[s + 1][j] - v)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// ----- the notebook widget ------------------------------------------------------------------
// plotly.js comes once per page from the kernel (the Python side answers a 'plotly' message, after the
// cell that is running). Until it is there -- and for good in a notebook reopened without a kernel --
// the view shows its static snapshot.
function loadPlotly(model) {
  if (globalThis.Plotly) return Promise.resolve(globalThis.Plotly);
  let shared = globalThis.__spectoolPlotly;
  if (!shared) {
    shared = globalThis.__spectoolPlotly = {asked: 0};
    shared.promise = new Promise((resolve) => { shared.resolve = resolve; });
    // Another widget on the page (plotly's FigureWidget) may bring plotly.js first, even without a kernel.
    const poll = setInterval(() => { if (globalThis.Plotly) { clearInterval(poll); shared.resolve(globalThis.Plotly); } }, 300);
    shared.promise.then(() => clearInterval(poll));
  }
  model.on('msg:custom', (msg, buffers) => {
    if (!msg || msg.kind !== 'plotly' || !buffers || !buffers.length || shared.loading) return;
    shared.loading = true;
    const url = URL.createObjectURL(new Blob([buffers[0]], {type: 'text/javascript'}));
    const amd = globalThis.define;
    globalThis.define = undefined;  // plotly's UMD wrapper must set the global, not define an AMD module
    const script = document.createElement('script');
    script.src = url;
    script.onload = () => { globalThis.define = amd; shared.resolve(globalThis.Plotly || null); };
    script.onerror = () => { globalThis.define = amd; shared.resolve(null); };
    document.head.append(script);
  });
  // One request per page; another model asks again only when the first got no answer for a while
  // (its kernel may have gone away).
  if (!shared.asked || performance.now() - shared.asked > 20000) {
    shared.asked = performance.now();
    try { model.send({kind: 'plotly'}); } catch (e) { /* no kernel: the snapshot stays */ }
  }
  return shared.promise;
}

function showSnapshot(model, el, why) {
  el.replaceChildren();
  const svg = model.get('snapshot');
  if (svg) {
    const img = document.createElement('img');
    img.src = 'data:image/svg+xml;base64,' + btoa(unescape(encodeURIComponent(svg)));
    img.alt = 'static snapshot of the trace viewer';
    img.className = 'spectool-snapshot';
    img.style.maxWidth = '100%';
    el.append(img);
  }
  el.append(h('div', {class: 'sv-note', style: 'color:#666;font:12px system-ui,sans-serif'}, why));
}

// CompareView's page: the trees start at once, the plot when plotly.js is there.
function renderCompare(model, el) {
  const json = (name) => JSON.parse(new TextDecoder().decode(model.get(name) || new Uint8Array()) || '{}');
  const own = (dv) => (dv ? dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength) : new ArrayBuffer(0));
  const compare = json('compare_json'), sides = json('sides_json');
  let pending = null;
  const ctl = mountCompare(el, compare, sides, [own(model.get('blob_a')), own(model.get('blob_b'))], globalThis.Plotly || null, {
    initial: {request: model.get('request'), position: model.get('position')},
    fetch: (msg) => { try { model.send(msg); } catch (e) { /* no kernel: what was sent stays steppable */ } },
    onState: (s) => {  // once stepping pauses, as the viewer does
      clearTimeout(pending);
      pending = setTimeout(() => { model.set('request', s.request); model.set('position', s.position); model.save_changes(); }, 1000);
    },
  });
  const reply = (msg, buffers) => {
    if (msg && (msg.kind === 'compare' || msg.side === 0 || msg.side === 1)) ctl.receive(msg, own(buffers && buffers[0]));
  };
  model.on('msg:custom', reply);
  if (!compare.error) loadPlotly(model).then((P) => { if (P) ctl.plotly(P); });
  const follow = () => {
    const s = ctl.state();
    const i = compare.requests.findIndex((r) => r.id === model.get('request'));
    if (i >= 0 && model.get('request') !== s.request) ctl.showRequest(i, model.get('position'));
    else if (model.get('position') !== s.position) ctl.goTo(model.get('position'));
  };
  model.on('change:position', follow);
  model.on('change:request', follow);
  return () => {
    clearTimeout(pending); model.off('msg:custom', reply); model.off('change:position', follow);
    model.off('change:request', follow); ctl.destroy();
  };
}

export default {
  async render({model, el}) {
    if (model.get('compare_json') !== undefined) return renderCompare(model, el);
    const header = JSON.parse(new TextDecoder().decode(model.get('header_json') || new Uint8Array()) || '{}');
    const error = header.error;
    showSnapshot(model, el, error || 'static snapshot: the interactive view starts when the kernel answers');
    const parts = model.get('parts') || [];
    // The tree and the mask are plain SVG: a view of those alone starts without plotly.js.
    const Plotly = parts.length && !parts.includes('plots') ? null : await loadPlotly(model);
    if (!Plotly && (!parts.length || parts.includes('plots'))) return;  // el may not be in the page yet (plotly.js already there): mount anyway, it measures on resize
    const own = (dv) => (dv ? dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength) : new ArrayBuffer(0));
    let pending = null, ctl = null;
    // The kernel's replies to the page's questions (a request, a chunk, a text): binary arrays as a buffer.
    const reply = (msg, buffers) => {
      if (ctl && msg && ['request', 'chunk', 'text'].includes(msg.kind)) ctl.receive(msg, own(buffers && buffers[0]));
    };
    model.on('msg:custom', reply);
    ctl = mount(el, header, own(model.get('blob')), Plotly, {
      initial: {request: model.get('request'), position: model.get('position'), selected: model.get('selected')},
      parts,
      fetch: (msg) => { try { model.send(msg); } catch (e) { /* no kernel: what was sent stays steppable */ } },
      // Tell the kernel where we are (for to_figure and the saved snapshot) once stepping pauses:
      // syncing on every step would put the kernel's reply on the step's path.
      onState: (s) => {
        clearTimeout(pending);
        pending = setTimeout(() => { model.set('request', s.request); model.set('position', s.position); model.save_changes(); }, 1000);
      },
    });
    const follow = () => {
      const s = ctl.state();
      const i = header.requests.findIndex((r) => r.id === model.get('request'));
      if (i >= 0 && model.get('request') !== s.request) ctl.showRequest(i, model.get('position'));
      else if (model.get('position') !== s.position) ctl.goTo(model.get('position'));
    };
    model.on('change:position', follow);
    model.on('change:request', follow);
    const mark = () => ctl.select(model.get('selected'));
    model.on('change:selected', mark);
    return () => {
      clearTimeout(pending); model.off('msg:custom', reply); model.off('change:position', follow);
      model.off('change:request', follow); model.off('change:selected', mark); ctl.destroy();
    };
  },
};
