"""Run one quantized attention call on the kernels: centers → quantize K/V → attention.

Inputs are already validated by :func:`hf_qattn.qattn`; this module only lays out buffers and
launches. Views are HND by strides (an NHD tensor is passed as its transposed view: no copy).
"""

from __future__ import annotations

import math

import torch
import triton

from hf_qattn.quant import INT_MAX, smoothing_center

from . import tuning
from .attention import attention_kernel
from .quantize import quantize_kv_kernel

LOG2E = 1.4426950408889634


def _centers(x: torch.Tensor, on: bool) -> torch.Tensor:
    """(B, H, D) float32 contiguous: the smoothing center, or zeros when smoothing is off."""
    if not on:
        return torch.zeros(x.shape[0], x.shape[1], x.shape[3], device=x.device, dtype=torch.float32)
    return smoothing_center(x, tuning.center_sample()).contiguous()


def quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    is_causal: bool,
    sm_scale: float,
    qk: str,
    v_fp8: bool,
    smooth_q: bool,
    smooth_k: bool,
    smooth_v: bool,
    kv_start: torch.Tensor | None,
    kv_end: torch.Tensor | None,
    return_lse: bool,
    config: dict | None = None,
) -> torch.Tensor | None:
    """q (B, Hq, Nq, D), k/v (B, Hk, Nk, D), out like q — all HND views. Writes ``out``; returns lse or None."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    device = q.device
    if config is None:
        config = tuning.attention_config(tuning.arch_of(device), d, is_causal, "fp8" if v_fp8 else "fp16")
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    d_pad = tuning.padded_head_dim(d)
    tiles = math.ceil(nk / block_n)
    nk_pad = tiles * block_n
    score_coef = sm_scale * LOG2E
    qk_max = INT_MAX[qk]

    q_bar, k_bar, v_bar = _centers(q, smooth_q), _centers(k, smooth_k), _centers(v, smooth_v)
    kq = torch.empty(b * hk, nk_pad, d_pad, device=device, dtype=torch.int8)
    ks = torch.empty(b * hk, nk_pad if config["K_TOKEN_SCALE"] else tiles, device=device, dtype=torch.float32)
    vq = torch.empty(b * hk, d_pad, nk_pad, device=device, dtype=torch.float8_e4m3fn if v_fp8 else torch.float16)
    vs = torch.empty(b * hk, tiles, d_pad, device=device, dtype=torch.float32)
    ds = torch.empty(b * hq, nk_pad, device=device, dtype=torch.float32)
    quantize_kv_kernel[(tiles, b * hk)](
        k, v, k_bar, v_bar, q_bar, kq, ks, vq, vs, ds,
        *k.stride(), *v.stride(),
        hk, hq // hk, nk, nk_pad, tiles, score_coef,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, QK_MAX=qk_max,
        K_TOKEN_SCALE=config["K_TOKEN_SCALE"], V_FP8=v_fp8, P_SCALE=448.0 if v_fp8 else 1.0, GRID_ROUND=tuning.interpreting(),
        num_warps=tuning.quantize_num_warps(),
    )

    lse = torch.empty(b, hq, nq, device=device, dtype=torch.float32) if return_lse else None
    has_range = kv_start is not None or kv_end is not None
    if has_range:
        kv_start = (kv_start if kv_start is not None else torch.zeros(b, device=device)).to(torch.int32).contiguous()
        kv_end = (kv_end if kv_end is not None else torch.full((b,), nk, device=device)).to(torch.int32).contiguous()
    attention_kernel[(triton.cdiv(nq, block_m), b * hq)](
        q, kq, ks, vq, vs, ds, q_bar, k_bar, v_bar, kv_start, kv_end, out, lse,
        *q.stride(), *out.stride(),
        hq, hq // hk, nq, nk, nk_pad, tiles, score_coef,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, Q_GROUP=config["Q_GROUP"],
        QK_MAX=qk_max, CAUSAL=is_causal, HAS_KV_RANGE=has_range,
        K_TOKEN_SCALE=config["K_TOKEN_SCALE"], V_FP8=v_fp8, RETURN_LSE=return_lse, GRID_ROUND=tuning.interpreting(),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return lse
