"""PhaseTimer: phases started after end_iteration() count in the next iteration.

Oracle: the host clock around each phase (on the CPU the timer reads the same clock, so
each phase's µs must lie between what the test saw inside and around it).
"""

from __future__ import annotations

import time

import torch

from spectool.timing import PHASE_KEYS, PhaseTimer


def _sleep_phase(timer: PhaseTimer, phase: str, seconds: float) -> None:
    with timer(phase):
        time.sleep(seconds)


def test_marks_after_end_iteration_move_to_the_next_iteration():
    timer = PhaseTimer(torch.device("cpu"))
    _sleep_phase(timer, "verify", 0.02)
    timer.end_iteration()
    _sleep_phase(timer, "draft", 0.05)  # launched early for the next iteration
    first = timer.micros()
    assert set(first) == set(PHASE_KEYS)
    assert 20_000 <= first["verify_us"] < 50_000
    assert first["draft_us"] == 0.0
    _sleep_phase(timer, "verify", 0.01)
    timer.end_iteration()
    second = timer.micros()
    assert second["draft_us"] >= 50_000
    assert 10_000 <= second["verify_us"] < 50_000
    assert timer.micros() == dict.fromkeys(PHASE_KEYS, 0.0)


def test_without_end_iteration_micros_reports_every_mark():
    timer = PhaseTimer(torch.device("cpu"))
    _sleep_phase(timer, "draft", 0.01)
    _sleep_phase(timer, "draft", 0.01)
    assert timer.micros()["draft_us"] >= 20_000
