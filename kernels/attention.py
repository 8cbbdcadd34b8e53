"""The attention kernel: INT8/INT4-range Q·Kᵀ, online softmax in FP32, FP8 P·V.

One program per (tile of BLOCK_M query rows, batch·query-head); the query tile's K/V head is
head // GROUPS (GQA/MQA without copying K/V). Q arrives in the model's dtype and is smoothed
and quantized here, once per program, into per-row-group scales (Q_GROUP rows share one; 16 is
one warp's rows on Hopper). K̂, V̂ (read through TMA descriptors), their scales and ΔS come
from ``quantize_kv_kernel``.

Per key tile (``_key_tiles``):
    S  = (Q̂·K̂ᵀ) · (δQ·sm_scale·log2 e) · δK + ΔS         int32 MMA, then FP32
         + qc·kc                                          with SPLIT: K's split channel (rank one, FP32)
    m' = max(m, rowmax S),  α = 2^(m − m')
    P  = 2^(S − m' + log2 448) = P̃·448 ∈ [0, 448]          the static FP8 scale folded into exp2
    l  = α·l + ΣP
    O  = α·O + FP8(P) · V̂ · δV                          each tile's product in a fresh accumulator
                                                        ("two-level accumulation"), added in FP32
Epilogue: O / l + v̄ (the 448 cancels) in the output dtype; optionally
lse = (m + log2(l / 448))·ln 2 + sm_scale·q·k̄ (K was smoothed: the q·k̄ term is added back).

Masking: keys of a sequence outside [kv_start, kv_end), and, when causal, keys right of the
query's diagonal (aligned bottom-right). Tiles wholly outside are skipped, not masked; only the
few tiles that straddle a boundary run the masked variant of the loop.
"""

import triton
import triton.language as tl

from .common import LOG2E, SCALE_FLOOR, int32_to_float, quantize_symmetric, to_fp8_e4m3


@triton.jit
def _key_tiles(
    acc, l_i, m_i, q_int, q_coef, q_split, offs_m,
    kq_desc, vq_desc, KS_bh, VS_bh, DS_bhq, KC_bhk, kq_row0, vq_row0,
    lo, hi, kv_lo, kv_hi, diag_offset,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, GRID_ROUND: tl.constexpr,
    SPLIT: tl.constexpr,
):
    offs_d = tl.arange(0, D_PAD)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        tile = start // BLOCK_N
        # -- scores: integer MMA, dequantized by the scales' outer product, plus ΔS
        k = kq_desc.load([kq_row0 + start, 0])
        qk = int32_to_float(tl.dot(q_int, k.T))
        if K_TOKEN_SCALE:
            s = qk * (q_coef[:, None] * tl.load(KS_bh + offs_n)[None, :])
        else:
            s = qk * (q_coef * tl.load(KS_bh + tile))[:, None]
        bias = tl.load(DS_bhq + offs_n)[None, :]
        if SPLIT:  # the rank-one term of K's split channel
            bias += q_split[:, None] * tl.load(KC_bhk + offs_n)[None, :]
        s += bias
        if MASKED:
            visible = ((offs_n >= kv_lo) & (offs_n < kv_hi))[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_offset)
            s = tl.where(visible, s, float("-inf"))
        # -- online softmax in base 2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.math.exp2(s - (m_use - P_LOG2)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # -- P·V in a fresh accumulator, then scaled and added to the FP32 output
        v = vq_desc.load([vq_row0, start]).T
        if V_FP8:
            pv = tl.dot(to_fp8_e4m3(p, GRID_ROUND), v)
        else:
            pv = tl.dot(p.to(tl.float16), v)
        acc = acc * alpha[:, None] + pv * tl.load(VS_bh + tile * D_PAD + offs_d)[None, :]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _all_key_tiles(q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh, DS_bhq, KC_bhk, kq_row0, vq_row0,
                   first, clean_lo, clean_hi, hi, kv_lo, kv_hi, diag_offset,
                   BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, GRID_ROUND: tl.constexpr,
                   SPLIT: tl.constexpr):
    """The left edge (a tile cut by kv_start), the clean middle and the right edge (cut by kv_end or the
    diagonal) of a query tile's keys: (O unnormalized, l, m)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, first, tl.minimum(clean_lo, hi), kv_lo, kv_hi,
                               diag_offset, D_PAD, BLOCK_N, True, CAUSAL, K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND,
                               SPLIT)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, clean_lo, clean_hi, kv_lo, kv_hi,
                               diag_offset, D_PAD, BLOCK_N, False, CAUSAL, K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND,
                               SPLIT)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, tl.maximum(clean_hi, clean_lo), hi, kv_lo, kv_hi,
                               diag_offset, D_PAD, BLOCK_N, True, CAUSAL, K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND,
                               SPLIT)
    return acc, l_i, m_i


@triton.jit
def attention_kernel(
    Q, kq_desc, KS, vq_desc, VS, DS, KC, SPLIT_CHANNEL, Q_BAR, K_BAR, V_BAR, KV_START, KV_END, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_ob, stride_oh, stride_on, stride_od,
    HQ, GROUPS, NQ, NK, NK_PAD, NUM_TILES, score_coef,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_GROUP: tl.constexpr, QK_MAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, RETURN_LSE: tl.constexpr,
    GRID_ROUND: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bhq = tl.program_id(1)  # b·Hq + h
    b = (bhq // HQ).to(tl.int64)
    h = bhq % HQ
    bhk = b * (HQ // GROUPS) + h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < NQ
    col_ok = offs_d < HEAD_DIM

    # --- Q: load once, smooth, quantize per group of Q_GROUP rows; fold sm_scale·log2 e into δQ
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    q_bar = tl.load(Q_BAR + bhq * HEAD_DIM + offs_d, mask=col_ok, other=0.0)
    qs = tl.where(row_ok[:, None] & col_ok[None, :], q - q_bar[None, :], 0.0)
    row_max = tl.max(tl.abs(qs), axis=1)
    if Q_GROUP > 1:
        group_max = tl.max(tl.reshape(row_max, (BLOCK_M // Q_GROUP, Q_GROUP)), axis=1)
        row_max = tl.reshape(tl.broadcast_to(group_max[:, None], (BLOCK_M // Q_GROUP, Q_GROUP)), (BLOCK_M,))
    q_scale = tl.maximum(row_max, SCALE_FLOOR) / QK_MAX
    q_int = quantize_symmetric(qs, q_scale[:, None], QK_MAX, GRID_ROUND)
    score_coef = tl.cast(score_coef, tl.float32)  # torch.compile may hand Python floats over as fp64
    # max drops NaN: a row holding NaN/±Inf gets a NaN coefficient (its sum keeps them), so
    # its output is NaN, as full-precision attention's, never a plausible value
    row_sum = tl.sum(qs, axis=1)
    q_coef = tl.where((row_sum == row_sum) & (tl.abs(row_sum) < float("inf")), q_scale * score_coef, float("nan"))
    q_split = q_coef  # Q's part of the split channel's rank-one score term (zero when the kv head has none)
    if SPLIT:
        q_split = tl.sum(tl.where((offs_d == tl.load(SPLIT_CHANNEL + bhk))[None, :], qs, 0.0), axis=1) * score_coef

    # --- which key tiles to visit: [kv_lo, kv_hi) ∩ causal, split into masked edges and a clean middle
    kv_lo = 0
    kv_hi = NK
    if HAS_KV_RANGE:
        kv_lo = tl.load(KV_START + b)
        kv_hi = tl.load(KV_END + b)
    diag_offset = NK - NQ
    hi = kv_hi
    clean_hi = kv_hi // BLOCK_N * BLOCK_N
    if CAUSAL:
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        hi = tl.minimum(hi, last_row + diag_offset + 1)  # keys right of this are masked for every row
        clean_hi = tl.minimum(clean_hi, (pid_m * BLOCK_M + diag_offset + 1) // BLOCK_N * BLOCK_N)
    first = kv_lo // BLOCK_N * BLOCK_N
    clean_lo = tl.cdiv(kv_lo, BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, first)
    clean_hi = tl.maximum(clean_hi, clean_lo)

    kq_row0 = (bhk * NK_PAD).to(tl.int32)
    vq_row0 = (bhk * D_PAD).to(tl.int32)
    VS_bh = VS + bhk * NUM_TILES * D_PAD
    DS_bhq = DS + bhq.to(tl.int64) * NK_PAD
    KC_bhk = KC + bhk * NK_PAD
    if K_TOKEN_SCALE:
        KS_bh = KS + bhk * NK_PAD
    else:
        KS_bh = KS + bhk * NUM_TILES

    acc, l_i, m_i = _all_key_tiles(q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh, DS_bhq, KC_bhk,
                                   kq_row0, vq_row0, first, clean_lo, clean_hi, hi, kv_lo, kv_hi, diag_offset,
                                   BLOCK_M, D_PAD, BLOCK_N, CAUSAL, K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND, SPLIT)

    # --- epilogue: normalize, add v̄ back; rows that saw no key are zero. l is 0 exactly for those;
    # NaN (NaN/±Inf inputs) is != 0, so it stays NaN instead of passing for a row without keys
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    v_bar = tl.load(V_BAR + bhk * HEAD_DIM + offs_d, mask=col_ok, other=0.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None] + v_bar[None, :], 0.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if RETURN_LSE:
        k_bar = tl.load(K_BAR + bhk * HEAD_DIM + offs_d, mask=col_ok, other=0.0)
        shift = tl.sum(q * k_bar[None, :], axis=1) * (score_coef / LOG2E)
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe) - P_LOG2) / LOG2E + shift, float("-inf"))
        tl.store(LSE + bhq.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)
