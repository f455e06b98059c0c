"""Per-phase timing of one iteration without stalling the GPU.

On CUDA each phase is bracketed by events recorded on the current stream and read
after the iteration's one host sync; on the CPU the host clock is exact. Events are
recycled once read, so an iteration creates no CUDA events.

Work launched for the next iteration before this one's host sync (the engine starts
the draft-extend and the next draft early, see Engine._iteration) is timed into the
next iteration: ``end_iteration()`` closes the marks of this one, and ``micros()``
reports and drops only those, keeping the later ones for the next call.
"""

from __future__ import annotations

import time

import torch

PHASES = ("draft", "index", "verify", "commit", "trie_get", "trie_put")
# The stats / trace column of each phase.
PHASE_KEYS = tuple(f"{phase}_us" for phase in PHASES)


class PhaseTimer:
    """Collects µs per phase: ``with timer("verify"): ...``, then ``end_iteration()`` and ``micros()``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []
        self._closed: int | None = None  # marks[:_closed] are the iteration micros() reports (None: all)
        self._free: list[torch.cuda.Event] = []  # CUDA: events read by micros(), ready for reuse

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def end_iteration(self) -> None:
        """Marks made so far belong to the current iteration; later ones to the next."""
        self._closed = len(self._marks)

    def _now(self) -> object:
        """A point in time: the host clock on the CPU, a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def micros(self) -> dict[str, float]:
        """µs per phase of the closed iteration, keyed ``"<phase>_us"`` (on CUDA, waits for its
        last phase to finish). Marks made after ``end_iteration()`` stay for the next call."""
        out = dict.fromkeys(PHASE_KEYS, 0.0)
        cut = len(self._marks) if self._closed is None else self._closed
        closed, self._marks, self._closed = self._marks[:cut], self._marks[cut:], None
        if self.cuda and closed:
            closed[-1][2].synchronize()  # type: ignore[union-attr]
        for phase, start, end in closed:
            key = phase + "_us"
            if self.cuda:
                out[key] += start.elapsed_time(end) * 1e3  # type: ignore[union-attr]
                self._free += [start, end]
            else:
                out[key] += (end - start) * 1e6  # type: ignore[operator]
        return out


class _Phase:
    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase = timer, phase

    def __enter__(self) -> None:
        self.start = self.timer._now()

    def __exit__(self, *exc: object) -> None:
        self.timer._marks.append((self.phase, self.start, self.timer._now()))
