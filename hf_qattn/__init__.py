"""hf_qattn — quantized attention (INT4/INT8 Q·Kᵀ, FP8 P·V, smoothing) for Transformers and Diffusers.

Public API:
    qattn(q, k, v, ...)          the attention function (see hf_qattn.api)
    QAttnPlan, PlanError         per-layer precision plans (see hf_qattn.plan)
    calibrate(model, inputs)     score every layer, write a 4/8-bit plan into model.config
    fallback_stats()             where calls went, and why any fell back to full precision
    QAttnCache(model)            a quantized KV cache for generate (see hf_qattn.kv_cache)
    CapturedDecodeStep           a decode step over a static QAttnCache replayed from a CUDA graph
    captured_generate            model.generate(..., custom_generate=hf_qattn.captured_generate): every
                                 decode step replayed from a CUDA graph (see hf_qattn.kv_cache.generate)
    reset_fallback_stats()

Importing hf_qattn registers ``attn_implementation="qattn"`` with transformers as soon as
transformers loads (nothing happens when transformers is not installed).
"""

import importlib.util as _importlib_util
import os as _os
import sys as _sys


def _map_source_kernels() -> None:
    """A source checkout run without installing (``python -m pytest`` from the repository root on a GPU
    machine, say): ``kernels/`` sits beside this package, and only an install maps it to
    ``hf_qattn.kernels`` (setuptools ``package-dir``). Map it the same way here, so that the checkout
    imports the same modules an install would."""
    if _importlib_util.find_spec(__name__ + ".kernels") is not None:
        return
    folder = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kernels")
    spec = _importlib_util.spec_from_file_location(__name__ + ".kernels", _os.path.join(folder, "__init__.py"),
                                                   submodule_search_locations=[folder])
    if spec is None:
        return
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module  # what the import system sets on the parent package


_map_source_kernels()

from .api import qattn  # noqa: E402
from .integrations.transformers.calibration import calibrate  # noqa: E402
from .plan import PlanError, QAttnPlan  # noqa: E402
from .stats import fallback_stats, reset_fallback_stats  # noqa: E402

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
        from .kv_cache.cache import QAttnCache

        return QAttnCache
    if name == "CapturedDecodeStep":
        from .kv_cache.captured import CapturedDecodeStep

        return CapturedDecodeStep
    if name == "captured_generate":
        from .kv_cache.generate import captured_generate

        return captured_generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
