"""The HF_QATTN_* environment variables: each one's name, meaning and default, and the one function that reads it.

Every read happens at call time, not at import, so a process (or a test through ``monkeypatch.setenv``) can
change a variable between calls. This module sits in ``kernels/`` because a kernel module reads one
(``fast_launch``) and kernels import nothing from hf_qattn; hf_qattn imports it as ``hf_qattn.kernels.settings``.

=========================== ======= =====================================================================
variable                    default meaning
=========================== ======= =====================================================================
HF_QATTN_FAST_LAUNCH        ``1``   ``0``: every kernel launch goes through Triton's ``kernel[grid](...)``;
                                    ``check``: the fast launch also runs Triton's binder on every launch
                                    and raises if its specialization differs (``kernels/fast_launch.py``)
HF_QATTN_EXACT_INT4         ``0``   ``1``: ``qk="int4"`` runs in the INT4 range on Hopper too (the portable
                                    Triton kernel) instead of INT8 (``hf_qattn.support.exact_int4``)
HF_QATTN_SPLIT_CHANNEL      ``0``   ``1``: ``qattn(split_channel=None)`` computes K's outlier channel apart
                                    (``hf_qattn.qattn``'s ``split_channel``)
HF_QATTN_BREAK_EVEN         ``1``   ``0``: ``attn_implementation="qattn"`` runs the quantized kernels at every
                                    length, also below the counts where they are slower than SDPA
                                    (``hf_qattn.support.below_break_even``)
HF_QATTN_STEP_GRAPHS        ``1``   ``0``: a QAttnCache layer's eager decode step launches its append and decode
                                    kernels from Python every step instead of replaying the layer's CUDA
                                    graph (``hf_qattn/kv_cache/step_graph.py``)
HF_QATTN_WORKSPACE_MB       ``256`` MiB of the K/V pass's buffers kept for the next attention call of the same shapes
                                    on the same stream (``kernels/workspace.py``); ``0``: every call
                                    allocates its own
HF_QATTN_NO_STARTUP_HOOK    unset   set and not ``0``: the wheel's start-up hook does not register
                                    ``"qattn"`` with transformers. Read by ``_hf_qattn_startup`` itself: it
                                    runs at interpreter start, before any package may be imported.
=========================== ======= =====================================================================

The test suite and eval/ scripts read their own: HF_QATTN_SEED (tests/conftest.py: replay a run's random
inputs), HF_QATTN_MODELS and HF_QATTN_WIKITEXT2 (where eval/ finds local weights and data).
"""

from __future__ import annotations

import os

FAST_LAUNCH = "HF_QATTN_FAST_LAUNCH"
EXACT_INT4 = "HF_QATTN_EXACT_INT4"
SPLIT_CHANNEL = "HF_QATTN_SPLIT_CHANNEL"
BREAK_EVEN = "HF_QATTN_BREAK_EVEN"
STEP_GRAPHS = "HF_QATTN_STEP_GRAPHS"
WORKSPACE_MB = "HF_QATTN_WORKSPACE_MB"
NO_STARTUP_HOOK = "HF_QATTN_NO_STARTUP_HOOK"  # read by _hf_qattn_startup (see above)


def fast_launch_mode() -> str:
    """``HF_QATTN_FAST_LAUNCH``: ``"1"`` (default, on), ``"0"`` (off) or ``"check"``."""
    return os.environ.get(FAST_LAUNCH, "1")


def exact_int4() -> bool:
    """``HF_QATTN_EXACT_INT4=1``: INT4-range Q·Kᵀ on Hopper too (default: INT8 there)."""
    return os.environ.get(EXACT_INT4, "0") == "1"


def split_channel() -> bool:
    """``HF_QATTN_SPLIT_CHANNEL=1``: K's split outlier channel on by default (default: off)."""
    return os.environ.get(SPLIT_CHANNEL, "0") == "1"


def break_even() -> bool:
    """``HF_QATTN_BREAK_EVEN`` (default ``1``): short calls of the transformers integration run SDPA where the
    quantized kernels are slower (``0``: quantized at every length)."""
    return os.environ.get(BREAK_EVEN, "1") != "0"


def step_graphs() -> bool:
    """``HF_QATTN_STEP_GRAPHS`` (default ``1``): eager decode steps over a QAttnCache layer replay its CUDA graph."""
    return os.environ.get(STEP_GRAPHS, "1") != "0"


def workspace_bytes() -> int:
    """``HF_QATTN_WORKSPACE_MB`` (default 256) in bytes: the budget of kept K/V-pass buffers (0: none kept)."""
    value = os.environ.get(WORKSPACE_MB, "256")
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"{WORKSPACE_MB} must be a number of MiB (0 keeps none); got {value!r}") from None
    if not megabytes >= 0:
        raise ValueError(f"{WORKSPACE_MB} must be a number of MiB ≥ 0 (0 keeps none); got {value!r}")
    return int(megabytes * 2 ** 20)
