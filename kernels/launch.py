"""Run one quantized attention call on the kernels: centers → quantize K/V → attention.

Inputs are already validated by :func:`hf_qattn.qattn`; this module only lays out buffers and
launches. Views are HND by strides (an NHD tensor is passed as its transposed view: no copy).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from hf_qattn.quant import INT_MAX, P_SCALE

from . import tuning
from .attention import attention_kernel
from .quantize import centers_kernel, quantize_kv_kernel

LOG2E = 1.4426950408889634


def smoothing_centers(q, k, v, smooth_q: bool, smooth_k: bool, smooth_v: bool):
    """(q̄, k̄, v̄) as float32 (B·H, D) views of one buffer; zeros where smoothing is off."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    sample = tuning.center_sample()
    centers = torch.empty(b * hq + 2 * b * hk, d, device=q.device, dtype=torch.float32)
    centers_kernel[(b * max(hq, hk), 3)](
        q, k, v, centers, *q.stride(), *k.stride(), *v.stride(),
        hq, hk, b * hq, b * hk, nq, nk, math.ceil(nq / sample) if nq > sample else 1,
        math.ceil(nk / sample) if nk > sample else 1,
        HEAD_DIM=d, D_PAD=tuning.padded_head_dim(d), ROWS=64,
        SMOOTH_Q=smooth_q, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v, num_warps=4,
    )
    return centers[: b * hq], centers[b * hq: b * (hq + hk)], centers[b * (hq + hk):]


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
        config = tuning.attention_config(tuning.arch_of(device), d, is_causal, "fp8" if v_fp8 else "fp16", qk)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    d_pad = tuning.padded_head_dim(d)
    tiles = math.ceil(nk / block_n)
    nk_pad = tiles * block_n
    score_coef = sm_scale * LOG2E
    qk_max = INT_MAX[qk]
    grid_round = tuning.interpreting()

    q_bar, k_bar, v_bar = smoothing_centers(q, k, v, smooth_q, smooth_k, smooth_v)
    kq = torch.empty(b * hk * nk_pad, d_pad, device=device, dtype=torch.int8)
    ks = torch.empty(b * hk, nk_pad if config["K_TOKEN_SCALE"] else tiles, device=device, dtype=torch.float32)
    vq = torch.empty(b * hk * d_pad, nk_pad, device=device, dtype=torch.float8_e4m3fn if v_fp8 else torch.float16)
    vs = torch.empty(b * hk, tiles, d_pad, device=device, dtype=torch.float32)
    ds = torch.empty(b * hq, nk_pad, device=device, dtype=torch.float32)
    kq_desc = TensorDescriptor.from_tensor(kq, [block_n, d_pad])
    vq_desc = TensorDescriptor.from_tensor(vq, [d_pad, block_n])
    quantize_kv_kernel[(tiles, b * hk)](
        k, v, k_bar, v_bar, q_bar, kq, ks, vq, vs, ds,
        *k.stride(), *v.stride(),
        hk, hq // hk, nk, nk_pad, tiles, score_coef,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, QK_MAX=qk_max,
        K_TOKEN_SCALE=config["K_TOKEN_SCALE"], V_FP8=v_fp8, GRID_ROUND=grid_round,
        num_warps=tuning.quantize_num_warps(block_n, d),
    )

    lse = torch.empty(b, hq, nq, device=device, dtype=torch.float32) if return_lse else None
    has_range = kv_start is not None or kv_end is not None
    if has_range:
        kv_start = torch.zeros(b, device=device, dtype=torch.int32) if kv_start is None else kv_start.to(torch.int32).contiguous()
        kv_end = torch.full((b,), nk, device=device, dtype=torch.int32) if kv_end is None else kv_end.to(torch.int32).contiguous()
    attention_kernel[(triton.cdiv(nq, block_m), b * hq)](
        q, kq_desc, ks, vq_desc, vs, ds, q_bar, k_bar, v_bar, kv_start, kv_end, out, lse,
        *q.stride(), *out.stride(),
        hq, hq // hk, nq, nk, nk_pad, tiles, score_coef,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, Q_GROUP=config["Q_GROUP"],
        QK_MAX=qk_max, CAUSAL=is_causal, HAS_KV_RANGE=has_range,
        K_TOKEN_SCALE=config["K_TOKEN_SCALE"], V_FP8=v_fp8,
        P_LOG2=math.log2(P_SCALE["fp8_e4m3"] if v_fp8 else P_SCALE["fp16"]),
        RETURN_LSE=return_lse, GRID_ROUND=grid_round,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return lse
