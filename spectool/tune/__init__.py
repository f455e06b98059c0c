"""What-if analysis of a recorded greedy trace: exact accept lengths of other configurations,
a measured cost profile, and the recommended settings.

``st.tune(trace, grid=..., profile=...)`` is ``spectool.tune.recommend.tune``.
"""

import sys
import types

from spectool.tune.cost_profile import CostProfile
from spectool.tune.prediction import Prediction
from spectool.tune.profile_check import ProfileCheck, check_profile
from spectool.tune.recommend import TuneResult, tune
from spectool.tune.workload import TuneError

__all__ = ["CostProfile", "Prediction", "ProfileCheck", "TuneError", "TuneResult", "check_profile", "tune"]


class _CallableModule(types.ModuleType):
    """Importing this package makes ``spectool.tune`` the package, not the function: calling the
    package keeps ``st.tune(trace, ...)`` working either way."""

    def __call__(self, *args, **kwargs) -> TuneResult:
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
