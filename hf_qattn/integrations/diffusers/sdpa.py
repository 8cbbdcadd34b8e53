"""One ``scaled_dot_product_attention`` call of a diffusers attention module, served by ``qattn``.

Diffusers computes attention either by calling ``torch.nn.functional.scaled_dot_product_attention``
in its processor (CogVideoX, SD3, UNets, ...) or through ``attention_dispatch`` whose native backend
calls the same function (Flux, Wan, HunyuanVideo, LTX, ...). The patch intercepts that call with a
``TorchFunctionMode`` that is active only while a denoiser attention module runs (see
:mod:`hf_qattn.integrations.diffusers.patching`); this module decides what to do with each intercepted call:

- :func:`sdpa_arguments` names the positional / keyword arguments the way SDPA does;
- :func:`kernel_gap` says why the kernel cannot serve the call (or ``None``), and turns the mask
  into causal ∧ per-sequence key range with the analysis both integrations share
  (:func:`hf_qattn.masks.cached_analysis`);
- :func:`run_qattn` calls the kernel with the layout the tensors already have in memory (and returns
  the LSE where context parallelism asks for it, see :mod:`.context_parallel`).
"""

from __future__ import annotations

import torch

from ...api import qattn
from ...masks import MaskPattern, cached_analysis
from ...support import call_gap

SDPA = torch.nn.functional.scaled_dot_product_attention
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arguments(args: tuple, kwargs: dict) -> dict:
    """SDPA's arguments by name (positional ones mapped), with SDPA's defaults filled in."""
    if len(args) > len(SDPA_PARAMETERS):
        raise TypeError(f"scaled_dot_product_attention takes at most {len(SDPA_PARAMETERS)} arguments")
    named = dict(SDPA_DEFAULTS)
    named.update(zip(SDPA_PARAMETERS, args))
    named.update(kwargs)
    return named


def kernel_gap(named: dict) -> tuple[str | None, MaskPattern | None]:
    """Why ``qattn`` cannot serve this SDPA call (None when it can), or the mask pattern to serve it with."""
    q, k, v = named["query"], named["key"], named["value"]
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value are not tensors", None
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query/key/value are not 4-D (batch, heads, tokens, head_dim)", None
    if any(t.is_nested for t in (q, k, v)):
        return "nested tensors", None
    gap = call_gap(q, k, v, dropout=named["dropout_p"])
    if gap is not None:
        return gap, None
    (b, hq, nq, _), hk, nk = q.shape, k.shape[1], k.shape[2]
    if hq != hk and not named["enable_gqa"]:
        return f"{hq} query heads against {hk} key/value heads without enable_gqa", None
    mask, causal = named["attn_mask"], named["is_causal"]
    if causal and mask is not None:
        return "both attn_mask and is_causal", None
    if causal and nq != nk:
        # SDPA aligns the causal diagonal top-left, the kernel bottom-right: same only when square.
        return "is_causal with Nq != Nk", None
    if mask is None:
        return None, MaskPattern(bool(causal), nk)
    if not isinstance(mask, torch.Tensor):
        return f"attn_mask of type {type(mask).__name__}", None
    found = cached_analysis(mask, b, hq, nq, nk)
    if isinstance(found, str):
        return found, None
    return None, found.for_batch(b)


def _nhd_view(t: torch.Tensor) -> torch.Tensor | None:
    """t (B, H, N, D) as an NHD view when its memory is (B, N, H, D)-contiguous, else None."""
    view = t.transpose(1, 2)
    return view if view.is_contiguous() else None


def run_qattn(named: dict, qk: str, pattern: MaskPattern, return_lse: bool = False):
    """``qattn`` on an SDPA call the kernel can serve; returns SDPA's (B, H, Nq, D) output, and with
    ``return_lse`` also the natural-log LSE (B, H, Nq) float32 that context parallelism merges shards by."""
    q = named["query"]
    k, v = pattern.keys(named["key"], named["value"])
    options = dict(sm_scale=named["scale"], qk=qk, return_lse=return_lse, **pattern.qattn_options())
    # Processors usually build (B, H, N, D) as a transpose of (B, N, H, D) memory: hand the kernel
    # that memory as NHD, so neither the inputs nor the output need a copy.
    nhd = [_nhd_view(t) for t in (q, k, v)]
    if all(t is not None for t in nhd):
        result = qattn(*nhd, layout="NHD", **options)
        out, lse = result if return_lse else (result, None)
        out = out.transpose(1, 2)
    else:
        result = qattn(q, k, v, layout="HND", **options)
        out, lse = result if return_lse else (result, None)
    return (out, lse) if return_lse else out
