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
query's diagonal (aligned bottom-right); with WINDOW (W) also keys j ≤ p − W, with CHUNK (C) keys
before the query's chunk, j < p // C·C (p = the row's key position). Each row's keys are then one
interval [row_lo, p] ∩ [kv_start, kv_end), whose ends grow with the row: a query tile visits the
key tiles between its first row's left end and its last row's diagonal. Tiles wholly outside are
skipped, not masked; only the few tiles that straddle a boundary run the masked variant of the loop.

Variants on the scores and the softmax (the reference's module docstring has the same in torch):
    SOFTCAP   S ← c′·tanh((S + t) / c′), c′ = c·log2 e, t = sm_scale·log2 e·q·k̄: the cap acts on the
              true score, so the row term K's smoothing left out is added back first (and not to lse
              after); tanh(x) = 1 − 2 / (e^{2x} + 1) on exp2. Before the max and the mask.
    SINKS     after the last tile, one more logit per head without a value, in the kernel's units
              σ′ = σ·log2 e − t:  m′ = max(m, σ′), l′ = 2^(m − m′)·l + 2^(σ′ − m′ + log2 448);
              the keys' weights sum to 2^(m − m′)·l / l′, which is what v̄ gets; lse is log l′.
"""

import triton
import triton.language as tl

from .common import LOG2E, SCALE_FLOOR, int32_to_float, quantize_symmetric, to_fp8_e4m3


@triton.jit
def _key_tiles(
    acc, l_i, m_i, q_int, q_coef, q_split, offs_m,
    kq_desc, vq_desc, KS_bh, VS_bh, DS_bhq, KC_bhk, kq_row0, vq_row0,
    lo, hi, kv_lo, kv_hi, diag_offset, row_lo, row_term, cap_scale, cap_exp,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, GRID_ROUND: tl.constexpr,
    SPLIT: tl.constexpr, ROW_LO: tl.constexpr, SOFTCAP: tl.constexpr,
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
        if SOFTCAP:  # c′·tanh((S + t) / c′) = c′·(1 − 2 / (2^{2(S + t)/c} + 1)); ±inf → ±c′: mask after
            s = cap_scale * (1.0 - 2.0 / (tl.math.exp2((s + row_term[:, None]) * cap_exp) + 1.0))
        if MASKED:
            visible = ((offs_n >= kv_lo) & (offs_n < kv_hi))[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_offset)
            if ROW_LO:  # the window's / chunk's left end, per row
                visible = visible & (offs_n[None, :] >= row_lo[:, None])
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
                   first, clean_lo, clean_hi, hi, kv_lo, kv_hi, diag_offset, row_lo, row_term, cap_scale, cap_exp,
                   BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, GRID_ROUND: tl.constexpr,
                   SPLIT: tl.constexpr, ROW_LO: tl.constexpr, SOFTCAP: tl.constexpr):
    """The left edge (tiles cut by kv_start, the window or the chunk), the clean middle and the right edge
    (cut by kv_end or the diagonal) of a query tile's keys: (O unnormalized, l, m)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, first, tl.minimum(clean_lo, hi), kv_lo, kv_hi,
                               diag_offset, row_lo, row_term, cap_scale, cap_exp, D_PAD, BLOCK_N, True, CAUSAL,
                               K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND, SPLIT, ROW_LO, SOFTCAP)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, clean_lo, clean_hi, kv_lo, kv_hi,
                               diag_offset, row_lo, row_term, cap_scale, cap_exp, D_PAD, BLOCK_N, False, CAUSAL,
                               K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND, SPLIT, ROW_LO, SOFTCAP)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_int, q_coef, q_split, offs_m, kq_desc, vq_desc, KS_bh, VS_bh,
                               DS_bhq, KC_bhk, kq_row0, vq_row0, tl.maximum(clean_hi, clean_lo), hi, kv_lo, kv_hi,
                               diag_offset, row_lo, row_term, cap_scale, cap_exp, D_PAD, BLOCK_N, True, CAUSAL,
                               K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND, SPLIT, ROW_LO, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def attention_kernel(
    Q, kq_desc, KS, vq_desc, VS, DS, KC, SPLIT_CHANNEL, Q_BAR, K_BAR, V_BAR, KV_START, KV_END, SINKS, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_ob, stride_oh, stride_on, stride_od,
    HQ, GROUPS, NQ, NK, NK_PAD, NUM_TILES, score_coef, WINDOW, CHUNK, cap_scale, cap_exp,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_GROUP: tl.constexpr, QK_MAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, P_LOG2: tl.constexpr, RETURN_LSE: tl.constexpr,
    GRID_ROUND: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    SINKS_ON: tl.constexpr, SOFTCAP: tl.constexpr, ROW_LO: tl.constexpr, ROW_TERM: tl.constexpr,
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
    # the row term K's smoothing leaves out of the scores, base 2 (true score = kernel score + t): the soft
    # cap needs the true score, a sink is compared with the kernel's, lse adds it back
    row_term = q_coef  # a placeholder of the right shape where no stage reads it
    if ROW_TERM:  # SOFTCAP, SINKS_ON or RETURN_LSE
        k_bar = tl.load(K_BAR + bhk * HEAD_DIM + offs_d, mask=col_ok, other=0.0)
        row_term = tl.sum(q * k_bar[None, :], axis=1) * score_coef

    # --- which key tiles to visit: [kv_lo, kv_hi) ∩ causal ∩ window ∩ chunk, split into masked edges and a
    # clean middle. A row's keys start at row_lo (kv_lo, the window's or the chunk's start: the largest),
    # which grows with the row: the tile's first row bounds the tiles to visit, its last row the clean ones.
    kv_lo = 0
    kv_hi = NK
    if HAS_KV_RANGE:
        kv_lo = tl.load(KV_START + b)
        kv_hi = tl.load(KV_END + b)
    diag_offset = NK - NQ
    hi = kv_hi
    clean_hi = kv_hi // BLOCK_N * BLOCK_N
    lo_first = kv_lo  # the first row's left end (keys left of it are masked for every row)
    lo_last = kv_lo  # the last row's (keys from it on are seen by every row, up to the diagonal)
    row_lo = offs_m  # per-row left ends, with a window or chunk only (a placeholder otherwise)
    if CAUSAL:
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        hi = tl.minimum(hi, last_row + diag_offset + 1)  # keys right of this are masked for every row
        clean_hi = tl.minimum(clean_hi, (pid_m * BLOCK_M + diag_offset + 1) // BLOCK_N * BLOCK_N)
        if ROW_LO:  # HAS_WINDOW or HAS_CHUNK
            # key positions, clamped at 0: rows left of key 0 see nothing (causal), and floor division stays
            # on non-negative numbers
            row_p = tl.maximum(offs_m + diag_offset, 0)
            first_p = tl.maximum(pid_m * BLOCK_M + diag_offset, 0)
            last_p = tl.maximum(last_row + diag_offset, 0)
            row_lo = tl.zeros([BLOCK_M], tl.int32) + kv_lo
            if HAS_WINDOW:  # keys j > p − W
                row_lo = tl.maximum(row_lo, row_p - WINDOW + 1)
                lo_first = tl.maximum(lo_first, first_p - WINDOW + 1)
                lo_last = tl.maximum(lo_last, last_p - WINDOW + 1)
            if HAS_CHUNK:  # keys of the query's chunk: j ≥ p // C·C (j ≤ p is the causal rule)
                row_lo = tl.maximum(row_lo, row_p // CHUNK * CHUNK)
                lo_first = tl.maximum(lo_first, first_p // CHUNK * CHUNK)
                lo_last = tl.maximum(lo_last, last_p // CHUNK * CHUNK)
    first = lo_first // BLOCK_N * BLOCK_N
    clean_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, first)
    clean_hi = tl.maximum(clean_hi, clean_lo)
    cap_scale = tl.cast(cap_scale, tl.float32)
    cap_exp = tl.cast(cap_exp, tl.float32)

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
                                   row_lo, row_term, cap_scale, cap_exp, BLOCK_M, D_PAD, BLOCK_N, CAUSAL,
                                   K_TOKEN_SCALE, V_FP8, P_LOG2, GRID_ROUND, SPLIT, ROW_LO, SOFTCAP)

    # --- sinks: one more logit per head, without a value, in the kernel's units (the capped scores are the
    # true ones: no row term there), joining m and l as a key would; the keys' weights now sum to l_keys / l
    shift = row_term
    if SOFTCAP:
        shift = tl.zeros([BLOCK_M], tl.float32)
    l_keys = l_i
    if SINKS_ON:
        sink = tl.load(SINKS + h).to(tl.float32) * LOG2E - shift  # in the model's dtype (gpt-oss: bf16)
        m_new = tl.maximum(m_i, sink)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key and a −inf sink: nothing at all
        alpha = tl.math.exp2(m_i - m_use)
        acc = acc * alpha[:, None]
        l_keys = l_i * alpha
        l_i = l_keys + tl.math.exp2(sink - m_use + P_LOG2)
        m_i = m_new

    # --- epilogue: normalize, add v̄ back (weighted as the keys are: 1 without sinks); rows that saw no key
    # (nor sink) are zero. l is 0 exactly for those; NaN (NaN/±Inf inputs) is != 0, so it stays NaN instead
    # of passing for a row without keys
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    v_bar = tl.load(V_BAR + bhk * HEAD_DIM + offs_d, mask=col_ok, other=0.0)[None, :]
    if SINKS_ON:
        v_bar = v_bar * (l_keys / l_safe)[:, None]
    out = tl.where(seen[:, None], acc / l_safe[:, None] + v_bar, 0.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe) - P_LOG2 + shift) / LOG2E, float("-inf"))
        tl.store(LSE + bhq.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)
