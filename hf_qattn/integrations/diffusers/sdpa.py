"""One ``scaled_dot_product_attention`` call of a diffusers attention module, served by ``qattn``.

Diffusers computes attention either by calling ``torch.nn.functional.scaled_dot_product_attention``
in its processor (CogVideoX, SD3, UNets, ...) or through ``attention_dispatch`` whose native backend
calls the same function (Flux, Wan, HunyuanVideo, LTX, ...). The patch intercepts that call with a
``TorchFunctionMode`` that is active only while a denoiser attention module runs (see
:mod:`hf_qattn.integrations.diffusers.patching`); this module decides what to do with each intercepted call:

- :func:`sdpa_arguments` names the positional / keyword arguments the way SDPA does;
- :func:`kernel_gap` says why the kernel cannot serve the call (or ``None``), and turns a
  key-padding mask into per-sequence ``kv_start`` / ``kv_end`` ranges;
- :func:`run_qattn` calls the kernel with the layout the tensors already have in memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ...api import qattn
from ...support import call_gap

SDPA = torch.nn.functional.scaled_dot_product_attention
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

# An additive mask entry at or below this hides its key: exp(-5000 + score range) underflows to 0
# in float32 for any realistic score range, so -1e4 (the old diffusers convention, -9984 in bf16),
# finfo.min and -inf all count as "hidden"; any other non-zero value is a bias the kernel lacks.
HIDDEN_BELOW = -5.0e3


def sdpa_arguments(args: tuple, kwargs: dict) -> dict:
    """SDPA's arguments by name (positional ones mapped), with SDPA's defaults filled in."""
    if len(args) > len(SDPA_PARAMETERS):
        raise TypeError(f"scaled_dot_product_attention takes at most {len(SDPA_PARAMETERS)} arguments")
    named = dict(SDPA_DEFAULTS)
    named.update(zip(SDPA_PARAMETERS, args))
    named.update(kwargs)
    return named


@dataclass(frozen=True)
class KeyRange:
    """Per-sequence visible key range [start, end); both None when every key is visible."""

    start: torch.Tensor | None = None
    end: torch.Tensor | None = None


def key_padding_range(mask: torch.Tensor, batch: int, heads: int, nq: int, nk: int) -> KeyRange | str:
    """The key range a mask keeps, if the mask is exactly a key-padding mask; else why not.

    A key-padding mask hides the same keys for every head and every query of a sequence, and the
    keys it keeps form one contiguous range (left and/or right padding). Bool masks keep True;
    additive masks keep 0 and hide values ≤ ``HIDDEN_BELOW``.
    """
    try:
        full_shape = torch.broadcast_shapes(tuple(mask.shape), (batch, heads, nq, nk))
    except RuntimeError:
        full_shape = None
    if mask.dim() > 4 or full_shape != (batch, heads, nq, nk):
        return f"attention mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Nq, Nk)"
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        if not bool((visible | (mask <= HIDDEN_BELOW)).all()):
            return "attention mask adds a bias (values other than 0 and -inf)"
    else:
        return f"attention mask of dtype {mask.dtype}"
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
    seen_anywhere = visible.any(dim=2).any(dim=1)  # (1 or B, Nk)
    seen_everywhere = visible.all(dim=2).all(dim=1)
    if not torch.equal(seen_anywhere, seen_everywhere):
        return "attention mask differs between heads or queries (not a key-padding mask)"
    keys = seen_anywhere.expand(batch, nk)
    index = torch.arange(nk, device=mask.device)
    count = keys.sum(dim=-1)
    start = torch.where(keys, index, nk).amin(dim=-1)
    end = torch.where(keys, index + 1, 0).amax(dim=-1)
    if bool((count == 0).any()):
        return "attention mask hides every key of a sequence"
    if not torch.equal(count, end - start):
        return "attention mask keeps keys that are not one contiguous range"
    if bool((start == 0).all()) and bool((end == nk).all()):
        return KeyRange()
    return KeyRange(start.to(torch.int32), end.to(torch.int32))


class MaskCache:
    """Remembers the last mask's key range: a transformer passes the same mask to every layer,
    and recognising it costs a device synchronisation. A hit needs the same tensor object at the
    same version counter (so an in-place change is seen); inference-mode tensors keep no version
    counter and are recognised afresh at every call."""

    def __init__(self):
        self._mask_ref = None
        self._key = None
        self._result = None

    def lookup(self, mask: torch.Tensor, batch: int, heads: int, nq: int, nk: int) -> KeyRange | str:
        if mask.is_inference():
            return key_padding_range(mask, batch, heads, nq, nk)
        key = (mask._version, batch, heads, nq, nk)
        if self._mask_ref is not None and self._mask_ref() is mask and self._key == key:
            return self._result
        result = key_padding_range(mask, batch, heads, nq, nk)
        self._mask_ref, self._key, self._result = weakref.ref(mask), key, result
        return result


def kernel_gap(named: dict, mask_cache: MaskCache | None = None) -> tuple[str | None, KeyRange]:
    """Why ``qattn`` cannot serve this SDPA call (None when it can), and the key range to use."""
    q, k, v = named["query"], named["key"], named["value"]
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value are not tensors", KeyRange()
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query/key/value are not 4-D (batch, heads, tokens, head_dim)", KeyRange()
    if any(t.is_nested for t in (q, k, v)):
        return "nested tensors", KeyRange()
    if not (q.device == k.device == v.device):
        return "query/key/value on different devices", KeyRange()
    gap = call_gap(q, k, v, dropout=named["dropout_p"])
    if gap is not None:
        return gap, KeyRange()
    (b, hq, nq, _), hk, nk = q.shape, k.shape[1], k.shape[2]
    if hq != hk and not named["enable_gqa"]:
        return f"{hq} query heads against {hk} key/value heads without enable_gqa", KeyRange()
    mask, causal = named["attn_mask"], named["is_causal"]
    if causal and mask is not None:
        return "both attn_mask and is_causal", KeyRange()
    if causal and nq != nk:
        # SDPA aligns the causal diagonal top-left, the kernel bottom-right: same only when square.
        return "is_causal with Nq != Nk", KeyRange()
    if mask is None:
        return None, KeyRange()
    if not isinstance(mask, torch.Tensor):
        return f"attn_mask of type {type(mask).__name__}", KeyRange()
    found = mask_cache.lookup(mask, b, hq, nq, nk) if mask_cache else key_padding_range(mask, b, hq, nq, nk)
    if isinstance(found, str):
        return found, KeyRange()
    return None, found


def _nhd_view(t: torch.Tensor) -> torch.Tensor | None:
    """t (B, H, N, D) as an NHD view when its memory is (B, N, H, D)-contiguous, else None."""
    view = t.transpose(1, 2)
    return view if view.is_contiguous() else None


def run_qattn(named: dict, qk: str, keys: KeyRange) -> torch.Tensor:
    """``qattn`` on an SDPA call the kernel can serve; returns SDPA's (B, H, Nq, D) output."""
    q, k, v = named["query"], named["key"], named["value"]
    options = dict(is_causal=bool(named["is_causal"]), sm_scale=named["scale"], qk=qk,
                   kv_start=keys.start, kv_end=keys.end)
    # Processors usually build (B, H, N, D) as a transpose of (B, N, H, D) memory: hand the kernel
    # that memory as NHD, so neither the inputs nor the output need a copy.
    nhd = [_nhd_view(t) for t in (q, k, v)]
    if all(t is not None for t in nhd):
        return qattn(*nhd, layout="NHD", **options).transpose(1, 2)
    return qattn(q, k, v, layout="HND", **options)
