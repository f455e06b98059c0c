"""Per-phase timing of one iteration without stalling the GPU.

On CUDA each phase is bracketed by events recorded on the current stream and read
after the iteration's one host sync; on the CPU the host clock is exact. The events
are reused from one iteration to the next (micros() has read them by then), so an
iteration creates no CUDA events.
"""

from __future__ import annotations

import time

import torch

PHASES = ("draft", "index", "verify", "commit", "trie_get", "trie_put")
# The stats / trace column of each phase.
PHASE_KEYS = tuple(f"{phase}_us" for phase in PHASES)


class PhaseTimer:
    """Collects µs per phase for one iteration: ``with timer("verify"): ...``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []
        self._events: list[torch.cuda.Event] = []  # CUDA: the pool, the first _used taken since reset
        self._used = 0

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def reset(self) -> None:
        self._marks.clear()
        self._used = 0

    def _now(self) -> object:
        """A point in time: the host clock on the CPU, a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        if self._used == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[self._used]
        self._used += 1
        event.record()
        return event

    def micros(self) -> dict[str, float]:
        """µs per phase since the last reset, keyed ``"<phase>_us"`` (on CUDA, waits for the last
        phase to finish)."""
        out = dict.fromkeys(PHASE_KEYS, 0.0)
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()  # type: ignore[union-attr]
        for phase, start, end in self._marks:
            key = phase + "_us"
            if self.cuda:
                out[key] += start.elapsed_time(end) * 1e3  # type: ignore[union-attr]
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
