"""The quantized KV cache's math in plain PyTorch: the reference for the cache kernels and the CPU path.

Storage of one layer (:class:`Buffers`, see also ``kernels/decode.py``), B batch, H heads, CAP slots, by
precision:

- ``int8``: K − k̄ equalized, (K − k̄) / σ_K, in ``kq`` (B, H, CAP, D) int8 over ``ks`` (B, H, CAP) fp32 δK per token
  (its largest |value| / 127), σ_K in ``k_eq`` (B, H, D) bf16; V − v̄ likewise, stored offset binary: ``vq`` uint8
  V̂ + 128 (``V_OFFSET``), ``vs`` δV per token, ``v_eq`` σ_V. K − k̄ ≈ σ_K ⊙ δK · kq. σ (``formats.KV_EQ_FLOOR``: each channel's largest |value| over the first
  fill, floored) is set by :func:`set_equalizers` when the layer is first filled, 1 until then;
- ``int4``: K per channel over groups of ``GROUP`` consecutive slots (KIVI's layout): ``kq`` (B, H, CAP, D_PAD/2)
  holds u ∈ [0, 15] two a byte (channel c in the low nibble, c + D_PAD/2 in the high one), ``ks``
  (B, H, CAP/GROUP, 2, D) bf16 each (group, channel)'s scale and zero point, K − k̄ ≈ zero + u · scale; V as int8's;
- ``int8g``: K and V both per channel over groups, 8 bits: ``kq`` / ``vq`` (B, H, CAP, D) uint8 u ∈ [0, 255],
  ``ks`` / ``vs`` (B, H, CAP/GROUP, 2, D) bf16 scale and zero.

A grouped tensor's group is quantized when its last token arrives; until then its tokens are ``k_recent``
(and ``v_recent``) (B, H, GROUP, D), K − k̄ (V − v̄) in the model's dtype, so the first ``length // GROUP``
groups are quantized and the rest (fewer than GROUP tokens) is read from the recent rows.

k̄ and v̄ are per-(batch, head, channel) centers fixed when the layer is first filled.

Attention over the cache:  O = softmax(sm_scale · q · K̂ᵀ) · V̂ + v̄, K̂ / V̂ the stored K − k̄ / V − v̄
dequantized — the k̄ term adds q·k̄ to a whole row of scores, which the softmax ignores.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..masks import visible_keys
from ..kernels.formats import (INT_MAX, KV_EQ_FLOOR, KV_EQ_MIN_TOKENS, KV_GROUP as GROUP, KV_GROUP_DIRECTED,
                               KV_GROUP_DITHER_STRIDE, KV_GROUP_DITHERED, KV_GROUP_LEVELS, KV_V_OFFSET as V_OFFSET,
                               KV_V_TILE as V_TILE, padded_head_dim)
from ..quant import SCALE_FLOOR, reciprocal

PRECISIONS = ("int8", "int4", "int8g")


class Buffers(NamedTuple):
    """A layer's quantized K/V storage (the module docstring says what each tensor holds)."""

    precision: str
    kq: torch.Tensor
    ks: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    k_recent: torch.Tensor | None  # grouped K (int4, int8g): K − k̄ of the incomplete group
    v_recent: torch.Tensor | None = None  # grouped V (int8g): V − v̄ of the incomplete group
    k_eq: torch.Tensor | None = None  # per-token K (int8): σ_K (B, H, D) bf16
    v_eq: torch.Tensor | None = None  # per-token V (int8, int4): σ_V (B, H, D) bf16


def k_grouped(precision: str) -> bool:
    return precision in KV_GROUP_LEVELS  # the grouped formats: every one groups K


def v_grouped(precision: str) -> bool:
    return precision == "int8g"


def block_tokens(precision: str) -> int:
    """Capacities are whole multiples of this: the groups of a grouped K (the decode kernel reads a group a tile)
    and per-token V's tiles (``V_TILE``), whichever the format has (the per-token scales' strides stay divisible by
    16, so no kernel meets a new specialization as a cache grows)."""
    return math.lcm(GROUP if k_grouped(precision) else 1, 1 if v_grouped(precision) else V_TILE)


def token_major(vq: torch.Tensor) -> torch.Tensor:
    """Per-token V's tiles (B, H, CAP / V_TILE, D, V_TILE) as a (B, H, CAP / V_TILE, V_TILE, D) view, whose
    ``[slot_rows(slots)]`` are those slots' rows (to read or to write)."""
    return vq.transpose(-1, -2)


def slot_rows(slots: torch.Tensor) -> tuple:
    """The index of ``slots``' rows in :func:`token_major`'s view: tile slot // V_TILE, column slot % V_TILE."""
    return slice(None), slice(None), slots // V_TILE, slots % V_TILE


def in_slot_order(store, slots: torch.Tensor) -> Buffers:
    """Per-token storage (INT8 K and V, as rings hold; ``store``: :class:`Buffers` or any object with its fields)
    whose slots 0, 1, … are ``slots`` of ``store``: a ring's tokens in position order, for :func:`decode_attention`.
    V is re-cut into whole tiles of its own."""
    if store.precision != "int8":
        raise ValueError(f"in_slot_order takes per-token (int8) storage; got {store.precision!r}")
    b, h, _, d, _ = store.vq.shape
    vq = store.vq.new_zeros(b, h, -(-slots.numel() // V_TILE), d, V_TILE)
    rows = torch.arange(slots.numel(), device=slots.device)
    token_major(vq)[slot_rows(rows)] = token_major(store.vq)[slot_rows(slots)]
    return Buffers("int8", store.kq[:, :, slots], store.ks[:, :, slots], vq, store.vs[:, :, slots], None,
                   k_eq=store.k_eq, v_eq=store.v_eq)


def allocate(batch: int, heads: int, capacity: int, head_dim: int, precision: str, device,
             recent_dtype: torch.dtype = torch.bfloat16) -> Buffers:
    """Zeroed storage for at least ``capacity`` tokens, in whole blocks (:func:`block_tokens`); the capacity is
    ``kq.shape[2]``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    b, h, d = batch, heads, head_dim
    block = block_tokens(precision)
    capacity = -(-capacity // block) * block

    def groups(values_shape, dtype):  # (values, scale and zero per group and channel, the incomplete group)
        return (torch.zeros(b, h, capacity, values_shape, device=device, dtype=dtype),
                torch.zeros(b, h, capacity // GROUP, 2, d, device=device, dtype=torch.bfloat16),
                torch.zeros(b, h, GROUP, d, device=device, dtype=recent_dtype))

    def tokens(values_shape, dtype):  # (values, a scale per token)
        return (torch.zeros(b, h, *values_shape, device=device, dtype=dtype),
                torch.zeros(b, h, capacity, device=device, dtype=torch.float32))

    if precision == "int4":
        kq, ks, k_recent = groups(padded_head_dim(d) // 2, torch.int8)
    elif precision == "int8g":
        kq, ks, k_recent = groups(d, torch.uint8)
    else:
        kq, ks = tokens((capacity, d), torch.int8)
        k_recent = None
    if v_grouped(precision):
        vq, vs, v_recent = groups(d, torch.uint8)
    else:
        vq, vs = tokens((capacity // V_TILE, d, V_TILE), torch.uint8)  # offset binary, channel-major tiles
        v_recent = None
    # σ in bf16: only a scale (any value serves, the kernels and this reference read the same), and a sliding
    # layer's small ring stays within its memory target
    k_eq = None if k_grouped(precision) else torch.ones(b, h, d, device=device, dtype=torch.bfloat16)
    v_eq = None if v_grouped(precision) else torch.ones(b, h, d, device=device, dtype=torch.bfloat16)
    return Buffers(precision, kq, ks, vq, vs, k_recent, v_recent, k_eq, v_eq)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 15] (…, D) → int8 bytes (…, D_PAD/2): channel c low nibble, c + D_PAD/2 high."""
    d = u.shape[-1]
    half = padded_head_dim(d) // 2
    u = torch.nn.functional.pad(u.to(torch.int16), (0, 2 * half - d))
    return (u[..., :half] | (u[..., half:] << 4)).to(torch.uint8).view(torch.int8)


def unpack_nibbles(packed: torch.Tensor, d: int) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: int16 (…, D)."""
    byte = packed.contiguous().view(torch.uint8).to(torch.int16)
    return torch.cat([byte & 15, byte >> 4], dim=-1)[..., :d]


def centers(k: torch.Tensor, v: torch.Tensor, sample: int | None = 256):
    """k̄, v̄ (B, H, D) float32: channel means over (an even sample of) the tokens of the first fill."""
    from ..quant import smoothing_center

    return smoothing_center(k, sample).contiguous(), smoothing_center(v, sample).contiguous()


def _bf16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 → bf16 rounded up (toward +∞) or down: to nearest, then one bf16 step the other way where that
    went past x (bf16 bits as int16: one step away from 0 is +1 on the magnitude, the sign bit apart)."""
    r = x.to(torch.bfloat16)
    bits = r.view(torch.int16)
    past = r.float() < x if up else r.float() > x
    away = (bits >= 0) == up  # moving up from a positive value, or down from a negative one: magnitude grows
    return torch.where(past, torch.where(away, bits + 1, bits - 1).view(torch.bfloat16), r)


def group_dither(dtype=torch.float32, device=None) -> torch.Tensor:
    """φ_r (GROUP,) of the rows of a dithered group (``formats.KV_GROUP_DITHERED``): the kernels' ``group_dither``."""
    r = torch.arange(GROUP, device=device)
    return ((((r * KV_GROUP_DITHER_STRIDE) % GROUP).float() + 0.5) / GROUP).to(dtype)


def quantize_groups(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (…, n·GROUP, D) float32 of whole groups → (u (…, n·GROUP, D) int16 in [0, levels], scale and zero
    (…, n, 2, D) bf16) of the grouped ``precision``, per channel over each group: zero the min, scale (max − zero)
    / levels (dithered formats: / (levels − 1)), both in bf16 rounded as ``formats.KV_GROUP_DIRECTED`` says
    (directed: zero down, scale up), and u = round((x − zero) / scale [+ φ_row]) clamped to [0, levels] — what the
    append kernel does, bit for bit."""
    levels, directed = KV_GROUP_LEVELS[precision], KV_GROUP_DIRECTED[precision]
    dithered = KV_GROUP_DITHERED[precision]
    *lead, t, d = x.shape
    x = x.reshape(*lead, t // GROUP, GROUP, d)
    low = x.amin(-2)
    zero = _bf16_toward(low, up=False) if directed else low.to(torch.bfloat16)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which rounds differently
    # from the kernel's (and the CPU's) true division
    span = torch.full_like(low, levels - 1 if dithered else levels)
    exact = (x.amax(-2) - (zero.float() if directed else low)).clamp_min(SCALE_FLOOR) / span
    scale = _bf16_toward(exact, up=True) if directed else exact.to(torch.bfloat16)
    steps = (x - zero.float()[..., None, :]) * reciprocal(scale.float())[..., None, :]
    if dithered:
        steps = steps + group_dither(device=x.device)[:, None]
    u = torch.round(steps).clamp_(0, levels).reshape(*lead, t, d).to(torch.int16)
    return u, torch.stack([scale, zero], dim=-2)


def dequantize_groups(u: torch.Tensor, params: torch.Tensor, dtype, precision: str) -> torch.Tensor:
    """u (…, n·GROUP, D) and (…, n, 2, D) scale and zero of the grouped ``precision`` → zero + (u [− φ_row]) · scale
    (…, n·GROUP, D) in ``dtype``."""
    *lead, t, d = u.shape
    wide = torch.promote_types(dtype, torch.float32)  # u − φ needs 15 bits
    params = params.to(wide)
    steps = u.to(wide).reshape(*lead, t // GROUP, GROUP, d)
    if KV_GROUP_DITHERED[precision]:
        steps = steps - group_dither(wide, u.device)[:, None]
    x = steps * params[..., 0, None, :] + params[..., 1, None, :]
    return x.reshape(*lead, t, d).to(dtype)


def equalizers(xc: torch.Tensor) -> torch.Tensor:
    """σ (B, H, D) float32 of the first fill's x − x̄ (B, H, N, D): each channel's largest |value|, at least
    ``KV_EQ_FLOOR`` × the head's largest (formats.KV_EQ_FLOOR says why); 1 for a head with no spread, and everywhere
    for a first fill shorter than ``KV_EQ_MIN_TOKENS``. NaN or ±Inf in x give NaN (the attention over the cache is
    then NaN, never quietly finite)."""
    if xc.shape[-2] < KV_EQ_MIN_TOKENS:
        return torch.ones(xc.shape[:2] + xc.shape[3:], device=xc.device, dtype=torch.float32)
    sigma = xc.float().abs().amax(-2)
    top = sigma.amax(-1, keepdim=True)
    sigma = torch.where(top > 0, torch.maximum(sigma, top * KV_EQ_FLOOR), 1.0)
    finite = torch.isfinite(xc).all(-2).all(-1, keepdim=True)
    return torch.where(finite, sigma, float("nan")).contiguous()


def set_equalizers(buffers: Buffers, k: torch.Tensor, v: torch.Tensor, k_bar: torch.Tensor, v_bar: torch.Tensor):
    """Fix the per-token formats' σ_K, σ_V (:func:`equalizers`) from the first fill k, v (B, H, N, D), in place."""
    if buffers.k_eq is not None:
        buffers.k_eq.copy_(equalizers(k.float() - k_bar[:, :, None, :]))
    if buffers.v_eq is not None:
        buffers.v_eq.copy_(equalizers(v.float() - v_bar[:, :, None, :]))


def quantize_tokens(xc: torch.Tensor, eq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x − x̄ (B, H, N, D) float32 and its equalizers σ (B, H, D) → INT8 (B, H, N, D) of (x − x̄) / σ over its per-token
    scale, and that scale (B, H, N): the largest |(x − x̄) / σ| of the token / 127."""
    qmax = INT_MAX["int8"]
    xe = xc * reciprocal(eq)[:, :, None, :]
    scale = xe.abs().amax(-1).clamp_min(SCALE_FLOOR) / qmax
    return torch.round(xe * reciprocal(scale)[..., None]).clamp_(-qmax, qmax).to(torch.int8), scale


def _append_groups(x: torch.Tensor, values: torch.Tensor, params: torch.Tensor, recent: torch.Tensor, pos0: int,
                   precision: str) -> None:
    """New rows x (B, H, N, D) float32 of a grouped tensor at slots [pos0, pos0 + N): they complete the group of
    slot ``pos0`` (its earlier rows from ``recent``) and any later ones; whole groups are quantized, the rows of a
    group still incomplete go to ``recent``."""
    first = pos0 // GROUP * GROUP  # the group being filled
    end = pos0 + x.shape[-2]
    whole = end // GROUP * GROUP
    span = torch.cat([recent[:, :, : pos0 - first].float(), x], dim=-2)  # slots [first, end)
    if whole > first:
        u, scale_zero = quantize_groups(span[:, :, : whole - first], precision)
        values[:, :, first:whole] = pack_nibbles(u) if precision == "int4" else u.to(values.dtype)
        params[:, :, first // GROUP: whole // GROUP] = scale_zero
    if end > whole:
        keep = max(whole, pos0)  # the incomplete group's new rows (its older ones are in recent already)
        recent[:, :, keep - whole: end - whole] = span[:, :, keep - first:].to(recent.dtype)


def append(k: torch.Tensor, v: torch.Tensor, k_bar: torch.Tensor, v_bar: torch.Tensor, buffers: Buffers,
           pos0: int) -> None:
    """Quantize k, v (B, H, N, D) into slots [pos0, pos0 + N) of ``buffers``, in place: what the append kernel
    does. Per-token formats quantize every token now; grouped ones a group when its last token arrives."""
    n = k.shape[-2]
    if n == 0:
        return
    kc = k.float() - k_bar[:, :, None, :]
    vc = v.float() - v_bar[:, :, None, :]
    p = buffers.precision
    if k_grouped(p):
        _append_groups(kc, buffers.kq, buffers.ks, buffers.k_recent, pos0, p)
    else:
        buffers.kq[:, :, pos0: pos0 + n], buffers.ks[:, :, pos0: pos0 + n] = quantize_tokens(kc, buffers.k_eq)
    if v_grouped(p):
        _append_groups(vc, buffers.vq, buffers.vs, buffers.v_recent, pos0, p)
    else:
        v_hat, buffers.vs[:, :, pos0: pos0 + n] = quantize_tokens(vc, buffers.v_eq)
        slots = torch.arange(pos0, pos0 + n, device=v_hat.device)
        token_major(buffers.vq)[slot_rows(slots)] = (v_hat.to(torch.int16) + V_OFFSET).to(torch.uint8)


def _dequantize(buffers: Buffers, which: str, d: int, length: int, dtype, slots: torch.Tensor | None):
    """K − k̄ (``which`` "k") or V − v̄ ("v") as stored: per token, or grouped (the whole groups and the incomplete
    one from the recent rows)."""
    values, scales = getattr(buffers, which + "q"), getattr(buffers, which + "s")
    if not (k_grouped if which == "k" else v_grouped)(buffers.precision):
        index = slice(0, length) if slots is None else slots
        eq = getattr(buffers, which + "_eq")[:, :, None, :d].to(dtype)
        if which == "v":  # offset binary, channel-major tiles
            slots = torch.arange(length, device=values.device) if slots is None else slots
            values = token_major(values)[slot_rows(slots)][..., :d].to(dtype) - V_OFFSET
        else:
            values = values[:, :, index, :d].to(dtype)
        return values * scales[:, :, index, None].to(dtype) * eq
    if slots is not None:
        raise ValueError(f"grouped {which.upper()} is read in whole groups: dequantize_{which} takes a length, not slots")
    whole = length // GROUP * GROUP
    u = unpack_nibbles(values[:, :, :whole], d) if buffers.precision == "int4" else values[:, :, :whole, :d]
    x = dequantize_groups(u, scales[:, :, : whole // GROUP], dtype, buffers.precision)
    return torch.cat([x, getattr(buffers, which + "_recent")[:, :, : length - whole].to(dtype)], dim=-2)


def dequantize_k(buffers: Buffers, d: int, length: int, dtype=torch.float32, slots: torch.Tensor | None = None):
    """K − k̄ as stored for the first ``length`` slots, or for the slots ``slots`` (per-token formats only):
    (B, H, ·, D) in ``dtype``."""
    return _dequantize(buffers, "k", d, length, dtype, slots)


def dequantize_v(buffers: Buffers, d: int, length: int, dtype=torch.float32, slots: torch.Tensor | None = None):
    """V − v̄ as stored, as :func:`dequantize_k`."""
    return _dequantize(buffers, "v", d, length, dtype, slots)


def _group_rounding(q, buffers: Buffers, d: int, nk: int, rounding: torch.dtype, dtype) -> torch.Tensor:
    """What rounding q ⊙ scale to ``rounding`` adds to the scores of INT4 K's whole groups (B, Hq, Nq, nk); 0 for the
    recent rows, which the kernel reads unquantized."""
    b, hq, nq, _ = q.shape
    hk = buffers.kq.shape[1]
    whole = nk // GROUP * GROUP
    u = unpack_nibbles(buffers.kq[:, :, :whole], d).to(dtype).reshape(b, hk, whole // GROUP, GROUP, d)
    scale = buffers.ks[:, :, : whole // GROUP, 0].to(dtype)  # (B, Hk, groups, D)
    qg = q.to(dtype).reshape(b, hk, hq // hk, nq, 1, d)
    exact = qg * scale[:, :, None, None]
    error = exact.to(rounding).to(dtype) - exact  # (B, Hk, Hq/Hk, Nq, groups, D)
    delta = torch.einsum("bhgqnd,bhntd->bhgqnt", error, u).reshape(b, hq, nq, whole)
    return torch.nn.functional.pad(delta, (0, nk - whole))


def decode_attention(q, buffers: Buffers, v_bar, nk: int, *, sm_scale: float | None = None,
                     causal: bool = True, kv_start=None, kv_end=None, window: int | None = None,
                     chunk: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
                     k_bar: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                     dtype=torch.float64, group_q_round: torch.dtype | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` slots of ``buffers``, computed in ``dtype``.

    Returns (B, Nq, Hq, D) in q's dtype (the layout transformers' attention functions return).
    Slot j holds the token at position ``key_positions[j]`` (default j: slots in order); query i of Nq
    sits at position P − Nq + 1 + i, P the newest key's (bottom-right alignment, as is_causal). Causal
    (several queries), ``window`` (keys p − W < j ≤ p) and ``chunk`` (j // C == p // C) compare
    positions; ``kv_start`` / ``kv_end`` (B,) select slots. ``sinks`` (Hq,): one more logit per query
    head in the denominator, no value. ``softcap``: scores c·tanh(s / c). Both need the true scores, so
    ``k_bar`` (B, Hk, D) (the stored K is K − k̄; without them q·k̄ shifts a row, which the softmax ignores). Rows that see no key give zeros (as the kernel).
    ``group_q_round``: INT4 K only, the decode kernel's rounding of q ⊙ scale before its dot with a group's nibbles
    (bf16 on a GPU: up to 2^−9 of each product, a few percent of a weight on large scores; None: exact).
    """
    b, hq, nq, d = q.shape
    hk = buffers.kq.shape[1]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    k = dequantize_k(buffers, d, nk, dtype)
    v = dequantize_v(buffers, d, nk, dtype)
    if softcap is not None or sinks is not None:  # the true scores: capped, or compared with a sink
        if k_bar is None:
            raise ValueError("softcap and sinks need k_bar: their scores are those of K, not of the stored K − k̄")
        k = k + k_bar.to(dtype)[:, :, None, :]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
    if group_q_round is not None and buffers.precision == "int4":
        scores = scores + _group_rounding(q, buffers, d, nk, group_q_round, dtype) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = visible_keys(b, nq, nk, is_causal=False, kv_start=kv_start, kv_end=kv_end, device=q.device)
    kpos = torch.arange(nk, device=q.device) if key_positions is None else key_positions.to(q.device)
    last = int(kpos.max()) if nk else nq - 1
    qpos = torch.arange(last - nq + 1, last + 1, device=q.device)
    if causal and nq > 1:
        seen = seen & (kpos[None, :] <= qpos[:, None])
    if window is not None:
        seen = seen & (kpos[None, :] > qpos[:, None] - window)
    if chunk is not None:
        seen = seen & (kpos[None, :] // chunk == qpos[:, None] // chunk)
    scores = scores.masked_fill(~seen, float("-inf"))
    any_seen = seen.any(-1, keepdim=True)
    scores = scores.masked_fill(~any_seen, 0.0)
    if sinks is not None:
        sink = sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, nq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].masked_fill(~seen, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    # V is stored as V − v̄: the weights' sum (1, or less with a sink) carries v̄ back
    v_bar_q = v_bar.to(dtype).repeat_interleave(groups, 1)[:, :, None, :]
    out = torch.where(any_seen, torch.matmul(probs, v) + probs.sum(-1, keepdim=True) * v_bar_q, 0.0)
    return out.transpose(1, 2).to(q.dtype)
