"""Preparing the attention kernel's inputs: smoothing centers, then one pass over K and V.

``centers_kernel`` — the per-(batch, head) channel means of Q, K and V over an evenly strided
sample of tokens (see hf_qattn.quant.smoothing_center), K's range per channel over all keys (for
the split channel, below) and, for per-channel V scales, V's: one launch for all of it.

``quantize_kv_kernel`` — one program per (key tile of BLOCK_N tokens, batch·kv-head). It reads
the tile of K and V once (any layout, by strides) and writes, into buffers padded to whole tiles
and a power-of-two head dim so the attention kernel's main loop needs no bounds checks:

    kq   int8  (B·Hk·NK_PAD, D_PAD)   K − k̄ over its scale, INT8 (±127) or INT4-range (±7)
    ks   fp32  (B·Hk, NK_PAD) per token, or (B·Hk, T) per tile     δK
    vq   fp8 / fp16  (B·Hk·D_PAD, NK_PAD)   V − v̄ over its scale, stored transposed: Hopper's
                                          FP8 tensor cores need P·V's B operand K-major
    vs   fp32  (B·Hk, T, D_PAD)         δV per (tile, channel); or, with V_CHANNEL_SCALE, (B·Hk, 2, D_PAD)
                                        V's range per channel over all keys (written by ``centers_kernel``,
                                        read here), from which δV = max |V − v̄| / 448; tile t is then
                                        quantized with δV·φ_t (formats.v_dither: its tile dither)
                                        and ΔS of its keys holds + log2 φ_t, so that P carries φ_t
    ds   fp32  (B·Hq [+ B·Hk], NK_PAD)  rows [0, B·Hq): ΔS·sm_scale·log2 e for each query head of the
                                        group, −inf for keys outside [kv_start, kv_end) and padding keys,
                                        from the K tile while it is in registers. With SPLIT, rows
                                        B·Hq + b·Hk: kc, the split channel of K − k̄ per key (below)
    split int32 (B·Hk,)                 with SPLIT: the kv head's split channel c*, or −1, from K's range
                                        over all keys (``centers_kernel`` finds it, as V's)

The split channel (SPLIT, an option; one per kv head): a channel whose range over all keys,
max |K − k̄|, is at least SPLIT_RATIO times the mean range of the head's channels. One such channel
— e.g. large values of both signs, which smoothing cannot remove — would set every block scale of K
and crush the other channels to a few levels. It is taken out of K̂ (zeroed before the scale) and kept in float as kc; the
attention kernels add (q_c* − q̄_c*)·kc·sm_scale·log2 e to each score: exact, rank one, like ΔS.

Padding rows and columns of kq / vq are written as zeros. With PERMUTE_V, V̂ᵀ's columns follow
the Hopper kernel's key order (``_v_token``). A K group holding NaN/±Inf gets a NaN scale, so
the rows that see it come out NaN, as with full-precision attention.
"""

import triton
import triton.language as tl

from .common import FP8_MAX, SCALE_FLOOR, quantize_symmetric, scale_to_fp8, v_dither

# A channel whose range over all keys reaches this many times the head's mean channel range is split out
# of K̂ (hf_qattn.quant.SPLIT_RATIO; the reference uses the same rule).
SPLIT_RATIO = tl.constexpr(8.0)


@triton.jit
def _sampled_mean(base, stride_n, stride_d, n, step, cols, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  ROWS: tl.constexpr):
    """Mean over rows 0, step, 2·step, … < n of the (n, HEAD_DIM) slice at ``base``."""
    count = tl.cdiv(n, step)
    total = tl.zeros([ROWS, D_PAD], tl.float32)
    for r0 in range(0, count, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        mask = (rows < count)[:, None] & (cols < HEAD_DIM)[None, :]
        total += tl.load(base + (rows * step)[:, None] * stride_n + cols[None, :] * stride_d,
                         mask=mask, other=0.0).to(tl.float32)
    return tl.sum(total, axis=0) / count


@triton.jit
def _range_block(X, RANGE, bh, block, HK, stride_b, stride_h, stride_n, stride_d, N, cols,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RANGE_ROWS: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """(max X, max −X) per channel over rows [block·RANGE_ROWS, +RANGE_ROWS) of one kv head, read CHUNK_ROWS rows
    a step, merged into RANGE[bh] (−inf-initialized) by one pair of atomics: every program of a head merges into
    the same 2·D_PAD floats, so fewer, longer programs contend less (max is exact in any order)."""
    base = X + (bh // HK).to(tl.int64) * stride_b + (bh % HK) * stride_h
    top = tl.full([D_PAD], float("-inf"), tl.float32)
    bottom = tl.full([D_PAD], float("-inf"), tl.float32)
    end = tl.minimum(block * RANGE_ROWS + RANGE_ROWS, N)
    for r0 in range(block * RANGE_ROWS, end, CHUNK_ROWS):
        rows = r0 + tl.arange(0, CHUNK_ROWS)
        inside = (rows < end)[:, None] & (cols < HEAD_DIM)[None, :]
        x = tl.load(base + rows[:, None] * stride_n + cols[None, :] * stride_d, mask=inside, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.max(tl.where(inside, x, float("-inf")), axis=0))
        bottom = tl.maximum(bottom, tl.max(tl.where(inside, -x, float("-inf")), axis=0))
    tl.atomic_max(RANGE + bh * 2 * D_PAD + cols, top, sem="relaxed")
    tl.atomic_max(RANGE + (bh * 2 + 1) * D_PAD + cols, bottom, sem="relaxed")


@triton.jit
def centers_kernel(
    Q, K, V, CENTERS, V_RANGE, K_RANGE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    HQ, HK, NUM_Q, NUM_KV, NQ, NK, STEP_Q, STEP_K, STEP_V, RANGE_BLOCKS,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, RANGE_ROWS: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
    SMOOTH_Q: tl.constexpr, SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr, WITH_V_RANGE: tl.constexpr,
    WITH_K_RANGE: tl.constexpr,
):
    """CENTERS rows: [q̄ of each b·Hq | k̄ of each b·Hk | v̄ of each b·Hk]; zeros where smoothing is off.
    With WITH_K_RANGE the same for K into K_RANGE, from which the K/V pass picks the split channel.
    With WITH_V_RANGE also V's range per channel over all keys: V_RANGE[b·Hk] = (max V, max −V)
    (−inf-initialized, one program per block of RANGE_ROWS keys). That needs no v̄, so one launch serves both:
    max |V − v̄| = max(max V − v̄, v̄ + max −V), exactly (float rounding is monotonic)."""
    pid = tl.program_id(0)  # [0, NUM_Q): q̄ · then k̄ · then v̄ · then (b·Hk, key block) of V's range, K's
    cols = tl.arange(0, D_PAD)
    col_ok = cols < HEAD_DIM
    mean = tl.zeros([D_PAD], tl.float32)
    if pid < NUM_Q:
        if SMOOTH_Q:
            mean = _sampled_mean(Q + (pid // HQ).to(tl.int64) * stride_qb + (pid % HQ) * stride_qh,
                                 stride_qn, stride_qd, NQ, STEP_Q, cols, HEAD_DIM, D_PAD, ROWS)
        tl.store(CENTERS + pid * HEAD_DIM + cols, mean, mask=col_ok)
    elif pid < NUM_Q + NUM_KV:
        bh = pid - NUM_Q
        if SMOOTH_K:
            mean = _sampled_mean(K + (bh // HK).to(tl.int64) * stride_kb + (bh % HK) * stride_kh,
                                 stride_kn, stride_kd, NK, STEP_K, cols, HEAD_DIM, D_PAD, ROWS)
        tl.store(CENTERS + pid * HEAD_DIM + cols, mean, mask=col_ok)
    elif pid < NUM_Q + 2 * NUM_KV:
        bh = pid - NUM_Q - NUM_KV
        if SMOOTH_V:
            mean = _sampled_mean(V + (bh // HK).to(tl.int64) * stride_vb + (bh % HK) * stride_vh,
                                 stride_vn, stride_vd, NK, STEP_V, cols, HEAD_DIM, D_PAD, ROWS)
        tl.store(CENTERS + pid * HEAD_DIM + cols, mean, mask=col_ok)
    else:  # range programs: V's key blocks (WITH_V_RANGE), then K's (WITH_K_RANGE)
        t = pid - NUM_Q - 2 * NUM_KV
        if WITH_V_RANGE:
            if t < NUM_KV * RANGE_BLOCKS:
                _range_block(V, V_RANGE, t // RANGE_BLOCKS, t % RANGE_BLOCKS, HK, stride_vb, stride_vh, stride_vn,
                             stride_vd, NK, cols, HEAD_DIM, D_PAD, RANGE_ROWS, CHUNK_ROWS)
            t -= NUM_KV * RANGE_BLOCKS
        if WITH_K_RANGE:
            if t >= 0:
                _range_block(K, K_RANGE, t // RANGE_BLOCKS, t % RANGE_BLOCKS, HK, stride_kb, stride_kh, stride_kn,
                             stride_kd, NK, cols, HEAD_DIM, D_PAD, RANGE_ROWS, CHUNK_ROWS)


@triton.jit
def v_channel_absmax(V_RANGE, bh, v_bar, cols, D_PAD: tl.constexpr):
    """max |V − v̄| per channel of kv head ``bh`` from its range (see centers_kernel); −inf on padding channels."""
    return tl.maximum(tl.load(V_RANGE + bh * 2 * D_PAD + cols) - v_bar,
                      v_bar + tl.load(V_RANGE + (bh * 2 + 1) * D_PAD + cols))


@triton.jit
def _split_channel(K_RANGE, K_BAR, bh, cols, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """The kv head's split channel (see the module docstring), or −1, from K's range over all keys:
    range_c = max |K_c − k̄_c| = max(max K_c − k̄_c, k̄_c + max −K_c)."""
    col_ok = cols < HEAD_DIM
    k_bar = tl.load(K_BAR + bh * HEAD_DIM + cols, mask=col_ok, other=0.0)
    spread = tl.maximum(tl.load(K_RANGE + bh * 2 * D_PAD + cols) - k_bar,
                        k_bar + tl.load(K_RANGE + (bh * 2 + 1) * D_PAD + cols))
    spread = tl.where(col_ok, spread, 0.0)
    top = tl.max(spread, axis=0)
    # not for a non-finite channel: NaN/±Inf stay in K̂, whose NaN scale makes the rows they reach NaN
    split = (top > 0.0) & (top < float("inf")) & (top >= SPLIT_RATIO * (tl.sum(spread, axis=0) / HEAD_DIM))
    return tl.where(split, tl.argmax(spread, axis=0), -1)


@triton.jit
def _nan_unless_finite(scale, total):
    """The scale, or NaN where the group it scales held NaN/±Inf (max drops NaN; the sum keeps it)."""
    return tl.where((total == total) & (tl.abs(total) < float("inf")), scale, float("nan"))


@triton.jit
def _v_token(columns, PERMUTE_V: tl.constexpr):
    """Token that column ``columns`` of V̂ᵀ holds. The Hopper kernel relabels keys inside each 32-key
    group (column bits c4 c3 c2 c1 c0 hold token bits c4 c1 c3 c2 c0) so that P needs no shuffles
    before P·V. The pass gathers V's rows in that order and stores V̂ᵀ contiguously (a scattered
    store of bytes ran at a seventh of the copy bandwidth)."""
    if PERMUTE_V:
        c = columns % 32
        columns = columns - c + ((c & 17) | (((c >> 1) & 1) << 3) | (((c >> 3) & 1) << 2) | (((c >> 2) & 1) << 1))
    return columns


@triton.jit
def _centered_k_tile(K, K_BAR, b, hk, bh, rows, cols, stride_kb, stride_kh, stride_kn, stride_kd, NK,
                     HEAD_DIM: tl.constexpr):
    """K − k̄ for the tile of keys ``rows`` (fp32; zeros outside the tensor)."""
    inside = (rows < NK)[:, None] & (cols < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + cols[None, :] * stride_kd,
                mask=inside, other=0.0).to(tl.float32)
    k_bar = tl.load(K_BAR + bh * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    return tl.where(inside, k - k_bar[None, :], 0.0)


@triton.jit
def _delta_scores_tile(k, rows, cols, b, hk, Q_BAR, KV_START, KV_END, DS, HK, GROUPS, NK, NK_PAD, score_coef,
                       dither_log2, HEAD_DIM: tl.constexpr, HAS_KV_RANGE: tl.constexpr):
    """ΔS = q̄·(K − k̄)ᵀ·score_coef for each query head reading this kv head, from the unquantized,
    centered K tile ``k``; −inf for keys outside the sequence's [kv_start, kv_end) and for padding,
    so they weigh nothing in softmax. Plus ``dither_log2`` (log2 φ of V̂'s tile dither, or 0): P then
    carries φ at no cost to the attention kernel's softmax."""
    visible = rows < NK
    if HAS_KV_RANGE:
        visible = visible & (rows >= tl.load(KV_START + b)) & (rows < tl.load(KV_END + b))
    for g in range(GROUPS):
        bhq = b * HK * GROUPS + hk * GROUPS + g
        q_bar = tl.load(Q_BAR + bhq * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
        ds = tl.sum(k * q_bar[None, :], axis=1) * score_coef + dither_log2
        tl.store(DS + bhq * NK_PAD + rows, tl.where(visible, ds, float("-inf")))


@triton.jit
def quantize_kv_kernel(
    K, V, K_BAR, V_BAR, Q_BAR, KV_START, KV_END,
    KQ, KS, VQ, VS, DS, K_RANGE, SPLIT_CHANNEL, KC,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    HK, GROUPS, NK, NK_PAD, NUM_TILES, score_coef,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_MAX: tl.constexpr, K_TOKEN_SCALE: tl.constexpr, V_FP8: tl.constexpr, V_CHANNEL_SCALE: tl.constexpr,
    V_DITHER: tl.constexpr, PERMUTE_V: tl.constexpr, HAS_KV_RANGE: tl.constexpr, GRID_ROUND: tl.constexpr,
    SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)  # b·Hk + hk
    score_coef = tl.cast(score_coef, tl.float32)  # torch.compile may hand Python floats over as fp64
    b = (bh // HK).to(tl.int64)
    hk = bh % HK
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)

    # --- K: subtract k̄, scale per token or per tile, round to the integer grid.
    k = _centered_k_tile(K, K_BAR, b, hk, bh, rows, cols, stride_kb, stride_kh, stride_kn, stride_kd, NK, HEAD_DIM)
    # ΔS from this tile while K is in registers (a pass of its own would read K again)
    # V_DITHER (with per-channel V scales): V̂'s tile dither φ (common.v_dither): δV·φ below, log2 φ into ΔS
    dither_log2 = 0.0
    if V_DITHER:
        dither_log2 = tl.log2(v_dither(tile))
    _delta_scores_tile(k, rows, cols, b, hk, Q_BAR, KV_START, KV_END, DS, HK, GROUPS, NK, NK_PAD, score_coef,
                       dither_log2, HEAD_DIM, HAS_KV_RANGE)
    if SPLIT:  # the split channel leaves K̂ (before the scale: it must not set it) and is kept in float as kc
        channel = _split_channel(K_RANGE, K_BAR, bh, cols, HEAD_DIM, D_PAD)
        if tile == 0:
            tl.store(SPLIT_CHANNEL + bh, channel)  # for the attention kernel (Q's part of the term)
        is_split = (cols == channel)[None, :]
        tl.store(KC + bh * NK_PAD + rows, tl.sum(tl.where(is_split, k, 0.0), axis=1))
        k = tl.where(is_split, 0.0, k)
    if K_TOKEN_SCALE:
        k_scale = tl.maximum(tl.max(tl.abs(k), axis=1), SCALE_FLOOR) / QK_MAX
        tl.store(KS + bh * NK_PAD + rows, _nan_unless_finite(k_scale, tl.sum(k, axis=1)))
        kq = quantize_symmetric(k, k_scale[:, None], QK_MAX, GRID_ROUND)
    else:
        k_scale = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), SCALE_FLOOR) / QK_MAX
        tl.store(KS + bh * NUM_TILES + tile, _nan_unless_finite(k_scale, tl.sum(tl.sum(k, axis=1), axis=0)))
        kq = quantize_symmetric(k, k_scale, QK_MAX, GRID_ROUND)
    tl.store(KQ + (bh.to(tl.int64) * NK_PAD + rows[:, None]) * D_PAD + cols[None, :], kq)

    tl.debug_barrier()  # K's tile is dead here: keep V's loads below it, or both tiles spill registers
    # --- V: subtract v̄, scale per channel over this tile, FP8 E4M3 (or FP16 where no FP8 MMA).
    v_rows = _v_token(rows, PERMUTE_V)  # a permutation inside each 32-row group: same tile, other order
    v_inside = (v_rows < NK)[:, None] & (cols < HEAD_DIM)[None, :]
    v = tl.load(V + b * stride_vb + hk * stride_vh + v_rows[:, None] * stride_vn + cols[None, :] * stride_vd,
                mask=v_inside, other=0.0).to(tl.float32)
    v_bar = tl.load(V_BAR + bh * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    v = tl.where(v_inside, v - v_bar[None, :], 0.0)
    if V_CHANNEL_SCALE:  # per channel over all keys, from V's range (centers_kernel wrote it into VS),
        v_scale = tl.maximum(v_channel_absmax(VS, bh, v_bar, cols, D_PAD), SCALE_FLOOR) / FP8_MAX
        if V_DITHER:  # times the tile's dither φ, which the attention kernel puts into P (common.v_dither)
            v_scale = v_scale * v_dither(tile)
        vq = scale_to_fp8(v, v_scale[None, :], GRID_ROUND)
    elif V_FP8:
        v_scale = tl.maximum(tl.max(tl.abs(v), axis=0), SCALE_FLOOR) / FP8_MAX
        vq = scale_to_fp8(v, v_scale[None, :], GRID_ROUND)
    else:
        v_scale = tl.full([D_PAD], 1.0, tl.float32)
        vq = v.to(tl.float16)
    # transposed so that the stores run along tokens (coalesced); the attention kernel reads V̂ᵀ tiles
    tl.store(VQ + (bh.to(tl.int64) * D_PAD + cols[:, None]) * NK_PAD + rows[None, :], tl.trans(vq))
    if not V_CHANNEL_SCALE:
        tl.store(VS + (bh * NUM_TILES + tile) * D_PAD + cols, v_scale)
