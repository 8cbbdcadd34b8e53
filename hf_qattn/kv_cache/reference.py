"""The quantized KV cache's math in plain PyTorch: the reference for the cache kernels and the CPU path.

Storage of one layer (:class:`Buffers`, see also ``kernels/decode.py``), B batch, H heads, CAP slots:

- INT8 K: ``kq`` (B, H, CAP, D) int8 = round((K − k̄) / δK) (±127), ``ks`` (B, H, CAP) fp32 δK per token;
- INT4 K, per channel over groups of ``GROUP`` consecutive slots (KIVI's layout): ``kq`` (B, H, CAP, D_PAD/2)
  holds u ∈ [0, 15] two a byte (channel c in the low nibble, c + D_PAD/2 in the high one), ``ks``
  (B, H, CAP/GROUP, 2, D) bf16 each (group, channel)'s scale and zero point, K − k̄ ≈ zero + u · scale.
  A group is quantized when its last token arrives; until then its tokens are ``k_recent`` (B, H, GROUP,
  D), K − k̄ in the model's dtype, so the first ``length // GROUP`` groups are quantized and the rest
  (fewer than GROUP tokens) is read from ``k_recent``;
- V: ``vq`` (B, H, CAP, D) FP8 E4M3 = (V − v̄) / δV, ``vs`` (B, H, CAP) fp32 δV per token (max |V − v̄| / 448).

k̄ and v̄ are per-(batch, head, channel) centers fixed when the layer is first filled.

Attention over the cache:  O = softmax(sm_scale · q · K̂ᵀ) · (V̂·δV) + v̄, K̂ the stored K − k̄ dequantized —
the k̄ term adds q·k̄ to a whole row of scores, which the softmax ignores.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..masks import visible_keys
from ..kernels.formats import FP8_E4M3_MAX as FP8_MAX, INT_MAX, KV_INT4_GROUP as GROUP, KV_INT4_LEVELS, padded_head_dim
from ..quant import SCALE_FLOOR, reciprocal

PRECISIONS = ("int8", "int4")


class Buffers(NamedTuple):
    """A layer's quantized K/V storage (the module docstring says what each tensor holds)."""

    precision: str
    kq: torch.Tensor
    ks: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    k_recent: torch.Tensor | None  # INT4 only: K − k̄ of the incomplete group


def block_tokens(precision: str) -> int:
    """Capacities are whole multiples of this: INT4's groups, else 16-token blocks (the per-token scales'
    strides stay divisible by 16, so no kernel meets a new specialization as a cache grows)."""
    return GROUP if precision == "int4" else 16


def allocate(batch: int, heads: int, capacity: int, head_dim: int, precision: str, device,
             recent_dtype: torch.dtype = torch.bfloat16) -> Buffers:
    """Zeroed storage for at least ``capacity`` tokens: exactly that many, or for INT4 whole groups (the decode
    kernel reads a group a tile); the capacity is ``kq.shape[2]``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    b, h, d = batch, heads, head_dim
    if precision == "int4":
        capacity = -(-capacity // GROUP) * GROUP
        kq = torch.zeros(b, h, capacity, padded_head_dim(d) // 2, device=device, dtype=torch.int8)
        ks = torch.zeros(b, h, capacity // GROUP, 2, d, device=device, dtype=torch.bfloat16)
        k_recent = torch.zeros(b, h, GROUP, d, device=device, dtype=recent_dtype)
    else:
        kq = torch.zeros(b, h, capacity, d, device=device, dtype=torch.int8)
        ks = torch.zeros(b, h, capacity, device=device, dtype=torch.float32)
        k_recent = None
    vq = torch.zeros(b, h, capacity, d, device=device, dtype=torch.float8_e4m3fn)
    vs = torch.zeros(b, h, capacity, device=device, dtype=torch.float32)
    return Buffers(precision, kq, ks, vq, vs, k_recent)


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


def quantize_k_groups(kc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K − k̄ (…, n·GROUP, D) float32 of whole groups → (packed u (…, n·GROUP, D_PAD/2), scale and zero
    (…, n, 2, D) bf16): per channel over each group, u = round((x − zero) / scale) ∈ [0, 15] with the bf16
    scale and zero (what the kernel does, bit for bit)."""
    *lead, t, d = kc.shape
    x = kc.reshape(*lead, t // GROUP, GROUP, d)
    low, high = x.amin(-2), x.amax(-2)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which rounds differently
    # from the kernel's (and the CPU's) true division
    scale = ((high - low).clamp_min(SCALE_FLOOR) / torch.full_like(high, KV_INT4_LEVELS)).to(torch.bfloat16)
    zero = low.to(torch.bfloat16)
    u = torch.round((x - zero.float()[..., None, :]) * reciprocal(scale.float())[..., None, :])
    u = u.clamp_(0, KV_INT4_LEVELS).reshape(*lead, t, d)
    return pack_nibbles(u), torch.stack([scale, zero], dim=-2)


def quantize_k_tokens(kc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K − k̄ (…, N, D) float32 → INT8 (…, N, D) and δK (…, N): one scale per token."""
    qmax = INT_MAX["int8"]
    ks = kc.abs().amax(-1).clamp_min(SCALE_FLOOR) / qmax
    return torch.round(kc * reciprocal(ks)[..., None]).clamp_(-qmax, qmax).to(torch.int8), ks


def quantize_v(v: torch.Tensor, v_bar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, H, N, D) → FP8 (V − v̄) / δV and δV (B, H, N) per token."""
    vc = v.float() - v_bar[:, :, None, :]
    vs = vc.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (vc * reciprocal(vs)[..., None]).to(torch.float8_e4m3fn), vs


def append(k: torch.Tensor, v: torch.Tensor, k_bar: torch.Tensor, v_bar: torch.Tensor, buffers: Buffers,
           pos0: int) -> None:
    """Quantize k, v (B, H, N, D) into slots [pos0, pos0 + N) of ``buffers``, in place: what the append kernel
    does. INT4: tokens complete the group of slot ``pos0`` (its earlier tokens from ``k_recent``) and any later
    ones; whole groups are quantized, the tokens of a group still incomplete go to ``k_recent``."""
    n = k.shape[-2]
    if n == 0:
        return
    kc = k.float() - k_bar[:, :, None, :]
    buffers.vq[:, :, pos0: pos0 + n], buffers.vs[:, :, pos0: pos0 + n] = quantize_v(v, v_bar)
    if buffers.precision == "int8":
        buffers.kq[:, :, pos0: pos0 + n], buffers.ks[:, :, pos0: pos0 + n] = quantize_k_tokens(kc)
        return
    first = pos0 // GROUP * GROUP  # the group being filled
    end = pos0 + n
    whole = end // GROUP * GROUP
    span = torch.cat([buffers.k_recent[:, :, : pos0 - first].float(), kc], dim=-2)  # slots [first, end)
    if whole > first:
        packed, params = quantize_k_groups(span[:, :, : whole - first])
        buffers.kq[:, :, first:whole] = packed
        buffers.ks[:, :, first // GROUP: whole // GROUP] = params
    if end > whole:
        keep = max(whole, pos0)  # the incomplete group's new tokens (its older ones are in k_recent already)
        buffers.k_recent[:, :, keep - whole: end - whole] = span[:, :, keep - first:].to(buffers.k_recent.dtype)


def dequantize_k(buffers: Buffers, d: int, length: int, dtype=torch.float32, slots: torch.Tensor | None = None):
    """K − k̄ as stored for the first ``length`` slots (INT4: the whole groups and the incomplete one from
    ``k_recent``), or for the slots ``slots`` (INT8 only): (B, H, ·, D) in ``dtype``."""
    if buffers.precision == "int8":
        index = slice(0, length) if slots is None else slots
        return buffers.kq[:, :, index, :d].to(dtype) * buffers.ks[:, :, index, None].to(dtype)
    if slots is not None:
        raise ValueError("INT4 K is read in whole groups: dequantize_k takes a length, not slots")
    whole = length // GROUP * GROUP
    u = unpack_nibbles(buffers.kq[:, :, :whole], d).to(dtype)
    b, h = u.shape[:2]
    params = buffers.ks[:, :, : whole // GROUP].to(dtype)
    k = (u.view(b, h, whole // GROUP, GROUP, d) * params[:, :, :, 0, None] + params[:, :, :, 1, None])
    return torch.cat([k.view(b, h, whole, d), buffers.k_recent[:, :, : length - whole].to(dtype)], dim=-2)


def dequantize_v(vq: torch.Tensor, vs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """V − v̄ as stored: (B, H, N, D) in ``dtype``."""
    return vq.to(dtype) * vs[..., None].to(dtype)


def decode_attention(q, buffers: Buffers, v_bar, nk: int, *, sm_scale: float | None = None,
                     causal: bool = True, kv_start=None, kv_end=None, window: int | None = None,
                     chunk: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
                     k_bar: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                     dtype=torch.float64) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` slots of ``buffers``, computed in ``dtype``.

    Returns (B, Nq, Hq, D) in q's dtype (the layout transformers' attention functions return).
    Slot j holds the token at position ``key_positions[j]`` (default j: slots in order); query i of Nq
    sits at position P − Nq + 1 + i, P the newest key's (bottom-right alignment, as is_causal). Causal
    (several queries), ``window`` (keys p − W < j ≤ p) and ``chunk`` (j // C == p // C) compare
    positions; ``kv_start`` / ``kv_end`` (B,) select slots. ``sinks`` (Hq,): one more logit per query
    head in the denominator, no value. ``softcap``: scores c·tanh(s / c). Both need the true scores, so
    ``k_bar`` (B, Hk, D) (the stored K is K − k̄; without them q·k̄ shifts a row, which the softmax ignores). Rows that see no key give zeros (as the kernel).
    """
    b, hq, nq, d = q.shape
    hk = buffers.kq.shape[1]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    k = dequantize_k(buffers, d, nk, dtype)
    v = dequantize_v(buffers.vq[:, :, :nk], buffers.vs[:, :, :nk], dtype)
    if softcap is not None or sinks is not None:  # the true scores: capped, or compared with a sink
        if k_bar is None:
            raise ValueError("softcap and sinks need k_bar: their scores are those of K, not of the stored K − k̄")
        k = k + k_bar.to(dtype)[:, :, None, :]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
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
