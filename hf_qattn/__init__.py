"""hf_qattn — quantized attention (INT4/INT8 Q·Kᵀ, FP8 P·V, smoothing) for Transformers and Diffusers.

Public API:
    qattn(q, k, v, ...)          the attention function (see hf_qattn.api)
    fallback_stats()             where calls went, and why any fell back to full precision
    reset_fallback_stats()
"""

from .api import qattn
from .stats import fallback_stats, reset_fallback_stats

__version__ = "0.1.0"

__all__ = ["qattn", "fallback_stats", "reset_fallback_stats", "__version__"]
