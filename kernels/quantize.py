"""One pass over K and V: smooth, quantize, write scales, and the score bias ΔS = q̄·(K − k̄)ᵀ.

One program per (key tile of BLOCK_N tokens, batch·kv-head). It reads the tile of K and V once
(any layout, by strides) and writes, into buffers padded to whole tiles and a power-of-two head
dim so the attention kernel's main loop needs no bounds checks:

    kq   int8  (B·Hk, NK_PAD, D_PAD)   K − k̄ over its scale, INT8 (±127) or INT4-range (±7)
    ks   fp32  (B·Hk, NK_PAD) per token, or (B·Hk, T) per tile     δK
    vq   fp8 / fp16  (B·Hk, D_PAD, NK_PAD)   V − v̄ over its scale, stored transposed: the FP8
                                          tensor cores need P·V's B operand K-major
    vs   fp32  (B·Hk, T, D_PAD)         δV per (tile, channel), already divided by P's scale 448
    ds   fp32  (B·Hq, NK_PAD)           ΔS·sm_scale·log2 e for each query head of the group

Padding rows and columns are written as zeros.
"""

import triton
import triton.language as tl

from .common import SCALE_FLOOR, quantize_symmetric, to_fp8_e4m3


@triton.jit
def quantize_kv_kernel(
    K, V, K_BAR, V_BAR, Q_BAR,
    KQ, KS, VQ, VS, DS,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    HK, GROUPS, NK, NK_PAD, NUM_TILES, score_coef,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_MAX: tl.constexpr, K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_SCALE: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)  # b·Hk + hk
    b = (bh // HK).to(tl.int64)
    hk = bh % HK
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)
    inside = (rows < NK)[:, None] & (cols < HEAD_DIM)[None, :]

    # --- K: subtract k̄, scale per token or per tile, round to the integer grid.
    k = tl.load(K + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + cols[None, :] * stride_kd,
                mask=inside, other=0.0).to(tl.float32)
    k_bar = tl.load(K_BAR + bh * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    k = tl.where(inside, k - k_bar[None, :], 0.0)
    if K_TOKEN_SCALE:
        k_scale = tl.maximum(tl.max(tl.abs(k), axis=1), SCALE_FLOOR) / QK_MAX
        tl.store(KS + bh * NK_PAD + rows, k_scale)
        kq = quantize_symmetric(k, k_scale[:, None], QK_MAX)
    else:
        k_scale = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), SCALE_FLOOR) / QK_MAX
        tl.store(KS + bh * NUM_TILES + tile, k_scale)
        kq = quantize_symmetric(k, k_scale, QK_MAX)
    tl.store(KQ + bh.to(tl.int64) * NK_PAD * D_PAD + rows[:, None] * D_PAD + cols[None, :], kq)

    # --- ΔS = q̄·(K − k̄)ᵀ for each query head reading this kv head, from the unquantized K.
    for g in range(GROUPS):
        bhq = b * HK * GROUPS + hk * GROUPS + g
        q_bar = tl.load(Q_BAR + bhq * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
        tl.store(DS + bhq * NK_PAD + rows, tl.sum(k * q_bar[None, :], axis=1) * score_coef)

    # --- V: subtract v̄, scale per channel over this tile, FP8 E4M3 (or FP16 where no FP8 MMA).
    v = tl.load(V + b * stride_vb + hk * stride_vh + rows[:, None] * stride_vn + cols[None, :] * stride_vd,
                mask=inside, other=0.0).to(tl.float32)
    v_bar = tl.load(V_BAR + bh * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    v = tl.where(inside, v - v_bar[None, :], 0.0)
    vq_ptrs = VQ + bh.to(tl.int64) * D_PAD * NK_PAD + cols[None, :] * NK_PAD + rows[:, None]
    if V_FP8:
        v_scale = tl.maximum(tl.max(tl.abs(v), axis=0), SCALE_FLOOR) / 448.0
        tl.store(vq_ptrs, to_fp8_e4m3(tl.math.div_rn(v, v_scale[None, :]), GRID_ROUND))
        tl.store(VS + (bh * NUM_TILES + tile) * D_PAD + cols, v_scale / P_SCALE)
    else:
        tl.store(vq_ptrs, v.to(tl.float16))
        tl.store(VS + (bh * NUM_TILES + tile) * D_PAD + cols, tl.full([D_PAD], 1.0, tl.float32))
