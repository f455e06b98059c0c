"""The engine's batch schedule, replayed without a target: admission, iterations, release.

This mirrors ``Engine.stream``: prompts wait in order and take the lowest free slot;
newly admitted requests are prefilled together (the first output token comes from the
prefill, and a request whose output is that one token finishes there); the running
requests, in slot order, run one iteration each time; requests that reached their
output length are released together at the end of the iteration and their slots freed.
A what-if method supplies what happens at the three points (``Method``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from spectool.tune.prediction import RowLog
from spectool.tune.workload import RequestWork, Workload


@dataclass
class Running:
    """A request in a slot; ``seq_len`` = tokens in the cache, so its root is ``known[seq_len]``."""

    work: RequestWork
    slot: int
    seq_len: int

    @property
    def request_id(self) -> int:
        return self.work.request_id

    @property
    def history_len(self) -> int:
        return self.seq_len + 1


class Method(Protocol):
    def admit(self, reqs: list[Running]) -> None: ...

    def step(self, running: list[Running]) -> tuple[list[int], int, list[bool], list]:
        """Accept length per running request, the tree size N verified, which rows were censored, and
        each row's tree as (tokens, parents, valid) lists (or None)."""
        ...

    def release(self, reqs: list[Running]) -> None: ...


def replay(workload: Workload, method: Method, log: RowLog) -> None:
    """Run the engine's schedule over ``workload``, logging every iteration into ``log``."""
    waiting = deque(workload.requests)
    free = list(range(workload.max_batch_size))
    running: list[Running] = []
    while waiting or running:
        admitted = []
        while waiting and free:
            work = waiting.popleft()
            admitted.append(Running(work, free.pop(0), work.prompt_len))
        if admitted:
            method.admit(admitted)
            for r in admitted:
                if r.work.num_output <= 1:  # its one output token came from the prefill
                    method.release([r])
                    free.append(r.slot)
                    free.sort()
                else:
                    running.append(r)
            running.sort(key=lambda r: r.slot)
        if not running:
            continue
        accepts, n, censored, trees = method.step(running)
        it = log.add_iteration(len(running), n)
        done = []
        for r, a, c, tree in zip(running, accepts, censored, trees):
            log.add_row(it, r.request_id, r.seq_len, a, c, tree)
            r.seq_len += a + 1
            if r.history_len >= r.work.end:
                done.append(r)
        if done:
            method.release(done)
            free.extend(r.slot for r in done)
            free.sort()
            running = [r for r in running if r.history_len < r.work.end]
