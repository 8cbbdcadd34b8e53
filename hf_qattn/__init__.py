"""hf_qattn — quantized attention (INT4/INT8 Q·Kᵀ, FP8 P·V, smoothing) for Transformers and Diffusers.

Public API:
    qattn(q, k, v, ...)          the attention function (see hf_qattn.api)
    QAttnPlan, PlanError         per-layer precision plans (see hf_qattn.plan)
    calibrate(model, inputs)     score every layer, write a 4/8-bit plan into model.config
    fallback_stats()             where calls went, and why any fell back to full precision
    QAttnCache(model)            a quantized KV cache for generate (see hf_qattn.cache)
    CapturedDecodeStep           a decode step over a static QAttnCache replayed from a CUDA graph
    reset_fallback_stats()

Importing hf_qattn registers ``attn_implementation="qattn"`` with transformers as soon as
transformers loads (nothing happens when transformers is not installed).
"""

from .api import qattn
from .integrations.transformers.calibration import calibrate
from .plan import PlanError, QAttnPlan
from .stats import fallback_stats, reset_fallback_stats

__version__ = "0.1.0"

__all__ = ["qattn", "QAttnPlan", "PlanError", "calibrate", "fallback_stats", "reset_fallback_stats", "__version__"]


def _install_integrations() -> None:
    from .integrations import transformers as _transformers_integration

    _transformers_integration.install()


_install_integrations()

# Diffusers integration, imported on first use so that `import hf_qattn` never needs diffusers.
_DIFFUSERS_EXPORTS = ("patch", "unpatch", "calibrate_pipeline")
__all__ += list(_DIFFUSERS_EXPORTS)


def __getattr__(name):
    if name in _DIFFUSERS_EXPORTS:
        from importlib import import_module

        return getattr(import_module(".integrations.diffusers", __name__), name)
    if name == "QAttnCache":  # a transformers Cache: imports transformers, so only on first use
        from .cache import QAttnCache

        return QAttnCache
    if name == "CapturedDecodeStep":
        from .captured_decode import CapturedDecodeStep

        return CapturedDecodeStep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
