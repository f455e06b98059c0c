"""The workload of a recorded greedy run: what every configuration would decode.

Greedy speculative decoding is lossless, so the recorded output of each request is the
output of any configuration. A configuration's last iteration may accept tokens past the
end of the output (the engine verifies them, then cuts the output at max_new_tokens or a
stop token): the recorded run's own last iteration shows some of them, and they are kept
as ``known`` past the output. A what-if iteration that would need a token beyond ``known``
is marked *censored* (its accept length is then a lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class TuneError(ValueError):
    """A trace, configuration or profile the tuner refuses (the message is one line)."""


@dataclass
class RequestWork:
    """One recorded request: prompt, how many output tokens it decodes, and every target token known.

    ``known`` is prompt + output + the recorded verified tokens past the output; the request
    finishes once ``num_output`` tokens are generated.
    """

    request_id: int
    prompt: list[int]
    num_output: int
    known: np.ndarray  # int64

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def end(self) -> int:
        """Length of prompt + output: the request is done when its history reaches it."""
        return len(self.prompt) + self.num_output


@dataclass
class Workload:
    """The requests of a greedy trace in admission order, and the engine shape that ran them."""

    requests: list[RequestWork]
    max_batch_size: int
    run_info: dict

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output for r in self.requests)

    @property
    def model_hash(self) -> str | None:
        return (self.run_info.get("model") or {}).get("hash")


def workload_from_trace(trace, max_new_tokens: int | None = None, max_batch_size: int | None = None) -> Workload:
    """The Workload of a recorded greedy trace; ``TuneError`` (one line) for a trace it cannot use.

    Args:
        trace: a ``spectool.Trace`` (or a path to a ``.sptrace`` file).
        max_new_tokens: decode only this many output tokens per request (the rest of the recorded
            output then stays known, so the last iterations are exact).
        max_batch_size: the batch the what-if engine runs (default: the recorded run's).
    """
    if not hasattr(trace, "steps"):
        from spectool.trace.reader import Trace

        trace = Trace.load(trace)
    info = dict(trace.run_info or {})
    engine = info.get("engine") or {}
    temps = trace.steps.column("temperature").to_numpy(zero_copy_only=False) if trace.steps.num_rows else []
    temperature = float(engine.get("temperature", 0.0) or 0.0)
    if temperature > 0 or (len(temps) and np.nanmax(np.asarray(temps, dtype=np.float64)) > 0):
        raise TuneError(f"this trace was sampled (temperature {max(temperature, float(np.nanmax(temps)))}): "
                        "exact what-if needs a greedy trace (record with temperature 0)")
    rows = trace.requests.to_pylist()
    if not rows:
        raise TuneError("this trace has no request rows (no outputs recorded): record the run to its end")
    by_id = {int(r["request_id"]): r for r in rows}
    missing = [i for i in trace.request_ids if i not in by_id]
    if missing:
        raise TuneError(f"requests {missing[:5]} have no recorded output (was the run cut short?)")
    last_rows = _last_rows(trace)
    requests = []
    for rid in sorted(by_id):
        row = by_id[rid]
        prompt = [int(t) for t in row["prompt_tokens"] or []]
        output = [int(t) for t in row["output_tokens"] or []]
        if row["finish_reason"] in (None, "aborted"):
            raise TuneError(f"request {rid} was aborted: its output is incomplete, so other configurations "
                            "cannot be replayed over it")
        if not prompt or not output:
            raise TuneError(f"request {rid} has {'no prompt' if not prompt else 'no output'} tokens in the trace")
        known = prompt + output + _tokens_past_output(last_rows.get(rid), len(prompt) + len(output))
        n_out = len(output) if max_new_tokens is None else min(len(output), int(max_new_tokens))
        if n_out < 1:
            raise TuneError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        requests.append(RequestWork(rid, prompt, n_out, np.asarray(known, dtype=np.int64)))
    bs = int(max_batch_size or engine.get("max_batch_size") or 1)
    if bs < 1:
        raise TuneError(f"max_batch_size must be >= 1, got {bs}")
    return Workload(requests, bs, info)


def _last_rows(trace) -> dict[int, dict]:
    """Each request's last recorded step row (seq_len, tokens, accept path, bonus)."""
    steps = trace.steps
    if steps.num_rows == 0:
        return {}
    its = steps.column("iteration").to_numpy(zero_copy_only=False)
    rids = steps.column("request_id").to_numpy(zero_copy_only=False)
    last: dict[int, int] = {}
    for k in np.lexsort((its, rids)):
        last[int(rids[k])] = int(k)
    cols = ["seq_len", "tokens", "accept_path", "accept_length", "bonus_token"]
    out = {}
    for rid, k in last.items():
        out[rid] = steps.slice(k, 1).select(cols).to_pylist()[0]
    return out


def _tokens_past_output(row: dict | None, end: int) -> list[int]:
    """The verified tokens of a request's last iteration that lie past its output (position >= end)."""
    if row is None or row["seq_len"] is None or row["bonus_token"] is None:
        return []
    a = int(row["accept_length"] or 0)
    tokens = row["tokens"] or []
    path = (row["accept_path"] or [])[1:a + 1]
    gained = [int(tokens[i]) for i in path] + [int(row["bonus_token"])]
    first = int(row["seq_len"]) + 1  # position of the first gained token
    return [t for j, t in enumerate(gained) if first + j >= end]
