"""Diffusers integration: per-(step, layer) plans for a pipeline's denoiser.

- :mod:`.patching`: :func:`patch` / :func:`unpatch`, plan storage, the hooks on attention modules;
- :mod:`.sdpa`: what to do with one intercepted ``scaled_dot_product_attention`` call;
- :mod:`.context_parallel`: the same under diffusers' context parallelism (ring and Ulysses);
- :mod:`.steps`: which denoising step the pipeline is in;
- :mod:`.calibration`: :func:`calibrate_pipeline`, which scores every (step, layer).

None of these imports diffusers at import time.
"""

from . import calibration, context_parallel, patching, sdpa, steps  # noqa: F401
from .calibration import PipelineCalibration, calibrate_pipeline  # noqa: F401
from .patching import *  # noqa: F401,F403
from .patching import _patched_models, _start_patch  # noqa: F401

__all__ = [*patching.__all__, "calibrate_pipeline", "PipelineCalibration"]
