"""Jupyter views over a spectool Trace (live or loaded from disk)."""

from .live import LiveDecode  # noqa: F401  (re-exported)
from .tuning import TuningPanel  # noqa: F401  (re-exported)
