"""`spectool report`: one standalone HTML file holding every iteration of the trace."""

import base64
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from plotly.offline import get_plotlyjs
from trace_factory import make_trace

import spectool.trace.format as trace_format
from spectool.cli.report import main
from spectool.trace.layout import layout_tree
from spectool.trace.reader import Trace
from spectool.trace.report import write_report
from spectool.trace.schema import STEP_SCHEMA

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def trace():
    return make_trace("ngram", num_requests=3, batch_size=2, num_draft_tokens=10, seed=4)


def page_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="spectool-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def page_mask(req: dict, k: int) -> np.ndarray:
    """The mask the page shows: the recorded bits when embedded, else the ancestors of parents."""
    a, b = req["offsets"][k], req["offsets"][k + 1]
    n = b - a
    if req["mask"][k]:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(req["mask"][k]), np.uint8), count=n * n)
        return bits.reshape(n, n).astype(bool)
    parents = req["parents"][a:b]
    mask = np.zeros((n, n), bool)
    for q in range(n):
        c = q
        while c >= 0:
            mask[q, c] = True
            c = parents[c]
    return mask


def test_report_is_standalone_and_holds_every_iteration(trace, tmp_path):
    out = write_report(trace, tmp_path / "r.html")
    page = out.read_text()
    # No network: no external scripts, styles or fetches; plotly.js itself is inline.
    assert not re.search(r'<(script|link)[^>]+(src|href)\s*=\s*["\']?(https?:)?//', page)
    assert get_plotlyjs()[:2000] in page
    data = page_data(page)
    assert [r["id"] for r in data["requests"]] == trace.request_ids
    for req in data["requests"]:
        r = req["id"]
        assert req["iteration"] == trace.iterations(r)
        for k, it in enumerate(req["iteration"]):
            view = trace.iteration(it, r)
            a, b = req["offsets"][k], req["offsets"][k + 1]
            assert req["tokens"][a:b] == view.tokens.tolist()
            assert req["parents"][a:b] == view.parents.tolist()
            assert req["status"][a:b] == view.status.tolist()
            assert req["accept_length"][k] == view.accept_length and req["bonus"][k] == view.bonus_token
            np.testing.assert_array_equal(page_mask(req, k), view.mask)
            # Top-k of the accepted nodes, in path order.
            path = [int(i) for i in view.accept_path if i >= 0]
            assert req["path"][k] == path
            start = sum(len(p) * kk for p, kk in zip(req["path"][:k], req["topk_k"][:k]))
            K = req["topk_k"][k]
            got = np.array(req["topk"][start:start + K * len(path)]).reshape(len(path), K)
            np.testing.assert_array_equal(got, view.target_topk_tokens[path])
            x, _ = layout_tree(view.parents, view.scores, view.valid)
            np.testing.assert_array_equal(np.array(req["x2"][a:b]), np.where(np.isnan(x), -1, x * 2))
        assert req["acceptance"]["data"][0]["name"] == "accept length"
    ids = {int(t) for req in data["requests"] for t in req["tokens"]}
    assert all(data["texts"][str(i)] == trace.token_text([i])[0] for i in ids)


def test_a_mask_that_differs_from_parents_is_embedded_as_recorded(trace, tmp_path):
    steps = trace.steps
    masks = steps["mask_packed"].to_pylist()
    masks[0] = bytes([masks[0][0] ^ 0x01]) + masks[0][1:]  # flip one bit of row 0
    steps = steps.set_column(steps.schema.get_field_index("mask_packed"), "mask_packed",
                             pa.array(masks, pa.binary()))
    bad = Trace.from_tables(steps, trace.requests, trace.run_info, trace.tokenizer_json)
    data = page_data(write_report(bad, tmp_path / "r.html").read_text())
    it, req = int(steps["iteration"][0].as_py()), int(steps["request_id"][0].as_py())
    r = next(r for r in data["requests"] if r["id"] == req)
    k = r["iteration"].index(it)
    assert r["mask"][k] != ""
    np.testing.assert_array_equal(page_mask(r, k), bad.iteration(it, req).mask)
    assert sum(m != "" for r in data["requests"] for m in r["mask"]) == 1


def test_token_text_cannot_break_out_of_the_script(trace, tmp_path):
    hostile = Trace.from_tables(trace.steps, trace.requests, trace.run_info, trace.tokenizer_json)
    hostile.token_text = lambda ids: ["</script><h1>x</h1>"] * len(list(ids))
    page = write_report(hostile, tmp_path / "r.html").read_text()
    data = page_data(page)
    assert set(data["texts"].values()) == {"</script><h1>x</h1>"}


def test_empty_trace_still_writes_a_page(tmp_path):
    steps = pa.table({f.name: pa.array([], f.type) for f in STEP_SCHEMA}, schema=STEP_SCHEMA)
    page = write_report(Trace.from_tables(steps, None, {}), tmp_path / "r.html").read_text()
    data = page_data(page)
    assert data["requests"] == [] and data["first"] is None


def test_cli_main(trace, tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.sptrace"
    trace.save(path)
    assert main([str(path), "-o", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").stat().st_size > 1_000_000
    assert main([str(path)]) == 0 and (tmp_path / "run.html").exists()
    junk = tmp_path / "junk.sptrace"
    junk.write_bytes(b"not arrow")
    capsys.readouterr()
    assert main([str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "junk.sptrace" in err and "Traceback" not in err
    assert main([str(tmp_path / "missing.sptrace")]) == 2
    monkeypatch.setattr(trace_format, "FORMAT_VERSION", trace_format.FORMAT_VERSION - 1)
    assert main([str(path)]) == 2 and "newer" in capsys.readouterr().err


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium not installed (/usr/bin/chromium)")
def test_report_plays_in_a_browser_without_network(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    trace = make_trace("eagle", num_requests=2, batch_size=2, num_draft_tokens=12, seed=5)
    out = write_report(trace, tmp_path / "r.html")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        problems = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("request", lambda r: problems.append(r.url) if not r.url.startswith("file:") else None)
        page.goto(out.as_uri())
        page.wait_for_selector(".spectool-tree .scatterlayer .point")
        page.wait_for_selector(".spectool-mask .heatmaplayer")

        def tree_markers():
            return page.evaluate("() => [...document.querySelectorAll('.spectool-tree .point')]"
                                 ".map(p => p.getAttribute('transform')).join(';')")

        first = trace.iteration(trace.iterations(0)[0], 0)
        # One marker per drawn node, plus the bonus star and the highlighted path rings.
        assert len(tree_markers().split(";")) == int(first.valid.sum()) + 1 + len(
            [a for a in first.accept_path if a >= 0])
        before = tree_markers()
        page.click("#next")
        assert tree_markers() != before
        assert "2/" in page.inner_text("#label")
        page.select_option("#request", "1")
        assert page.inner_text("#label").startswith(f"iteration {trace.iterations(1)[0]} ")
        browser.close()
    assert problems == []
