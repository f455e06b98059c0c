"""Jupyter views over a spectool Trace (live or loaded from disk)."""

from .compare import CompareView  # noqa: F401  (re-exported)
from .live import LiveDecode  # noqa: F401  (re-exported)
from .tuning import TuningPanel  # noqa: F401  (re-exported)
from .viewer import TraceViewer  # noqa: F401  (re-exported)
from .views import AcceptanceView, MaskView, TreeView  # noqa: F401  (re-exported)
