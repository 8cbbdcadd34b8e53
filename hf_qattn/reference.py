"""The method in plain PyTorch: the trusted reference that kernels, integrations and calibration test against.

Layout: HND — q (B, Hq, Nq, D), k and v (B, Hk, Nk, D[v]) with Hq a multiple of Hk (GQA/MQA:
query head h reads key/value head h // (Hq // Hk)). Any float dtype in; all math in float32
(integer products exactly, in float64); the output comes back in q's dtype.

``quantized_attention`` walks the keys in tiles of ``block_n`` in the order a flash kernel does,
with the same online softmax in base 2, so a kernel can be compared with it tile for tile:

    smooth     K ← K − k̄;  Q ← Q − q̄, ΔS = q̄·Kᵀ;  V ← V − v̄            (any center is exact)
    quantize   Q̂, K̂ symmetric int (±127 / ±7) with per-row scales δQ, δK by granularity;
               V̂ per channel (over all keys, or per key tile) in the chosen format, scale δV
    per tile   S = Q̂K̂ᵀ·δQ·δK + ΔS  (times sm_scale·log2 e),  m ← max(m, rowmax S)
               P̃·448 = 2^(S − m + log2 448) ∈ [0, 448],  P̂ = P̃·448 cast to FP8 (static scale)
               l ← l·2^(m_old − m) + ΣP̃·448,   O ← O·2^(m_old − m) + (P̂V̂)·δV
    epilogue   O ← O / l + v̄  (the 448 cancels),  lse = (m + log2(l / 448))·ln 2 + sm_scale·q·k̄

``exact_attention`` is plain softmax attention in float64 — the yardstick for every error metric;
``sdpa_attention`` is torch's SDPA under the same masking rule — the full-precision fallback.
"""

from __future__ import annotations

import math

import torch

from . import quant
from .kernels.formats import LOG2E
from .masks import visible_keys



def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    sm_scale: float | None = None,
    qk: str = "int8",
    pv: str = "fp8_e4m3",
    q_granularity: str = "warp",
    k_granularity: str = "block",
    v_granularity: str = "block",
    smooth_q: bool = True,
    smooth_k: bool = True,
    smooth_v: bool = True,
    center_sample: int | None = None,
    block_m: int = 128,
    block_n: int = 64,
    warp_rows: int = 16,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    return_lse: bool = False,
    centers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split_channel: bool = False,
):
    """Quantized attention, simulated exactly (see the module docstring). HND layout.

    qk: "int8" | "int4" | "none";  pv: "fp8_e4m3" | "fp8_e5m2" | "int8" | "fp16" | "none".
    q_granularity / k_granularity: "token" | "warp" (``warp_rows`` rows) | "block" (``block_m`` /
    ``block_n`` rows) | "tensor". v_granularity: "channel" (over all keys) | "block" (per key tile).
    center_sample: see :func:`hf_qattn.quant.smoothing_center`. centers: (q̄, k̄, v̄) as (B, H, D) tensors
    to use instead (a kernel's own, whose sums ran in another order: a last-bit difference in a center
    can flip a rounding tie, which is not what a kernel-vs-reference comparison is after). split_channel: take
    the channel :func:`hf_qattn.quant.split_channel` finds out of K̂ and add its rank-one term in float,
    as the kernels do with ``qattn(split_channel=True)``. Returns O, or (O, lse) with lse
    (B, Hq, Nq) float32 in natural-log units of the scaled scores.
    """
    if qk not in quant.QK_FORMATS:
        raise ValueError(f"qk must be one of {quant.QK_FORMATS}, got {qk!r}")
    if pv not in quant.PV_FORMATS:
        raise ValueError(f"pv must be one of {quant.PV_FORMATS}, got {pv!r}")
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf, kf, vf = q.float(), k.float(), v.float()

    def center(x, on):
        return quant.smoothing_center(x, center_sample) if on else x.new_zeros(x.shape[:2] + x.shape[-1:])

    if centers is None:
        q_bar, k_bar, v_bar = center(qf, smooth_q), center(kf, smooth_k), center(vf, smooth_v)
    else:
        q_bar, k_bar, v_bar = (c.float() for c in centers)
    qs, ks, vs = qf - q_bar[:, :, None], kf - k_bar[:, :, None], vf - v_bar[:, :, None]
    delta_s = torch.einsum("bhd,bhnd->bhn", q_bar, _repeat_kv(ks, groups))
    # the split channel (at most one per kv head): out of K̂, its scores q_c·k_c kept in float
    q_split = qs.new_zeros(b, hq, nq)
    k_split = ks.new_zeros(b, hk, nk)
    if split_channel and qk != "none":
        channel = quant.split_channel(kf, k_bar)  # (B, Hk)
        one_hot = (torch.arange(d, device=k.device) == channel[..., None]).float()  # all zero without a split
        k_split = torch.einsum("bhnd,bhd->bhn", ks, one_hot)
        q_split = torch.einsum("bhnd,bhd->bhn", qs, _repeat_kv(one_hot[:, :, None], groups)[:, :, 0])
        ks = ks * (1 - one_hot[:, :, None])

    if qk == "none":
        q_hat, k_hat = qs, ks
        dq, dk = qs.new_ones(b, hq, nq), ks.new_ones(b, hk, nk)
    else:
        qmax = quant.INT_MAX[qk]
        q_hat, dq = quant.quantize_int(qs, qmax, quant.group_rows(q_granularity, block_m, warp_rows))
        k_hat, dk = quant.quantize_int(ks, qmax, quant.group_rows(k_granularity, block_n, warp_rows))
    v_hat, dv_scale = quant.quantize_v(vs, pv, v_granularity, block_n)
    k_hat, dk, v_hat, dv_scale, k_split = (_repeat_kv(x, groups) for x in (k_hat, dk, v_hat, dv_scale, k_split))

    visible = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, device=q.device)
    c = scale * LOG2E
    q_coef = dq * c  # the kernel folds sm_scale·log2 e into δQ once per query tile
    p_log2 = math.log2(quant.P_SCALE[pv])
    m = torch.full((b, hq, nq), -math.inf, device=q.device)
    l = torch.zeros(b, hq, nq, device=q.device)
    acc = torch.zeros(b, hq, nq, dv, device=q.device)
    for tile, j0 in enumerate(range(0, nk, block_n)):
        j1 = min(j0 + block_n, nk)
        qk_int = torch.matmul(q_hat.double(), k_hat[:, :, j0:j1].double().transpose(-1, -2)).float()
        s = qk_int * (q_coef[..., None] * dk[:, :, None, j0:j1]) + (
            delta_s[:, :, None, j0:j1] * c + (q_split * c)[..., None] * k_split[:, :, None, j0:j1])
        s = s.masked_fill(~visible[..., j0:j1], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # rows that saw no key yet
        p_scaled = torch.exp2(s - (m_safe - p_log2)[..., None])  # P̃·P_SCALE: the static scale folded in
        alpha = torch.exp2(m - m_safe)
        l = l * alpha + p_scaled.sum(-1)
        tile_out = torch.matmul(quant.quantize_p(p_scaled, pv), v_hat[:, :, j0:j1])
        acc = acc * alpha[..., None] + tile_out * dv_scale[:, :, tile][:, :, None, :]
        m = m_new

    # l is 0 exactly for rows that saw no key; NaN (from NaN/±Inf inputs) must stay NaN, not become zeros
    seen = l != 0
    v_bar = _repeat_kv(v_bar[:, :, None], groups)
    out = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None] + v_bar, 0.0)
    out = out.to(q.dtype)
    if not return_lse:
        return out
    k_bar_q = _repeat_kv(k_bar[:, :, None], groups)[:, :, 0]
    shift = torch.einsum("bhnd,bhd->bhn", qf, k_bar_q) * scale
    lse = torch.where(seen, (m + torch.log2(torch.where(seen, l, 1.0)) - p_log2) / LOG2E + shift, -math.inf)
    return out, lse


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    return_lse: bool = False,
    dtype: torch.dtype = torch.float64,
):
    """Softmax attention computed in ``dtype`` (float64 by default), HND; output stays in ``dtype``.

    Runs one query head at a time so the score matrix of a long sequence stays small.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    visible = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, device=q.device)
    outs, lses = [], []
    for h in range(hq):
        qh = q[:, h].to(dtype)
        kh, vh = k[:, h // groups].to(dtype), v[:, h // groups].to(dtype)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        s = s.masked_fill(~visible[:, 0], -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
        outs.append(torch.matmul(p, vh))
        lses.append(lse)
    out = torch.stack(outs, dim=1) if hq else q.new_zeros(b, 0, nq, v.shape[-1], dtype=dtype)
    if not return_lse:
        return out
    return out, (torch.stack(lses, dim=1) if hq else q.new_zeros(b, 0, nq, dtype=dtype))


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Full-precision attention through ``torch.nn.functional.scaled_dot_product_attention`` (HND).

    Same masking rule as the kernels (rows that see no key give zeros, where SDPA alone gives
    NaN). SDPA returns no log-sum-exp, so ``return_lse`` computes in float32 here instead.
    """
    if return_lse:
        out, lse = exact_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale, kv_start=kv_start,
                                   kv_end=kv_end, return_lse=True, dtype=torch.float32)
        return out.to(q.dtype), lse
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    mask = None
    if kv_start is not None or kv_end is not None or (is_causal and nq != nk):
        mask = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, device=q.device)
    k, v = _repeat_kv(k, hq // hk), _repeat_kv(v, hq // hk)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=sm_scale)
    if mask is not None:
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out
