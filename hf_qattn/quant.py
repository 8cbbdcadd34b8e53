"""Quantization primitives of the method, in plain PyTorch (float32 math).

Shared by the reference attention, the kernel launchers (which must use the very same smoothing
centers) and the calibration code. Layout: tensors are (batch, heads, tokens, dim) here.

Values are scaled as x · (1 / scale) (:func:`reciprocal`), then rounded to nearest even
(``torch.round``) and clamped to the integer range — exactly what the kernels do. A group whose values are all zero gets the
tiny scale ``SCALE_FLOOR`` so that quantizing it yields zeros, never NaN.
"""

from __future__ import annotations

import math

import torch

from hf_qattn.kernels.formats import FLOAT_MAX, INT_MAX, P_SCALE, SCALE_FLOOR, v_dither  # noqa: F401 (re-exported)

FLOAT_DTYPE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

QK_FORMATS = ("int8", "int4", "none")
PV_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "fp16", "none")
GRANULARITIES = ("tensor", "block", "warp", "token")
# "channel-dither": per channel over all keys, times key tile t's dither φ_t (the sm90 kernel's; see
# kernels/formats.py V_DITHER_LEVELS), so that copies of one value do not all round alike
V_GRANULARITIES = ("channel", "channel-dither", "block")


def smoothing_center(x: torch.Tensor, sample: int | None = None) -> torch.Tensor:
    """Per-(batch, head) channel center of ``x`` (B, H, N, D) → (B, H, D), float32.

    Smoothing subtracts this vector from every token. The result of attention does not depend
    on which vector is subtracted (the corrections ΔS and v̄ undo it exactly); only the
    quantization error does. ``sample=None`` is the exact mean over tokens; ``sample=s`` is the
    mean over an evenly strided subset of at most ``s`` tokens, which removes the channel-wise
    offset just as well at a fraction of the memory traffic (the kernels use it by default).
    """
    n = x.shape[-2]
    if n == 0:
        return x.new_zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.float32)
    if sample is not None and n > sample:
        x = x[..., :: math.ceil(n / sample), :]
    return x.mean(dim=-2, dtype=torch.float32)


# A K channel whose sampled range reaches this many times the mean channel range of its head is split
# out of the INT8 product (the kernels' rule: kernels/quantize.py).
SPLIT_RATIO = 8.0


def split_channel(k: torch.Tensor, k_bar: torch.Tensor) -> torch.Tensor:
    """Per (batch, head) of k (B, H, N, D), the channel to compute in float outside the INT8 product,
    or −1: the channel whose range max |K_c − k̄_c| over all tokens is at least :data:`SPLIT_RATIO`
    times the head's mean channel range. One such channel (large values of both signs: smoothing cannot
    remove it) would set every scale of K and crush the other channels. Over all tokens, not a sample:
    a strided sample can miss a pattern in step with its stride."""
    if k.shape[-2] == 0:
        return torch.full(k.shape[:2], -1, dtype=torch.long, device=k.device)
    k = k.float()
    spread = torch.maximum(k.amax(-2) - k_bar, k_bar - k.amin(-2))  # (B, H, D)
    top, channel = spread.max(-1)
    split = (top > 0) & torch.isfinite(top) & (top >= SPLIT_RATIO * spread.mean(-1))  # NaN/Inf: not split
    return torch.where(split, channel, -1)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, correctly rounded: values are quantized as x · (1 / scale), as the kernels
    do (one division per scale, not per value), so kernels and references round alike."""
    return 1.0 / scale.float()


def group_rows(granularity: str, block_rows: int, warp_rows: int) -> int | None:
    """Rows sharing one scale: None means the whole tensor."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return {"tensor": None, "block": block_rows, "warp": warp_rows, "token": 1}[granularity]


def row_scales(x: torch.Tensor, qmax: float, rows: int | None) -> torch.Tensor:
    """Scale of each token row of ``x`` (B, H, N, D) → (B, H, N): max|x| over its group / qmax.

    Groups are ``rows`` consecutive tokens counted from token 0 of each (batch, head), i.e.
    aligned to the kernel's tiles; the last group may be short.
    """
    b, h, n, d = x.shape
    if n == 0:
        return x.new_zeros(b, h, 0)
    if rows is None:
        amax = x.abs().amax().expand(b, h, n)
    else:
        groups = math.ceil(n / rows)
        padded = torch.nn.functional.pad(x.abs(), (0, 0, 0, groups * rows - n))
        amax = padded.reshape(b, h, groups, rows * d).amax(-1)
        amax = amax.repeat_interleave(rows, dim=-1)[..., :n]
    return amax.clamp_min(SCALE_FLOOR) / qmax


def quantize_int(x: torch.Tensor, qmax: float, rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integer quantization; returns (integer values held in float32, per-row scale)."""
    scale = row_scales(x, qmax, rows)
    return torch.round(x * reciprocal(scale)[..., None]).clamp_(-qmax, qmax), scale


def quantize_v(v: torch.Tensor, fmt: str, granularity: str, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize V (B, H, N, D) per channel, over all tokens or per key tile of ``block_n`` tokens.

    Returns (quantized values as float32, scale of shape (B, H, tiles, D)) where tile ``t``
    covers tokens [t·block_n, (t+1)·block_n); with per-channel granularity every tile holds the
    same scale, with ``channel-dither`` that scale times φ_t (:func:`v_dither`; φ_0 = 1). ``fp16`` and
    ``none`` keep V as it is (scale 1; fp16 rounds the values).
    """
    b, h, n, d = v.shape
    tiles = max(1, math.ceil(n / block_n))
    if fmt in ("none", "fp16"):
        vq = v.to(torch.float16).float() if fmt == "fp16" else v
        return vq, v.new_ones(b, h, tiles, d)
    if granularity not in V_GRANULARITIES:
        raise ValueError(f"v_granularity must be one of {V_GRANULARITIES}, got {granularity!r}")
    qmax = INT_MAX["int8"] if fmt == "int8" else FLOAT_MAX[fmt]
    if granularity == "block":
        padded = torch.nn.functional.pad(v.abs(), (0, 0, 0, tiles * block_n - n))
        amax = padded.reshape(b, h, tiles, block_n, d).amax(-2)
    else:
        amax = v.abs().amax(dim=-2, keepdim=True).expand(b, h, tiles, d)
    scale = amax.clamp_min(SCALE_FLOOR) / qmax
    if granularity == "channel-dither":
        scale = scale * torch.tensor([v_dither(t) for t in range(tiles)], device=v.device)[:, None]
    per_token = scale.repeat_interleave(block_n, dim=-2)[..., :n, :]
    scaled = v * reciprocal(per_token)
    if fmt == "int8":
        return torch.round(scaled).clamp_(-qmax, qmax), scale
    return scaled.to(FLOAT_DTYPE[fmt]).float(), scale


# P_SCALE (kernels/formats.py): P̃ ∈ [0, 1] is computed directly as P̃·P_SCALE = 2^(S − m + log2 P_SCALE).


def quantize_p(p_scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize P̃·P_SCALE[fmt] (values in [0, P_SCALE]) to ``fmt``, returned as float32.

    FP8 saturates at the format's largest value, as the kernels' conversion does (``satfinite``): with
    scores beyond 2^24 in magnitude, float32 rounds s − (m − log2 P_SCALE) above log2 P_SCALE, and a
    plain cast (torch 2.11) would make NaN of it."""
    if fmt == "none":
        return p_scaled
    if fmt == "fp16":
        return p_scaled.to(torch.float16).float()
    if fmt == "int8":
        return torch.round(p_scaled)
    return p_scaled.clamp(max=FLOAT_MAX[fmt]).to(FLOAT_DTYPE[fmt]).float()
