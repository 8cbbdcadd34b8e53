"""The quantized KV cache's math in plain PyTorch: the reference for the cache kernels and the CPU path.

Storage (per layer; see ``kernels/decode.py``): K − k̄ in INT8 (±127) with one scale per token,
or INT4 (±7) packed two a byte (channel c low nibble, channel c + D_PAD/2 high nibble); V − v̄ in
FP8 E4M3 with one scale per token (max |V − v̄| / 448). k̄ and v̄ are per-(batch, head, channel)
centers fixed when the layer is first filled.

Attention over the cache:  O = softmax(sm_scale · q · (K̂·δK)ᵀ) · (V̂·δV) + v̄ — the k̄ term adds
q·k̄ to a whole row of scores, which the softmax ignores.
"""

from __future__ import annotations

import math

import torch

from ..masks import visible_keys
from ..kernels.formats import FP8_E4M3_MAX as FP8_MAX, INT_MAX, padded_head_dim  # noqa: F401 (re-exported)
from ..quant import SCALE_FLOOR, reciprocal


def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int values in [-7, 7] (…, D) → int8 bytes (…, D_PAD/2): channel c low nibble, c + D_PAD/2 high."""
    d = x.shape[-1]
    half = padded_head_dim(d) // 2
    x = torch.nn.functional.pad(x.to(torch.int8), (0, 2 * half - d))
    lo, hi = x[..., :half], x[..., half:]
    return (lo & 15) | (hi << 4)


def unpack_int4(packed: torch.Tensor, d: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int8 (…, D)."""
    lo = (packed << 4) >> 4  # int8 shifts: arithmetic, so the low nibble comes back sign-extended
    hi = packed >> 4
    return torch.cat([lo, hi], dim=-1)[..., :d]


def centers(k: torch.Tensor, v: torch.Tensor, sample: int | None = 256):
    """k̄, v̄ (B, H, D) float32: channel means over (an even sample of) the tokens of the first fill."""
    from ..quant import smoothing_center

    return smoothing_center(k, sample).contiguous(), smoothing_center(v, sample).contiguous()


def quantize_tokens(k: torch.Tensor, v: torch.Tensor, k_bar: torch.Tensor, v_bar: torch.Tensor, precision: str):
    """k, v (B, H, N, D) → (kq, ks, vq, vs) in the cache's storage format (see the module docstring)."""
    qmax = INT_MAX[precision]
    kc = k.float() - k_bar[:, :, None, :]
    ks = kc.abs().amax(-1).clamp_min(SCALE_FLOOR) / qmax
    kq = torch.round(kc * reciprocal(ks)[..., None]).clamp_(-qmax, qmax).to(torch.int8)
    if precision == "int4":
        kq = pack_int4(kq)
    vc = v.float() - v_bar[:, :, None, :]
    vs = vc.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    vq = (vc * reciprocal(vs)[..., None]).to(torch.float8_e4m3fn)
    return kq, ks, vq, vs


def dequantize_k(kq: torch.Tensor, ks: torch.Tensor, d: int, precision: str, dtype=torch.float32) -> torch.Tensor:
    """K − k̄ as stored: (B, H, N, D) in ``dtype``."""
    ints = unpack_int4(kq, d) if precision == "int4" else kq[..., :d]
    return ints.to(dtype) * ks[..., None].to(dtype)


def dequantize_v(vq: torch.Tensor, vs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """V − v̄ as stored: (B, H, N, D) in ``dtype``."""
    return vq.to(dtype) * vs[..., None].to(dtype)


def decode_attention(q, kq, ks, vq, vs, v_bar, nk: int, *, precision: str, sm_scale: float | None = None,
                     causal: bool = True, kv_start=None, kv_end=None, window: int | None = None,
                     chunk: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
                     k_bar: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                     dtype=torch.float64) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` cached slots, computed in ``dtype``.

    Returns (B, Nq, Hq, D) in q's dtype (the layout transformers' attention functions return).
    Slot j holds the token at position ``key_positions[j]`` (default j: slots in order); query i of Nq
    sits at position P − Nq + 1 + i, P the newest key's (bottom-right alignment, as is_causal). Causal
    (several queries), ``window`` (keys p − W < j ≤ p) and ``chunk`` (j // C == p // C) compare
    positions; ``kv_start`` / ``kv_end`` (B,) select slots. ``sinks`` (Hq,): one more logit per query
    head in the denominator, no value. ``softcap``: scores c·tanh(s / c). Both need the true scores, so
    ``k_bar`` (B, Hk, D) (the stored K is K − k̄; without them q·k̄ shifts a row, which the softmax ignores). Rows that see no key give zeros (as the kernel).
    """
    b, hq, nq, d = q.shape
    hk = kq.shape[1]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    k = dequantize_k(kq[:, :, :nk], ks[:, :, :nk], d, precision, dtype)
    v = dequantize_v(vq[:, :, :nk], vs[:, :, :nk], dtype)
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
