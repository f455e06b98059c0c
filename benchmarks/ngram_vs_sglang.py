"""spectool's n-gram corpus against SGLang's on the same tokens: get + put per request, drafts, memory.

Figure: docs/BENCHMARKS.md "N-gram corpus". Time: about 12 minutes on a 2-core CPU (2 of them build SGLang's sources).

SGLang ships its n-gram corpus as C++ sources that it compiles when first used, through
apache-tvm-ffi. This script takes those sources from an SGLang wheel (or an unpacked package or
checkout), compiles them in a temporary directory with the flags SGLang's JIT uses
(``-std=c++20 -O3 -fPIC``, linked against tvm-ffi), loads the module through tvm-ffi and calls
the corpus object the way SGLang's Python wrapper does (token rows as Python lists packed into
CSR tensors, fresh output tensors per get). Nothing of SGLang's is kept here or installed.

    pip download sglang==0.5.23 --no-deps -d /tmp/sg
    pip install apache-tvm-ffi==0.1.11      # the version that wheel pins
    python benchmarks/ngram_vs_sglang.py --sglang-wheel /tmp/sg/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl

Both corpora get benchmarks/ngram_corpus.py's tokens and settings (its tokenizer and 1M tokens
of standard-library source put in 4096-token windows; depth 18, N 12, breadth 1..10, capacity
10M nodes; SGLang's server defaults are the same) and its decode loop: ``bs`` requests decode
held-out source one token per iteration, a get of the last 18 tokens, then a put of the
18-token window and a synchronize. Each corpus is put to as its engine does: spectool with
request ids (only the new token is counted), SGLang with the window alone (its n-gram worker
puts the last 18 tokens of each request every iteration, and its trie counts every n-gram of
them again). The two run in turn on the same streams, BFS and then PROB; medians of --repeats.

Drafts: on held-out positions right after the training put, how often the two trees are the same
set of paths and the mean accept length (drafted tokens the text continues with, + 1); then a
greedy decode of held-out requests in which each corpus is put to its own way, and its accept
length. Memory: the resident-set growth of a fresh process that builds each corpus from the
same tokens, empty and after the put.

Exit status 2, with the reason, when the sources, the compiler, tvm-ffi or the build fail.
Prints tables and writes ngram_vs_sglang.json to --out or $OUT if set.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from ngram_corpus import CHUNK, DEPTH, WINDOW, N, decode_loop, load_tokens
from tqdm import tqdm

from spectool.native import NgramCorpus

MIN_BREADTH, MAX_BREADTH = 1, 10
CSRC = "sglang/kernels/jit/csrc/ngram_corpus"
INCLUDE = "sglang/kernels/jit/include"
WRAPPER = "sglang/kernels/ops/speculative/ngram_corpus.py"
# The headers and sources the corpus and its binding include; the units SGLang compiles are read
# from its wrapper (these where it has none).
NEEDED = ("ngram.cpp", "ngram.h", "trie.cpp", "trie.h", "result.cpp", "result.h", "suffix_automaton.cpp",
          "suffix_automaton.h", "param.h", "queue.h", "ngram_corpus_ffi.cpp")
UNITS = ("result.cpp", "trie.cpp", "suffix_automaton.cpp", "ngram.cpp", "ngram_corpus_ffi.cpp")
CFLAGS = ("-std=c++20", "-O3", "-fPIC")  # SGLang's JIT: its default flags and the platform's -fPIC
ACCEPT_BS = 8


class BuildError(Exception):
    """Why SGLang's corpus could not be built or loaded (the script exits 2 with it)."""


# ---------------------------------------------------------------- SGLang's sources and build


def extract_sources(args: argparse.Namespace, into: Path) -> dict:
    """Copies SGLang's n-gram corpus sources, the headers they include and the wrapper that names
    the units to compile from the wheel or source tree into ``into``; returns where they are."""
    if args.sglang_wheel:
        wheel = Path(args.sglang_wheel)
        if not wheel.is_file():
            raise BuildError(f"--sglang-wheel {wheel}: no such file")
        try:
            with zipfile.ZipFile(wheel) as z:
                names = [n for n in z.namelist() if n.startswith((CSRC + "/", INCLUDE + "/", WRAPPER))]
                z.extractall(into, members=names)
                meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
                metadata = z.read(meta).decode() if meta else ""
        except zipfile.BadZipFile as e:
            raise BuildError(f"--sglang-wheel {wheel}: not a wheel ({e})") from e
        version = re.search(r"^Version: (\S+)", metadata, re.M)
        pin = re.search(r"^Requires-Dist: apache-tvm-ffi\s*([^;\s]*)", metadata, re.M)
        source = {"from": str(wheel), "version": version.group(1) if version else None,
                  "tvm_ffi_pin": pin.group(1) if pin else None}
    else:
        given = Path(args.sglang_src)
        roots = [given, given.parent, given / "python"]  # site-packages, the sglang package, a checkout
        root = next((r for r in roots if (r / CSRC).is_dir()), None)
        if root is None:
            raise BuildError(f"--sglang-src {given}: no {CSRC}/ in it (give the folder that holds the sglang "
                             "package, the package itself, or an SGLang checkout)")
        for part in (CSRC, INCLUDE):
            if (root / part).is_dir():
                shutil.copytree(root / part, into / part)
        if (root / WRAPPER).is_file():
            (into / WRAPPER).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / WRAPPER, into / WRAPPER)
        version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (root / "sglang/version.py").read_text()) \
            if (root / "sglang/version.py").is_file() else None
        source = {"from": str(given), "version": version.group(1) if version else None, "tvm_ffi_pin": None}
    csrc = into / CSRC
    missing = [f for f in NEEDED if not (csrc / f).is_file()]
    missing += [h for h in ("sgl_kernel/ffi.h", "sgl_kernel/tensor.h") if not (into / INCLUDE / h).is_file()]
    if missing:
        raise BuildError(f"SGLang's n-gram corpus sources are incomplete: missing {', '.join(missing)} "
                         f"(looked in {source['from']})")
    units = UNITS
    if (into / WRAPPER).is_file():
        named = re.findall(r"ngram_corpus/(\w+\.cpp)", (into / WRAPPER).read_text())
        units = tuple(dict.fromkeys(named)) or UNITS
    absent = [u for u in units if not (csrc / u).is_file()]
    if absent:
        raise BuildError(f"SGLang's wrapper compiles {', '.join(absent)}, which the sources lack")
    return {**source, "csrc": csrc, "include": into / INCLUDE, "units": units}


def import_tvm_ffi(pin: str | None):
    """tvm-ffi, SGLang's binding layer (imported lazily: only this benchmark needs it)."""
    want = f"apache-tvm-ffi{pin}" if pin else "apache-tvm-ffi"
    try:
        import tvm_ffi
        from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path, find_libtvm_ffi
    except ImportError as e:
        raise BuildError(f"SGLang's corpus loads through tvm-ffi, which is not installed ({e}): "
                         f"pip install '{want}'") from e
    if pin and pin.startswith("==") and tvm_ffi.__version__ != pin[2:]:
        print(f"note: tvm-ffi {tvm_ffi.__version__} installed, the wheel pins {pin}")
    includes = list(dict.fromkeys([find_include_path(), find_dlpack_include_path()]))
    return tvm_ffi, includes, Path(find_libtvm_ffi())


def build(sources: dict, workdir: Path, build_dir: Path | None) -> tuple[Path, dict]:
    """Compiles SGLang's units into one shared module (reusing one in ``build_dir`` built from the
    same sources, flags, compiler and tvm-ffi); returns its path and how it was built."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler {cxx!r} on PATH (install g++ or set CXX)")
    tvm_ffi, includes, lib = import_tvm_ffi(sources["tvm_ffi_pin"])
    flags = [*CFLAGS, f"-I{sources['include']}", *(f"-I{i}" for i in includes)]
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    key = hashlib.sha256("\n".join([compiler, tvm_ffi.__version__, *CFLAGS, *sorted(
        f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
        for d in (sources["csrc"], sources["include"]) for p in d.rglob("*") if p.is_file())]).encode()).hexdigest()
    info = {"compiler": compiler, "cflags": list(CFLAGS), "units": list(sources["units"]),
            "tvm_ffi": tvm_ffi.__version__}
    out_dir = build_dir or workdir / "build"
    out_dir.mkdir(parents=True, exist_ok=True)
    module = out_dir / f"sglang_ngram_corpus_{key[:16]}.so"
    if module.is_file():
        print(f"SGLang's corpus: reusing {module}")
        return module, {**info, "build_s": 0.0, "reused": True}
    t0 = time.perf_counter()
    objects = []
    for unit in tqdm(sources["units"], desc="compiling SGLang's n-gram corpus", unit="file"):
        obj = workdir / f"{unit}.o"
        run_compiler([cxx, *flags, "-c", str(sources["csrc"] / unit), "-o", str(obj)])
        objects.append(str(obj))
    partial = module.with_suffix(".partial")
    run_compiler([cxx, "-shared", *objects, f"-L{lib.parent}", f"-l{lib.stem.removeprefix('lib')}",
                  f"-Wl,-rpath,{lib.parent}", "-pthread", "-o", str(partial)])
    partial.replace(module)
    return module, {**info, "build_s": time.perf_counter() - t0, "reused": False}


def run_compiler(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.splitlines()
        errors = [line for line in lines if " error" in line or "fatal" in line]
        shown = "\n".join((errors or lines)[:40])
        raise BuildError(f"the compiler failed (exit {done.returncode}) on\n  {' '.join(cmd)}\n{shown}")


_CLASSES: dict[str, type] = {}


def sglang_class(module_path: str):
    """The tvm-ffi class of SGLang's corpus object from the built module (once per process, as the
    type registers once)."""
    if module_path not in _CLASSES:
        import tvm_ffi

        try:
            module = tvm_ffi.load_module(module_path)
            module.register_once()
        except Exception as e:  # an undefined symbol, a tvm-ffi of another ABI
            raise BuildError(f"the built module does not load through tvm-ffi: {e}") from e

        @tvm_ffi.register_object("sgl.NgramCorpus")
        class SglangNgramCorpusObject(tvm_ffi.Object):
            __slots__ = ("__dict__",)

            def __init__(self, *args: int) -> None:
                self.__ffi_init__(*args)

        _CLASSES[module_path] = SglangNgramCorpusObject
    return _CLASSES[module_path]


# ---------------------------------------------------------------- the two corpora behind one interface


class SglangCorpus:
    """SGLang's corpus object, called as SGLang's Python wrapper calls it from its n-gram worker:
    token rows are Python lists packed into int32 CSR tensors, request ids map to state ids, each
    get fills fresh output tensors and returns them as int64 numpy arrays. ``ffi_s`` counts the
    seconds spent inside the object's methods (what is left is the wrapper's Python)."""

    def __init__(self, module_path: str, match: str, capacity: int) -> None:
        import torch

        self._torch = torch
        self._obj = sglang_class(module_path)(capacity, DEPTH, MIN_BREADTH, MAX_BREADTH, N,
                                              {"bfs": 0, "prob": 1}[match], 0, 10_000_000)
        self._state_ids: dict[int, int] = {}
        self._next_state = itertools.count()
        self.ffi_s = {"get": 0.0, "put": 0.0}

    @staticmethod
    def as_lists(tails: np.ndarray, lens: list[int], windows: np.ndarray, put_lens: list[int]) -> tuple:
        """A decode-loop batch as SGLang's worker holds it: lists of token lists."""
        return tails.tolist(), lens, windows.tolist(), put_lens

    def _csr(self, rows: list[list[int]]):
        flat, offsets = [], [0]
        for row in rows:
            flat.extend(row)
            offsets.append(len(flat))
        return self._torch.tensor(flat, dtype=self._torch.int32), self._torch.tensor(offsets, dtype=self._torch.int64)

    def batch_get(self, req_ids: list[int], tails: list[list[int]], total_lens: list[int]) -> tuple:
        torch = self._torch
        state_ids = []
        for r in req_ids:
            if r not in self._state_ids:
                self._state_ids[r] = next(self._next_state)
            state_ids.append(self._state_ids[r])
        flat, offsets = self._csr(tails)
        out_tokens = torch.zeros(len(tails) * N, dtype=torch.int32)
        out_mask = torch.zeros(len(tails) * N * N, dtype=torch.uint8)
        args = (torch.tensor(state_ids, dtype=torch.int64), flat, offsets,
                torch.tensor(total_lens, dtype=torch.int64), out_tokens, out_mask)
        t0 = time.perf_counter()
        self._obj.batch_match_stateful(*args)
        self.ffi_s["get"] += time.perf_counter() - t0
        return out_tokens.numpy().astype(np.int64), out_mask.numpy().astype(np.int64)

    def batch_put(self, windows: list[list[int]], req_ids=None, total_lens=None) -> None:
        """SGLang's put takes the windows alone (the ids and lengths the loop passes are unused)."""
        flat, offsets = self._csr(windows)
        t0 = time.perf_counter()
        self._obj.async_insert(flat, offsets)
        self.ffi_s["put"] += time.perf_counter() - t0

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self._obj.synchronize()
        self.ffi_s["put"] += time.perf_counter() - t0

    def erase_match_state(self, req_ids: list[int]) -> None:
        state_ids = [self._state_ids.pop(r) for r in req_ids if r in self._state_ids]
        if state_ids:
            self._obj.erase_match_state(self._torch.tensor(state_ids, dtype=self._torch.int64))

    def put_training(self, train: np.ndarray) -> None:
        self.batch_put([train[i:i + CHUNK].tolist() for i in range(0, len(train), CHUNK)])
        self.synchronize()

    def trees(self, req_ids: list[int], tails: list[np.ndarray], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask = self.batch_get(req_ids, [t.tolist() for t in tails], lens)
        return tokens.reshape(len(tails), N), mask.reshape(len(tails), N, N).astype(bool)

    def put_decoded(self, req_ids: list[int], windows: list[np.ndarray], lens: list[int]) -> None:
        self.batch_put([w.tolist() for w in windows])


class SpectoolCorpus(NgramCorpus):
    """spectool's corpus with the two calls the draft comparison makes of both."""

    def put_training(self, train: np.ndarray) -> None:
        self.batch_put([train[i:i + CHUNK] for i in range(0, len(train), CHUNK)])
        self.synchronize()

    def trees(self, req_ids: list[int], tails: list[np.ndarray], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        got = self.batch_get(req_ids, tails, lens)
        return got.tokens, got.mask

    def put_decoded(self, req_ids: list[int], windows: list[np.ndarray], lens: list[int]) -> None:
        self.batch_put(windows, req_ids, lens)  # as spectool's drafter puts: with ids, new tokens only


def make(kind: str, match: str, capacity: int, module_path: str):
    if kind == "spectool":
        return SpectoolCorpus(max_trie_depth=DEPTH, min_bfs_breadth=MIN_BREADTH, max_bfs_breadth=MAX_BREADTH,
                              num_draft_tokens=N, match=match, capacity=capacity)
    return SglangCorpus(module_path, match, capacity)


# ---------------------------------------------------------------- drafts


def accept_lengths(tokens: np.ndarray, mask: np.ndarray, continuations: np.ndarray) -> np.ndarray:
    """Per tree: how many tokens of its continuation its deepest matching path drafts, + 1 (the
    token verification adds). Paths come from the mask alone: node k is on q's path iff mask[q, k],
    and k's depth is its ancestor count; padding counts as drafted tokens, as a verifier sees it."""
    depth = mask.sum(-1) - 1
    expected = np.take_along_axis(continuations, np.maximum(depth - 1, 0), axis=1)
    on_text = (tokens == expected) | (depth == 0)
    matches = ~(mask & ~on_text[:, None, :]).any(-1)
    return np.where(matches, depth, 0).max(-1) + 1


def tree_paths(tokens: np.ndarray, mask: np.ndarray) -> set[tuple[int, ...]]:
    """The tree as the set of its root-to-node token paths (node order and padding position aside)."""
    return {tuple(int(t) for t in tokens[1:][row[1:]]) for row in mask}


def compare_static(corpora: dict, held: np.ndarray, positions: int) -> dict:
    """Both trees at each held-out position, with no decode puts between: identical path sets and
    mean accept length per corpus."""
    starts = np.arange(WINDOW, WINDOW + positions)
    same, accepts = 0, {k: [] for k in corpora}
    for b in range(0, positions, 64):
        at = starts[b:b + 64]
        tails = [held[p - WINDOW:p] for p in at]
        conts = np.stack([held[p:p + N - 1] for p in at])
        ids = list(range(len(at)))
        got = {}
        for kind, corpus in corpora.items():
            got[kind] = corpus.trees(ids, tails, [int(p) for p in at])
            corpus.erase_match_state(ids)
            accepts[kind].append(accept_lengths(*got[kind], conts))
        (t1, m1), (t2, m2) = got.values()
        same += sum(tree_paths(t1[i], m1[i]) == tree_paths(t2[i], m2[i]) for i in range(len(at)))
    return {"positions": positions, "same_tree": same / positions,
            "accept": {k: float(np.concatenate(v).mean()) for k, v in accepts.items()}}


def greedy_decode(corpus, streams: list[np.ndarray]) -> dict:
    """Greedy speculative decoding of each stream (its first WINDOW tokens the prompt): per
    iteration a get, the accepted tokens, and the put the corpus's engine makes."""
    ids = list(range(len(streams)))
    pos = [WINDOW] * len(streams)
    accepted = []
    while ids:
        tails = [streams[r][pos[r] - WINDOW:pos[r]] for r in ids]
        conts = np.stack([streams[r][pos[r]:pos[r] + N - 1] for r in ids])
        corpus.synchronize()
        accept = accept_lengths(*corpus.trees(ids, tails, [pos[r] for r in ids]), conts)
        for r, a in zip(ids, accept):
            pos[r] += int(a)
        accepted += accept.tolist()
        corpus.put_decoded(ids, [streams[r][pos[r] - WINDOW:pos[r]] for r in ids], [pos[r] for r in ids])
        done = [r for r in ids if pos[r] + N - 1 > len(streams[r])]
        corpus.erase_match_state(done)
        ids = [r for r in ids if r not in done]
    corpus.synchronize()
    return {"iterations": len(accepted), "accept": float(np.mean(accepted))}


# ---------------------------------------------------------------- timing


def time_pair(corpora: dict, held: np.ndarray, args: argparse.Namespace) -> list[dict]:
    """The decode loop at bs 1, 8, 64: each repeat on fresh streams, spectool and then SGLang on
    the same ones; medians over the repeats."""
    stretch = args.iters + WINDOW + 1
    next_stretch, rows = 0, []
    progress = tqdm(total=3 * args.repeats, desc="timing bs 1, 8, 64", unit="run")
    for bs in (1, 8, 64):
        runs = {kind: [] for kind in corpora}
        for _ in range(args.repeats):
            progress.update()
            streams = [held[(next_stretch + r) * stretch:(next_stretch + r + 1) * stretch] for r in range(bs)]
            next_stretch += bs
            for kind, corpus in corpora.items():
                corpus.erase_match_state(list(range(bs)))
                if kind == "sglang":
                    corpus.ffi_s = {"get": 0.0, "put": 0.0}
                    timed = decode_loop(corpus, streams, WINDOW + 1, args.iters, sync=True,
                                        convert=SglangCorpus.as_lists)
                    runs[kind].append((*timed, corpus.ffi_s["get"], corpus.ffi_s["put"]))
                else:
                    runs[kind].append(decode_loop(corpus, streams, WINDOW + 1, args.iters, sync=True))
        n = args.iters * bs
        row = {"bs": bs}
        for kind, rs in runs.items():
            med = [float(np.median(x)) / n * 1e6 for x in zip(*rs)]
            row[kind] = {"get_us": med[0], "put_us": med[1], "total_us": float(np.median([r[0] + r[1] for r in rs]))
                         / n * 1e6, "cpu_us": med[2], "get_cpu_us": med[3]}
            if kind == "sglang":
                row[kind].update(get_ffi_us=med[4], put_ffi_us=med[5])
        row["ratio"] = row["sglang"]["total_us"] / row["spectool"]["total_us"]
        row["cpu_ratio"] = row["sglang"]["cpu_us"] / row["spectool"]["cpu_us"]
        rows.append(row)
    progress.close()
    return rows


def held_regions(held: np.ndarray, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint held-out regions for the timing, the static draft check and the greedy decode."""
    timing = (1 + 8 + 64) * args.repeats * (args.iters + WINDOW + 1)
    static = args.positions + WINDOW + N
    decode = ACCEPT_BS * args.decode_tokens
    if timing + static + decode > len(held):
        raise ValueError(f"--iters/--repeats/--positions/--decode-tokens need {timing + static + decode} held-out "
                         f"tokens, there are {len(held)}")
    return held[:timing], held[timing:timing + static], held[timing + static:timing + static + decode]


def run_match(match: str, train: np.ndarray, held: np.ndarray, module: str, args: argparse.Namespace) -> dict:
    timing, static, decode = held_regions(held, args)
    corpora, build_s = {}, {}
    for kind in ("spectool", "sglang"):
        corpora[kind] = make(kind, match, args.capacity, module)
        t0 = time.perf_counter()
        corpora[kind].put_training(train)
        build_s[kind] = time.perf_counter() - t0
    stats = corpora["spectool"].stats()
    print(f"\n{match.upper()}: put {len(train)} tokens in {build_s['spectool']:.1f}s (spectool: {stats['nodes']} "
          f"nodes, {stats['evictions']} evictions) and {build_s['sglang']:.1f}s (SGLang)")
    drafts = compare_static(corpora, static, args.positions)
    rows = time_pair(corpora, timing, args)
    streams = [decode[r * args.decode_tokens:(r + 1) * args.decode_tokens] for r in range(ACCEPT_BS)]
    decoded = {kind: greedy_decode(corpus, streams) for kind, corpus in corpora.items()}

    print(f"{match.upper()}, µs per request, one core, medians of {args.repeats} runs. Wall: get, put + "
          "synchronize, both; cpu: the calling thread's in get, the process's (all threads) in get + put; "
          "C++: SGLang's time inside its object's methods (the rest is its wrapper's Python)")
    print(f"{'':>4} {'spectool':^38} | {'SGLang':^54} | {'SGLang / spectool':^15}")
    print(f"{'bs':>4} {'get':>7} {'put':>7} {'get+put':>8} {'get cpu':>7} {'cpu':>7} | {'get':>7} {'C++':>7} "
          f"{'put':>7} {'C++':>7} {'get+put':>8} {'get cpu':>7} {'cpu':>7} | {'wall':>6} {'cpu':>6}")
    for r in rows:
        s, g = r["spectool"], r["sglang"]
        print(f"{r['bs']:>4} {s['get_us']:>7.2f} {s['put_us']:>7.2f} {s['total_us']:>8.2f} {s['get_cpu_us']:>7.2f} "
              f"{s['cpu_us']:>7.2f} | {g['get_us']:>7.2f} {g['get_ffi_us']:>7.2f} {g['put_us']:>7.2f} "
              f"{g['put_ffi_us']:>7.2f} {g['total_us']:>8.2f} {g['get_cpu_us']:>7.2f} {g['cpu_us']:>7.2f} | "
              f"{r['ratio']:>5.2f}x {r['cpu_ratio']:>5.2f}x")
    print(f"drafts on {args.positions} held-out positions: {100 * drafts['same_tree']:.1f} % the same tree; "
          f"accept length spectool {drafts['accept']['spectool']:.3f}, SGLang {drafts['accept']['sglang']:.3f}")
    print(f"greedy decode of {ACCEPT_BS} held-out requests of {args.decode_tokens} tokens, each corpus put to "
          f"its own way: accept length spectool {decoded['spectool']['accept']:.3f} "
          f"({decoded['spectool']['iterations']} gets), SGLang {decoded['sglang']['accept']:.3f} "
          f"({decoded['sglang']['iterations']} gets)")
    return {"match": match, "build_s": build_s, "nodes": stats["nodes"], "evictions": stats["evictions"],
            "rows": rows, "drafts": drafts, "decode": decoded}


# ---------------------------------------------------------------- memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory() -> None:
    """Hands the heap a freed corpus leaves back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_child(kind: str, tokens_path: str, capacity: int, module: str) -> dict:
    """In a fresh process: resident-set growth of one corpus, empty and after the training put."""
    import torch  # noqa: F401  (imported before the baseline: SGLang's wrapper and tvm-ffi use it)

    train = np.load(tokens_path)
    if kind == "sglang":
        sglang_class(module)
    base = rss_bytes()
    corpus = make(kind, "bfs", capacity, module)
    empty = rss_bytes() - base
    corpus.put_training(train)
    full = rss_bytes() - base
    return {"empty_bytes": empty, "full_bytes": full,
            "nodes": corpus.stats()["nodes"] if kind == "spectool" else None}


def measure_memory(train: np.ndarray, capacity: int, module: str, workdir: Path) -> dict | None:
    """Each corpus built in its own fresh process, one after the other; bytes per node over
    spectool's node count (SGLang reports none: with the same puts and capacity its trie holds the
    same n-grams, or is as full). None, with the reason printed, if a process dies."""
    path = workdir / "train.npy"
    np.save(path, train)
    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path  # the fresh process imports this module by name, as it runs here
    if added:
        sys.path.insert(0, here)
    out = {"capacity": capacity}
    try:
        for kind in ("spectool", "sglang"):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                out[kind] = pool.submit(memory_child, kind, str(path), capacity, module).result()
    except BrokenProcessPool as e:
        print(f"memory not measured: the process building {kind}'s corpus died ({e}; out of memory?)")
        return None
    finally:
        if added:
            sys.path.remove(here)
    out["nodes"] = out["spectool"].pop("nodes")
    out["sglang"].pop("nodes")
    for kind in ("spectool", "sglang"):
        m = out[kind]
        m.update(bytes_per_node=m["full_bytes"] / out["nodes"], empty_bytes_per_slot=m["empty_bytes"] / capacity,
                 added_bytes_per_node=(m["full_bytes"] - m["empty_bytes"]) / out["nodes"])
    return out


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sglang-wheel", help="an SGLang wheel (pip download sglang --no-deps -d DIR)")
    src.add_argument("--sglang-src", help="a folder holding the sglang package (site-packages, or a checkout)")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens put before timing")
    ap.add_argument("--iters", type=int, default=100, help="decode iterations per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per batch size and corpus (median)")
    ap.add_argument("--capacity", type=int, default=10_000_000, help="trie capacity in nodes, both corpora")
    ap.add_argument("--match", default="both", choices=["bfs", "prob", "both"])
    ap.add_argument("--positions", type=int, default=4096, help="held-out positions of the draft comparison")
    ap.add_argument("--decode-tokens", type=int, default=2000, help="tokens per request of the greedy decode")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement (two more builds)")
    ap.add_argument("--build-dir", help="build SGLang's module here and reuse it on later runs (default: a "
                    "temporary folder, removed)")
    ap.add_argument("--out", help="folder for ngram_vs_sglang.json (default $OUT, if set)")
    args = ap.parse_args(argv)
    for name in ("tokens", "iters", "repeats", "positions", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.capacity < DEPTH:
        ap.error(f"--capacity must be at least {DEPTH}")
    if args.decode_tokens < WINDOW + N:
        ap.error(f"--decode-tokens must be at least {WINDOW + N} (a {WINDOW}-token prompt and one tree's worth)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sglang_ngram_") as tmp:
        workdir = Path(tmp)
        try:
            sources = extract_sources(args, workdir / "src")
            module, build_info = build(sources, workdir, Path(args.build_dir) if args.build_dir else None)
            sglang_class(str(module))
        except BuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"SGLang {sources['version']}'s n-gram corpus built from {sources['from']} "
              f"({build_info['compiler']}, {' '.join(CFLAGS)}, tvm-ffi {build_info['tvm_ffi']}, "
              f"{build_info['build_s']:.0f}s)")
        if hasattr(os, "sched_setaffinity"):  # after the build: the compiler may use every core
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

        train, held = load_tokens(args.tokens)
        try:
            held_regions(held, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        memory = None
        if not args.no_memory:  # first: while this process holds neither corpus
            memory = measure_memory(train, args.capacity, str(module), workdir)
        if memory:
            print(f"\nmemory, resident-set growth of a fresh process, {len(train)} tokens put, capacity "
                  f"{args.capacity} ({memory['nodes']} nodes held):")
            for kind in ("spectool", "sglang"):
                m = memory[kind]
                print(f"  {kind:>8}: empty {m['empty_bytes'] / 2**20:8.1f} MiB ({m['empty_bytes_per_slot']:.1f} bytes "
                      f"per node of capacity), after the put {m['full_bytes'] / 2**20:8.1f} MiB "
                      f"({m['added_bytes_per_node']:.1f} more per node held): {m['bytes_per_node']:.1f} bytes per node")
            memory["ratio"] = memory["sglang"]["full_bytes"] / memory["spectool"]["full_bytes"]
            print(f"  SGLang over spectool: {memory['ratio']:.2f}x")
        matches = ("bfs", "prob") if args.match == "both" else (args.match,)
        results = {}
        for m in matches:
            results[m] = run_match(m, train, held, str(module), args)
            release_freed_memory()

    from speculative import provenance  # after the timing: it imports torch

    out = {"sglang": {k: v for k, v in sources.items() if k in ("from", "version", "tvm_ffi_pin")},
           "build": build_info, "tokens": len(train), "capacity": args.capacity, "iters": args.iters,
           "repeats": args.repeats, "matches": results, "memory": memory,
           "meta": provenance("ngram_vs_sglang", argv, "cpu")}
    folder = args.out or os.environ.get("OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / "ngram_vs_sglang.json"
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
