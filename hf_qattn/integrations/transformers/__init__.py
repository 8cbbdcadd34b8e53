"""Transformers integration: the ``"qattn"`` attention implementation.

- :mod:`.attention`: the attention function (plan lookup, mask analysis, full-precision paths);
- :mod:`.registration`: registration with transformers' interfaces, and the model-construction hook
  that checks plans at load;
- :mod:`.calibration`: :func:`calibrate`, which scores every layer and writes a 4/8-bit plan.
"""

from ...plan import DEFAULT_PRECISION  # noqa: F401
from . import attention, calibration, registration  # noqa: F401
from .attention import *  # noqa: F401,F403
from .attention import _num_layers  # noqa: F401
from .calibration import CalibrationResult, calibrate  # noqa: F401
from .registration import _looks_like_attention, install, on_model_init, register  # noqa: F401
