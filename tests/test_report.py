"""`spectool report`: one standalone HTML file holding every iteration of the trace."""

import base64
import gzip
import json
import re

import numpy as np
import pyarrow as pa
import pytest
from plotly.offline import get_plotlyjs
from trace_factory import make_trace

import spectool.trace.format as trace_format
from spectool.cli.report import main
from spectool.trace.reader import Trace
from spectool.trace.report import write_report
from spectool.trace.schema import STEP_SCHEMA


@pytest.fixture(scope="module")
def trace():
    return make_trace("ngram", num_requests=3, batch_size=2, num_draft_tokens=10, seed=4)


def page_data(html: str) -> dict:
    """What the page's script reads, each request's chunks joined back into one run of iterations:
    per-node arrays decoded from the blob (``arrays``), offsets, paths, masks and top-k starts over
    the whole request, its text fields, and every token text the page was given (``texts``)."""
    header = json.loads(re.search(r'<script type="application/json" id="spectool-header">(.*?)</script>',
                                  html, re.S).group(1).replace("<\\/", "</"))
    blob = gzip.decompress(base64.b64decode(re.search(r'id="spectool-blob">(.*?)</script>', html, re.S).group(1)))
    texts = dict(header["texts"])
    requests = []
    for req in header.get("loaded", []):
        texts.update(req["texts"], **req["text"]["texts"])
        req.update({k: v for k, v in req["text"].items() if k != "texts"})
        chunks = [req["loaded"][str(c)] for c in range(req["chunks"])]
        assert len(req["loaded"]) == req["chunks"]  # the report holds every iteration
        arrays: dict[str, list] = {}
        offsets, topk_start = [0], []
        req["path"], req["masks"], req["topk_k"] = [], [], []
        for chunk in chunks:
            texts.update(chunk["texts"])
            for name, (dtype, off, n) in chunk["nodes"].items():
                arrays.setdefault(name, []).append(np.frombuffer(blob, dtype=np.dtype(dtype), count=n, offset=off))
            offsets += [offsets[-1] + o for o in chunk["offsets"][1:]]
            base = sum(len(a) for a in arrays["topk"][:-1])
            topk_start += [base + s for s in chunk["topk_start"]]
            for name in ("path", "masks", "topk_k"):
                req[name] += chunk[name]
        req["arrays"] = {name: np.concatenate(parts) for name, parts in arrays.items()}
        req["offsets"], req["topk_start"] = offsets, topk_start
        requests.append(req)
    header["requests"], header["texts"] = requests, texts
    return header


def page_mask(req: dict, k: int) -> np.ndarray:
    """The mask the page shows: the recorded bits when embedded, else the ancestors of parents."""
    a, b = req["offsets"][k], req["offsets"][k + 1]
    n = b - a
    if req["masks"][k]:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(req["masks"][k]), np.uint8), count=n * n)
        return bits.reshape(n, n).astype(bool)
    parents = req["arrays"]["parents"][a:b]
    mask = np.zeros((n, n), bool)
    for q in range(n):
        c = q
        while c >= 0:
            mask[q, c] = True
            c = parents[c]
    return mask


def test_report_is_standalone_and_holds_every_iteration(trace, tmp_path, monkeypatch):
    import spectool.trace.viewdata as viewdata

    monkeypatch.setattr(viewdata, "CHUNK", 5)  # several chunks per request, joined back by page_data
    out = write_report(trace, tmp_path / "r.html")
    page = out.read_text()
    # No network: no external scripts, styles or fetches; plotly.js itself is inline.
    assert not re.search(r'<(script|link)[^>]+(src|href)\s*=\s*["\']?(https?:)?//', page)
    assert get_plotlyjs()[:2000] in page
    data = page_data(page)
    assert [r["id"] for r in data["requests"]] == trace.request_ids
    assert all(r["chunks"] > 1 for r in data["requests"])
    for req in data["requests"]:
        r = req["id"]
        arr = req["arrays"]
        assert req["iteration"] == trace.iterations(r)
        output = trace.request(r)["output_tokens"]
        assert req["output"] == output
        for k, it in enumerate(req["iteration"]):
            view = trace.iteration(it, r)
            a, b = req["offsets"][k], req["offsets"][k + 1]
            for name, field in (("tokens", "tokens"), ("parents", "parents"), ("status", "status"),
                                ("valid", "valid"), ("argmax", "target_argmax")):
                np.testing.assert_array_equal(arr[name][a:b], getattr(view, field))
            np.testing.assert_allclose(arr["scores"][a:b], view.scores)
            assert req["accept_length"][k] == view.accept_length and req["bonus"][k] == view.bonus_token
            np.testing.assert_array_equal(page_mask(req, k), view.mask)
            # Top-k of the accepted nodes, in path order.
            path = [int(i) for i in view.accept_path if i >= 0]
            assert req["path"][k] == path
            K, start = req["topk_k"][k], req["topk_start"][k]
            got = arr["topk"][start:start + K * len(path)].reshape(len(path), K)
            np.testing.assert_array_equal(got, view.target_topk_tokens[path])
            # The output tokens this iteration produced: its accepted drafts, then the bonus token.
            s0, n = req["out_start"][k], req["out_count"][k]
            gained = [int(view.tokens[i]) for i in path[1:]] + [view.bonus_token]
            assert output[s0:s0 + n] == gained[:n]
            assert req["iteration_us"][k] == pytest.approx(view.timings["iteration_us"], abs=0.1)
            rejected = [int(view.depth[i]) for i in range(len(view.tokens)) if view.status[i] == 2 and view.valid[i]]
            assert req["first_reject_depth"][k] == (min(rejected) if rejected else -1)
    ids = {int(t) for req in data["requests"] for t in req["arrays"]["tokens"][req["arrays"]["valid"] > 0]}
    assert all(data["texts"][str(i)] == trace.token_text([i])[0] for i in ids)


def test_calibration_counts_every_judged_node_by_depth(trace):
    from spectool.trace.viewdata import calibration

    expected: dict[int, list[int]] = {}
    for r in trace.request_ids:
        for it in trace.iterations(r):
            v = trace.iteration(it, r)
            for i in range(1, len(v.tokens)):
                if v.valid[i] and v.status[i] in (1, 2):  # the verifier judged it
                    got = expected.setdefault(int(v.depth[i]), [0, 0])
                    got[0] += int(v.status[i] == 1)
                    got[1] += 1
    cal = calibration(trace)
    assert cal["unit"] == "depth"
    assert {g["depth"]: [sum(g["accepted"]), sum(g["count"])] for g in cal["groups"]} == expected


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
    assert r["masks"][k] != ""
    np.testing.assert_array_equal(page_mask(r, k), bad.iteration(it, req).mask)
    assert sum(m != "" for r in data["requests"] for m in r["masks"]) == 1


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
    assert data["requests"] == [] and data["calibration"]["groups"] == []


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
