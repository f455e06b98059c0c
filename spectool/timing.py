"""Per-phase timing of one iteration without stalling the GPU.

On CUDA each phase is bracketed by events recorded on the current stream and read
after the iteration's one host sync; on the CPU the host clock is exact.
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

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def reset(self) -> None:
        self._marks.clear()

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
        if self.timer.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timer.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.timer._marks.append((self.phase, self.start, end))
