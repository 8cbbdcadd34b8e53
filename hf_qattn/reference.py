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
               [channel-dither: P̂ = FP8(P̃·448·φ_t), m over S + log2 φ_t, l without φ_t]
               l ← l·2^(m_old − m) + ΣP̃·448,   O ← O·2^(m_old − m) + (P̂V̂)·δV
    epilogue   O ← O / l + v̄  (the 448 cancels),  lse = (m + log2(l / 448))·ln 2 + sm_scale·q·k̄

The variants (``window``, ``chunk``, ``sinks``, ``softcap``; see :func:`hf_qattn.qattn`) as the kernels
compute them. The kernel's scores are the true ones less a per-row term, t = sm_scale·q·k̄·log2 e (K's
smoothing: S_kernel = S_true·log2 e − t, exactly up to rounding):

    window / chunk   more keys masked (:func:`visible_keys`); ΔS is per key, so smoothing stays exact
    softcap c        S ← c'·tanh((S + t) / c') with c' = c·log2 e: the true score, capped, in base 2;
                     from then on the row term is 0 (t is folded in), masking to −inf after the cap
    sinks σ_h        one more logit without a value after the last tile, in the kernel's units
                     σ' = σ_h·log2 e − t:  m' = max(m, σ'),  α = 2^(m − m'),
                     l' = α·l + 2^(σ' − m' + log2 448),
                     O ← α·O / l' + v̄·(α·l / l')  (the weights of the keys sum to α·l / l', not 1)

``exact_attention`` is plain softmax attention in float64 — the yardstick for every error metric;
``sdpa_attention`` is torch's SDPA under the same masking rule — the full-precision fallback.
"""

from __future__ import annotations

import math

import torch

from . import quant
from .kernels.formats import LOG2E
from .masks import visible_keys  # noqa: F401  (the key rules; re-exported for the reference's users)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sink_logits(sinks: torch.Tensor, b: int, nq: int) -> torch.Tensor:
    """(Hq,) sinks as a (B, Hq, Nq) float32 tensor."""
    return sinks.float().view(1, -1, 1).expand(b, -1, nq)


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
    v_center_sample: int | None = None,
    block_m: int = 128,
    block_n: int = 64,
    warp_rows: int = 16,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    return_lse: bool = False,
    centers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split_channel: bool = False,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """Quantized attention, simulated exactly (see the module docstring). HND layout.

    qk: "int8" | "int4" | "none";  pv: "fp8_e4m3" | "fp8_e5m2" | "int8" | "fp16" | "none".
    q_granularity / k_granularity: "token" | "warp" (``warp_rows`` rows) | "block" (``block_m`` /
    ``block_n`` rows) | "tensor". v_granularity: "channel" (over all keys) | "channel-dither" (the same, times
    each key tile's dither φ_t, put back into P as the sm90 kernel does) | "block" (per key tile).
    center_sample: see :func:`hf_qattn.quant.smoothing_center`; v_center_sample: V's, if other than that.
    centers: (q̄, k̄, v̄) as (B, H, D) tensors to use instead (a kernel's own, whose sums ran in another order:
    a last-bit difference in a center can flip a rounding tie, which is not what a kernel-vs-reference
    comparison is after). split_channel: take the channel :func:`hf_qattn.quant.split_channel` finds out of
    K̂ and add its rank-one term in float, as the kernels do with ``qattn(split_channel=True)``. window, chunk, sinks (Hq,), softcap: the variants
    of :func:`hf_qattn.qattn`, computed as the module docstring says. Returns O, or (O, lse) with lse
    (B, Hq, Nq) float32 in natural-log units of the scaled scores (sinks included, scores capped).
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

    def center(x, on, sample=center_sample):
        return quant.smoothing_center(x, sample) if on else x.new_zeros(x.shape[:2] + x.shape[-1:])

    if centers is None:
        v_sample = center_sample if v_center_sample is None else v_center_sample
        q_bar, k_bar, v_bar = center(qf, smooth_q), center(kf, smooth_k), center(vf, smooth_v, v_sample)
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

    visible = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, window=window,
                           chunk=chunk, device=q.device)
    c = scale * LOG2E
    q_coef = dq * c  # the kernel folds sm_scale·log2 e into δQ once per query tile
    # the per-row term K's smoothing leaves out of the kernel's scores, in base 2 (true = kernel + t)
    k_bar_q = _repeat_kv(k_bar[:, :, None], groups)[:, :, 0]
    row_term = torch.einsum("bhnd,bhd->bhn", qf, k_bar_q) * c
    p_log2 = math.log2(quant.P_SCALE[pv])
    dither = v_granularity == "channel-dither" and pv not in ("none", "fp16")  # tile 0's scale is δV itself
    m = torch.full((b, hq, nq), -math.inf, device=q.device)
    l = torch.zeros(b, hq, nq, device=q.device)
    acc = torch.zeros(b, hq, nq, dv, device=q.device)
    for tile, j0 in enumerate(range(0, nk, block_n)):
        j1 = min(j0 + block_n, nk)
        qk_int = torch.matmul(q_hat.double(), k_hat[:, :, j0:j1].double().transpose(-1, -2)).float()
        s = qk_int * (q_coef[..., None] * dk[:, :, None, j0:j1]) + (
            delta_s[:, :, None, j0:j1] * c + (q_split * c)[..., None] * k_split[:, :, None, j0:j1])
        if softcap is not None:
            s = soft_cap(s + row_term[..., None], softcap)
        s = s.masked_fill(~visible[..., j0:j1], -math.inf)
        # V̂'s tile dither φ goes into P (P̂ = FP8(P̃·P_SCALE·φ), and into m so P̂ stays in range), not into l
        phi = quant.v_dither(tile) if dither else 1.0
        m_new = torch.maximum(m, s.amax(-1) + math.log2(phi))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # rows that saw no key yet
        p_scaled = torch.exp2(s - (m_safe - (p_log2 + math.log2(phi)))[..., None])  # P̃·P_SCALE: scale folded in
        alpha = torch.exp2(m - m_safe)
        l = l * alpha + p_scaled.sum(-1) * (1.0 / phi)
        tile_out = torch.matmul(quant.quantize_p(p_scaled, pv), v_hat[:, :, j0:j1])
        acc = acc * alpha[..., None] + tile_out * dv_scale[:, :, 0 if dither else tile][:, :, None, :]
        m = m_new

    # with a soft cap the scores are the true ones: no row term left to add back
    shift = torch.zeros_like(row_term) if softcap is not None else row_term
    v_bar = _repeat_kv(v_bar[:, :, None], groups)
    if sinks is None:
        v_weight = l  # the weights of the keys sum to l / l = 1
    else:  # one more logit, without a value: weights of the keys sum to α·l / l′, which v̄ gets
        sink = _sink_logits(sinks, b, nq) * LOG2E - shift
        m_new = torch.maximum(m, sink)
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha = torch.exp2(m - m_safe)
        acc = acc * alpha[..., None]
        v_weight = l * alpha
        l = v_weight + torch.exp2(sink - m_safe + p_log2)
        m = m_new
    # l is 0 exactly for rows that saw no key (nor sink); NaN (from NaN/±Inf inputs) must stay NaN, not zeros
    seen = l != 0
    l_safe = torch.where(seen, l, 1.0)
    out = torch.where(seen[..., None], acc / l_safe[..., None] + v_bar * (v_weight / l_safe)[..., None], 0.0)
    out = out.to(q.dtype)
    if not return_lse:
        return out
    lse = torch.where(seen, (m + torch.log2(l_safe) - p_log2 + shift) / LOG2E, -math.inf)
    return out, lse


def soft_cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """c·tanh(s / c) for base-2 scores s (c the cap of the natural-log scores), as the kernels compute it:
    tanh(x) = 1 − 2 / (e^{2x} + 1), with e^{2x} = 2^{2·s / c} for x = s / (c·log2 e). ±∞ maps to ±c·log2 e."""
    return (softcap * LOG2E) * (1.0 - 2.0 / (torch.exp2(s * (2.0 / softcap)) + 1.0))


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
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """Softmax attention computed in ``dtype`` (float64 by default), HND; output stays in ``dtype``.

    The variants as :func:`hf_qattn.qattn` defines them: ``window`` / ``chunk`` mask keys
    (:func:`visible_keys`), ``softcap`` c makes the scaled scores c·tanh(s / c) before the mask,
    ``sinks`` (Hq,) adds one logit per head to the softmax denominator (no value); lse includes it.
    Runs one query head at a time so the score matrix of a long sequence stays small.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    visible = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, window=window,
                           chunk=chunk, device=q.device)
    outs, lses = [], []
    for h in range(hq):
        qh = q[:, h].to(dtype)
        kh, vh = k[:, h // groups].to(dtype), v[:, h // groups].to(dtype)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible[:, 0], -math.inf)
        if sinks is not None:  # one more logit per row, without a value: it joins the denominator only
            s = torch.cat([s, sinks[h].to(dtype).expand(b, nq, 1)], dim=-1)
            vh = torch.cat([vh, vh.new_zeros(b, 1, vh.shape[-1])], dim=1)
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
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """Full-precision attention through ``torch.nn.functional.scaled_dot_product_attention`` (HND).

    Same masking rule as the kernels (rows that see no key give zeros, where SDPA alone gives
    NaN); ``window`` / ``chunk`` join it as a boolean mask. SDPA has no sinks, soft cap or
    log-sum-exp: with any of them this computes :func:`exact_attention` in float32 instead.
    """
    if return_lse or sinks is not None or softcap is not None:
        out, lse = exact_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale, kv_start=kv_start,
                                   kv_end=kv_end, return_lse=True, dtype=torch.float32, window=window, chunk=chunk,
                                   sinks=sinks, softcap=softcap)
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    mask = None
    if (kv_start is not None or kv_end is not None or (is_causal and nq != nk) or window is not None
            or chunk is not None):
        mask = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=kv_start, kv_end=kv_end, window=window,
                            chunk=chunk, device=q.device)
    k, v = _repeat_kv(k, hq // hk), _repeat_kv(v, hq // hk)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=sm_scale)
    if mask is not None:
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out
