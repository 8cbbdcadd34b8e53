"""Kernels of the quantized KV cache: appending new tokens, and flash-decoding against the cache.

Storage of one cache layer (B batch, Hk key/value heads, CAP token slots, D head dim):

    kq   int8 (B, Hk, CAP, D)        INT8 (K − k̄) / σ_K over its per-token scale (±127), or
         int8 (B, Hk, CAP, D_PAD/2)  INT4 u ∈ [0, 15] packed two a byte: channel c in the low nibble,
                                     channel c + D_PAD/2 in the high nibble, or
         uint8 (B, Hk, CAP, D)       G8 (int8g) u ∈ [0, 255]
    ks   fp32 (B, Hk, CAP)           INT8: δK per token (the token's largest |K − k̄| / σ_K over 127), or
         bf16 (B, Hk, CAP/G, 2, D)   INT4, G8: per (group of G = KV_GROUP slots, channel) scale and zero,
                                     K − k̄ ≈ zero + u · scale
    kr   (B, Hk, G, D)               INT4, G8: K − k̄ of the incomplete group's tokens, in the model's dtype
    vq   uint8 (B, Hk, CAP/T, D, T)  (V − v̄) / σ_V over δV, as INT8 K, plus 128 (offset binary), channel-major in
                                     tiles of T = V_TILE slots (formats.KV_V_TILE), or
         uint8 (B, Hk, CAP, D)       G8: u as K's
    vs   fp32 (B, Hk, CAP)           δV per token, or G8: as K's
    vr   (B, Hk, G, D)               G8: V − v̄ of the incomplete group's tokens
    k̄, v̄ fp32 (B·Hk, D)              centers, fixed when the layer is first filled
    σ_K, σ_V bf16 (B·Hk, D)          per-token formats: the channels' equalizers (formats.KV_EQ_FLOOR), fixed then too

(``hf_qattn.kv_cache.reference`` is the same math in PyTorch; its ``Buffers`` holds these tensors.)

``append_kernel`` quantizes new tokens (any layout, by strides) into slots [pos0, pos0 + N). Each
token's per-token K and V are quantized once, there; grouped ones a group at a time, when the group's
last token arrives (until then the group's tokens wait in ``kr`` / ``vr``).

``decode_kernel`` — one program per (query chunk, batch·kv-head, split of the cached tokens).
The tile's rows are all query heads of one KV group times QT query tokens (GQA packing: the
group's K and V are read once for all its heads). Per key tile of BLOCK_N tokens:

    S = (q̂ · K̂ᵀ) · δK · max|q ⊙ σ_K| · …      INT8: q̂ = q ⊙ σ_K over its row's max, as two INT8 parts (two INT8
                                               dots with K̂ as stored, exact in int32)
    S = ((q ⊙ scale) · uᵀ + q · zero) · …     INT4: one group a tile, its scales folded into q (bf16)
    S = ((q̂ ⊙ scale) · (u − φ)ᵀ + q̂ · zero) · max|q|   G8: the same at 8 bits, q̂ = q / max|q| per row and q̂ ⊙ scale
                                               in fp16, one dot; φ the group's row dither (formats.KV_GROUP_DITHERED)
    S = q · kr                                 the incomplete group's tile
    online softmax in base 2 (k̄ adds q·k̄ to a whole row: the softmax ignores it)
    (tiles of few query rows, KEYS_AS_ROWS: the dots take the keys as their rows, Sᵀ = K̂ · q̂ᵀ and
    Oᵀ += V̂ᵀ · Pᵀ, so that an mma pads the query rows to 8, not 16)
    O += (P · δV · 127) · V̂                   per-token V: in fp16, V̂ exact; O ⊙ σ_V / 127 at the end
    O += (P · (u − φ)) ⊙ scale + ΣP · zero     G8: P in fp16 (ΣP of it, the denominator's too), u exact;
                                               (P · vr) on the incomplete group

Masking: keys outside [kv_start, kv_end) of the sequence, and with ``CAUSAL`` keys right of the
query's diagonal aligned bottom-right (query i of NQ sits at key position NK − NQ + i); ``WINDOW`` keys
at or before p − window, ``CHUNK`` keys outside p's chunk (whole tiles before the first visible key are
skipped); ``RING``: kv_start / kv_end are a cyclic slot range (first slot, count) of a ring buffer (a
sliding-window or chunked cache layer with left padding). Variants (constexpr switches, nothing when off): ``SOFTCAP`` caps the true score, so the row's
dropped sm_scale·q·k̄ (from k̄, ``K_BAR``) is added back before c·tanh(s / c); ``HAS_SINKS`` adds one logit
per query head to the final denominator (compared with the smoothed scores: minus that same term unless
capped), and V's center then comes back weighted by l / l′. With one
split the program normalizes and writes O + v̄; with several (``SPLIT``) it writes (acc, m, l), and
the last split program of each (query chunk, batch·kv-head) to finish merges the splits by their
log-sum-exp (an atomic arrival counter per tile, reset by that program): one launch per step.

Whole tiles of BLOCK_N tokens are read without a bound mask (16-byte loads of K and V when the head
dim needs no padding); only the last tile of a split is masked.
"""

import triton
import triton.language as tl

from .common import (G8_DIRECTED, G8_DITHERED, G8_LEVELS, INT4_DIRECTED, INT4_DITHERED, INT4_LEVELS, KV_GROUP,
                     SCALE_FLOOR, V_OFFSET, V_TILE, group_dither, mul_rn, quantize_symmetric, reciprocal,
                     round_half_even, to_bf16, to_bf16_toward)


@triton.jit
def _nan_unless_finite(scale, x, AXIS: tl.constexpr):
    """``scale`` where x holds only finite values along AXIS, else NaN: a NaN or ±Inf in K or V then reaches
    attention as NaN (the GPU's max ignores NaN, which would quietly quantize it away)."""
    return tl.where(tl.max(tl.where(x - x == 0.0, 0, 1), axis=AXIS) > 0, float("nan"), scale)


@triton.jit
def _quantize_group(x, LEVELS: tl.constexpr, DIRECTED: tl.constexpr, DITHERED: tl.constexpr,
                    GRID_ROUND: tl.constexpr):
    """A complete group x (G rows, channels) in fp32 → per channel a bf16 scale and zero point and
    u = round((x − zero) / scale [+ φ_row]) ∈ [0, LEVELS] (int32), as ``reference.quantize_groups``: zero the min,
    scale (max − zero) / LEVELS (DITHERED: / (LEVELS − 1), and the row's dither φ added before rounding), rounded
    to nearest or (DIRECTED) zero down and scale up (formats.KV_GROUP_DIRECTED, KV_GROUP_DITHERED)."""
    if DITHERED:
        SPAN: tl.constexpr = LEVELS - 1
    else:
        SPAN: tl.constexpr = LEVELS
    low = tl.min(x, axis=0)
    if DIRECTED:
        zero = to_bf16_toward(low, False, GRID_ROUND)
        exact = tl.math.div_rn(tl.maximum(tl.max(x, axis=0) - zero.to(tl.float32), SCALE_FLOOR),
                               tl.full(low.shape, SPAN, tl.float32))
        scale = to_bf16_toward(_nan_unless_finite(exact, x, 0), True, GRID_ROUND)
    else:
        zero = to_bf16(low, GRID_ROUND)
        exact = tl.math.div_rn(tl.maximum(tl.max(x, axis=0) - low, SCALE_FLOOR), tl.full(low.shape, SPAN, tl.float32))
        scale = to_bf16(_nan_unless_finite(exact, x, 0), GRID_ROUND)
    t = mul_rn(x - zero.to(tl.float32)[None, :], reciprocal(scale.to(tl.float32))[None, :], GRID_ROUND)
    if DITHERED:
        t = t + group_dither(tl.arange(0, KV_GROUP))[:, None]
    u = round_half_even(t)
    return tl.minimum(tl.maximum(u, 0.0), LEVELS).to(tl.int32), scale, zero


@triton.jit
def _append_k_group(K_rows, K_BAR, KQ_rows, KG_group, KR, bh, rows, new_ok, complete, stride_kd,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GRID_ROUND: tl.constexpr):
    """One INT4 group of G slots: rows of new tokens (``new_ok``) from K, rows before them (slots < pos0 of the
    group being filled) from ``KR``; channels in two halves, as packed (c in the low nibble, c + D_PAD/2 in the
    high one). A complete group is quantized (:func:`_quantize_group`); an incomplete one keeps its new rows
    in ``KR``."""
    HALF: tl.constexpr = D_PAD // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, KV_GROUP)
    lo_ok = (c < HEAD_DIM)[None, :]
    hi_ok = ((c + HALF) < HEAD_DIM)[None, :]
    old_ok = (rows < 0)[:, None]  # the group's earlier tokens, waiting in KR
    kb_lo = tl.load(K_BAR + bh * HEAD_DIM + c, mask=c < HEAD_DIM, other=0.0)[None, :]
    kb_hi = tl.load(K_BAR + bh * HEAD_DIM + c + HALF, mask=(c + HALF) < HEAD_DIM, other=0.0)[None, :]
    x_lo = tl.load(K_rows + c[None, :] * stride_kd, mask=new_ok[:, None] & lo_ok, other=0.0).to(tl.float32) - kb_lo
    x_hi = (tl.load(K_rows + (c + HALF)[None, :] * stride_kd, mask=new_ok[:, None] & hi_ok, other=0.0)
            .to(tl.float32) - kb_hi)
    r_lo = tl.load(KR + r[:, None] * HEAD_DIM + c[None, :], mask=old_ok & lo_ok, other=0.0).to(tl.float32)
    r_hi = tl.load(KR + r[:, None] * HEAD_DIM + (c + HALF)[None, :], mask=old_ok & hi_ok, other=0.0).to(tl.float32)
    x_lo = tl.where(new_ok[:, None], x_lo, r_lo)
    x_hi = tl.where(new_ok[:, None], x_hi, r_hi)
    if complete:
        u_lo, scale_lo, zero_lo = _quantize_group(x_lo, INT4_LEVELS, INT4_DIRECTED, INT4_DITHERED, GRID_ROUND)
        u_hi, scale_hi, zero_hi = _quantize_group(x_hi, INT4_LEVELS, INT4_DIRECTED, INT4_DITHERED, GRID_ROUND)
        tl.store(KQ_rows + c[None, :], (u_lo | (u_hi << 4)).to(tl.int8))
        tl.store(KG_group + c, scale_lo, mask=c < HEAD_DIM)
        tl.store(KG_group + HEAD_DIM + c, zero_lo, mask=c < HEAD_DIM)
        tl.store(KG_group + c + HALF, scale_hi, mask=(c + HALF) < HEAD_DIM)
        tl.store(KG_group + HEAD_DIM + c + HALF, zero_hi, mask=(c + HALF) < HEAD_DIM)
    else:
        tl.store(KR + r[:, None] * HEAD_DIM + c[None, :], x_lo.to(KR.dtype.element_ty), mask=new_ok[:, None] & lo_ok)
        tl.store(KR + r[:, None] * HEAD_DIM + (c + HALF)[None, :], x_hi.to(KR.dtype.element_ty),
                 mask=new_ok[:, None] & hi_ok)


@triton.jit
def _append_group8(X_rows, BAR, Q_rows, G_group, R, bh, rows, new_ok, complete, stride_xd,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GRID_ROUND: tl.constexpr):
    """One 8-bit group of G slots (int8g's K or V): as :func:`_append_k_group`, whole channels, u one a byte."""
    c = tl.arange(0, D_PAD)
    r = tl.arange(0, KV_GROUP)
    c_ok = (c < HEAD_DIM)[None, :]
    bar = tl.load(BAR + bh * HEAD_DIM + c, mask=c < HEAD_DIM, other=0.0)[None, :]
    x = tl.load(X_rows + c[None, :] * stride_xd, mask=new_ok[:, None] & c_ok, other=0.0).to(tl.float32) - bar
    old = tl.load(R + r[:, None] * HEAD_DIM + c[None, :], mask=(rows < 0)[:, None] & c_ok, other=0.0)
    x = tl.where(new_ok[:, None], x, old.to(tl.float32))
    if complete:
        u, scale, zero = _quantize_group(x, G8_LEVELS, G8_DIRECTED, G8_DITHERED, GRID_ROUND)
        tl.store(Q_rows + c[None, :], u.to(tl.uint8), mask=c_ok)
        tl.store(G_group + c, scale, mask=c < HEAD_DIM)
        tl.store(G_group + HEAD_DIM + c, zero, mask=c < HEAD_DIM)
    else:
        tl.store(R + r[:, None] * HEAD_DIM + c[None, :], x.to(R.dtype.element_ty), mask=new_ok[:, None] & c_ok)


@triton.jit
def _append_tokens(X_rows, BAR, EQ, Q_rows, S_rows, bh, c, row_ok, stride_xd, HEAD_DIM: tl.constexpr,
                   GRID_ROUND: tl.constexpr, OFFSET: tl.constexpr, STRIDE_QC: tl.constexpr):
    """Per-token INT8 (K or V) of rows of new tokens: x − x̄ over the channels' equalizers σ, then over the token's
    scale (its largest |value| / 127), as ``reference.quantize_tokens``; stored plus OFFSET (V: 128, offset binary
    in a uint8, ``reference.V_OFFSET``), channel c at ``Q_rows`` + c · STRIDE_QC (V: a column of its tile)."""
    ok = row_ok[:, None] & (c < HEAD_DIM)[None, :]
    x = tl.load(X_rows + c[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
    bar = tl.load(BAR + bh * HEAD_DIM + c, mask=c < HEAD_DIM, other=0.0)
    inv_eq = reciprocal(tl.load(EQ + bh * HEAD_DIM + c, mask=c < HEAD_DIM, other=1.0).to(tl.float32))
    x = tl.where(ok, (x - bar[None, :]) * inv_eq[None, :], 0.0)
    scale = _nan_unless_finite(tl.maximum(tl.max(tl.abs(x), axis=1), SCALE_FLOOR) / 127.0, x, 1)
    values = quantize_symmetric(x, scale[:, None], 127.0, GRID_ROUND)
    if OFFSET != 0:
        values = (values.to(tl.int32) + OFFSET).to(Q_rows.dtype.element_ty)
    tl.store(Q_rows + c[None, :] * STRIDE_QC, values, mask=ok)
    tl.store(S_rows, scale, mask=row_ok)


# Ints that change from one generated token to the next are not specialized on (Triton would compile
# a variant the first time one is 1 or divisible by 16: in the middle of a generation)
@triton.jit(do_not_specialize=["pos0"])
def append_kernel(
    K, V, K_BAR, V_BAR, K_EQ, V_EQ, KQ, KS, VQ, VS, KR, VR, pos0, POS,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_qb, stride_qh, stride_qn,
    stride_sb, stride_sh,
    stride_gb, stride_gh, stride_gg,
    stride_rb, stride_rh,
    stride_wb, stride_wh, stride_wn,
    HK, N,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, INT4: tl.constexpr, G8: tl.constexpr,
    GRID_ROUND: tl.constexpr, DEVICE_POS: tl.constexpr,
):
    GROUPED: tl.constexpr = INT4 or G8
    tile = tl.program_id(0)
    bh = tl.program_id(1)  # b·Hk + hk
    if DEVICE_POS:  # the first slot from device memory (a static cache's length): replayable in a CUDA graph
        pos0 = tl.load(POS)
    b = (bh // HK).to(tl.int64)
    hk = bh % HK
    group_off = b * stride_gb + hk * stride_gh
    recent_off = b * stride_rb + hk * stride_rh

    # --- grouped formats (K, and int8g's V): subtract the fixed center, quantize per channel over a group when
    # its last token arrives. A program per group touched, from pos0's group (a device-side pos0 may leave the
    # grid's last programs nothing to do). pos0's group reads its earlier tokens from the recent rows, and a group
    # left incomplete at the end writes its tokens there: both in program 0, in that order, since programs run in
    # no set order and another program's write could land before program 0's read. (Within program 0 the complete
    # group's reductions over its rows, a barrier of the whole program, come between the reads and the writes.)
    if GROUPED:
        tl.static_assert(BLOCK_T == KV_GROUP)
        first = pos0 // KV_GROUP
        last = (pos0 + N - 1) // KV_GROUP
        for job in range(2):  # 0: this program's group; 1 (program 0 only): the incomplete last group
            group = tl.where(job == 0, first + tile, last)
            complete = group * KV_GROUP + KV_GROUP <= pos0 + N
            mine = tl.where(job == 0, (group <= last) & (complete | (tile == 0)),
                            (tile == 0) & (last != first) & (last * KV_GROUP + KV_GROUP > pos0 + N))
            if mine:
                slots = group * KV_GROUP + tl.arange(0, BLOCK_T)
                rows = slots - pos0  # index of the new token in each slot (< 0: an earlier token of the group)
                row_ok = (rows >= 0) & (rows < N)
                k_base = K + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn
                q_base = KQ + b * stride_qb + hk * stride_qh + slots[:, None] * stride_qn
                if INT4:
                    _append_k_group(k_base, K_BAR, q_base, KS + group_off + group * stride_gg, KR + recent_off, bh,
                                    rows, row_ok, complete, stride_kd, HEAD_DIM, D_PAD, GRID_ROUND)
                else:
                    _append_group8(k_base, K_BAR, q_base, KS + group_off + group * stride_gg, KR + recent_off, bh,
                                   rows, row_ok, complete, stride_kd, HEAD_DIM, D_PAD, GRID_ROUND)
                if G8:
                    v_base = V + b * stride_vb + hk * stride_vh + rows[:, None] * stride_vn
                    w_base = VQ + b * stride_wb + hk * stride_wh + slots[:, None] * stride_wn
                    _append_group8(v_base, V_BAR, w_base, VS + group_off + group * stride_gg, VR + recent_off, bh,
                                   rows, row_ok, complete, stride_vd, HEAD_DIM, D_PAD, GRID_ROUND)

    # --- per-token formats: K and (unless int8g) V, the fixed center off, equalized, INT8 over a scale a token
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = pos0 + rows
    row_ok = rows < N
    s_off = b * stride_sb + hk * stride_sh + slots
    c = tl.arange(0, D_PAD)
    if not GROUPED:
        _append_tokens(K + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn, K_BAR, K_EQ,
                       KQ + b * stride_qb + hk * stride_qh + slots[:, None] * stride_qn, KS + s_off, bh, c, row_ok,
                       stride_kd, HEAD_DIM, GRID_ROUND, 0, 1)
    if not G8:  # V's tiles are channel-major (V_TILE slots a tile): a token is a column
        v_cols = (VQ + b * stride_wb + hk * stride_wh + (slots // V_TILE)[:, None] * stride_wn
                  + (slots % V_TILE)[:, None])
        _append_tokens(V + b * stride_vb + hk * stride_vh + rows[:, None] * stride_vn, V_BAR, V_EQ, v_cols, VS + s_off,
                       bh, c, row_ok, stride_vd, HEAD_DIM, GRID_ROUND, V_OFFSET, V_TILE)


@triton.jit
def _load_tile(ptrs, n_ok, col_ok, other, MASK_N: tl.constexpr, EVEN: tl.constexpr):
    """A tile of cached rows: unmasked (16-byte vector loads) when every column is real and no row can run
    past the end (MASK_N false), masked by rows, or (not EVEN: a padded head dim) by rows and columns;
    ``other`` fills what the mask leaves out."""
    if EVEN:
        if MASK_N:
            tile = tl.load(ptrs, mask=n_ok[:, None], other=other)
        else:
            tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=n_ok[:, None] & col_ok[None, :], other=other)
    return tile


@triton.jit
def _fp16_1024_plus(u, STAGED: tl.constexpr):
    """1024 + u in fp16 for u ∈ [0, 255] (exact) without a conversion instruction: the bits 0x6400 | u, one byte
    permute (``prmt``) for two values; Triton's own int16 or + bitcast takes three instructions a pair (10 % of a G8
    tile's instructions: eval/results/int8g-decode-variants-*.md).
    STAGED (V, the B operand of P · V, whose mma registers pair two keys of one channel): declared impure, so that
    Triton converts the tile as loaded (rows, 16-byte shared loads), stages it in fp16 and reads it back
    transposed (``ldmatrix.trans``). A pure conversion it moves behind the dot's layout change, which then gathers
    the 8-bit tile a byte at a time (64 one-byte shared loads a thread a 64-key d128 tile at 4 warps); staging takes
    a tile of fp16 more shared memory (kernels.json decode SHARED)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342;",
                                     "=r,=r,r", [u], dtype=tl.float16, is_pure=not STAGED, pack=4)


@triton.jit
def _bf16_128_plus_nibble(packed, SHIFT: tl.constexpr):
    """128 + u in bf16 for the nibble u of each byte of INT4's packed K at bit SHIFT (0: low, 4: high), exact: the
    bits 0x4300 | u. Four bytes a word: a shift (high nibbles), one ``and``, and a byte permute for each two values;
    Triton's own widening to int16, ``and`` and ``or`` took 3.7 instructions a value (offline sm_90 build, d128)."""
    if SHIFT == 0:
        out = tl.inline_asm_elementwise("{.reg .b32 t; and.b32 t, $2, 0x0F0F0F0F; prmt.b32 $0, t, 0x43434343, 0x4140; "
                                        "prmt.b32 $1, t, 0x43434343, 0x4342;}",
                                        "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise("{.reg .b32 t; shr.u32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F; "
                                        "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342;}",
                                        "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
    return out


@triton.jit
def _per_query(x, KEYS_AS_ROWS: tl.constexpr):
    """A vector over the tile's query rows, broadcast across the other axis: the keys of a score tile (query rows ×
    keys, or with KEYS_AS_ROWS keys × query rows), the channels of an output tile (likewise, channels × query rows)."""
    if KEYS_AS_ROWS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_key_or_channel(x, KEYS_AS_ROWS: tl.constexpr):
    """A vector over a score tile's keys or an output tile's channels, broadcast across the query rows (see
    :func:`_per_query`)."""
    if KEYS_AS_ROWS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _scores_as_given(q, k, KEYS_AS_ROWS: tl.constexpr):
    """As :func:`_scores` with q already as the dot takes it, (C, BLOCK_M) with KEYS_AS_ROWS, and k in its dtype."""
    if KEYS_AS_ROWS:
        return tl.dot(k, q)
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def _scores(q, k, KEYS_AS_ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """Query rows q (BLOCK_M, C) against keys k (BLOCK_N, C): q · kᵀ, or with KEYS_AS_ROWS k · qᵀ, fp32 accumulate;
    k converted to q's dtype (exact for the stored integers ≤ 255), or under the interpreter both in fp32 (its bf16
    dot and int8 → bf16 cast are wrong in Triton 3.9; fp32 is exact)."""
    if INTERPRET:
        q = q.to(tl.float32)
    k = k.to(q.dtype)
    if KEYS_AS_ROWS:
        q = tl.trans(q)
    return _scores_as_given(q, k, KEYS_AS_ROWS)


@triton.jit
def _weighted(p, v, KEYS_AS_ROWS: tl.constexpr):
    """Weights p (query rows × keys, or with KEYS_AS_ROWS keys × query rows) times values v (BLOCK_N, channels):
    p · v, or vᵀ · p (the output tile transposed likewise); both already in the dot's dtype."""
    if KEYS_AS_ROWS:
        return tl.dot(tl.trans(v), p)
    else:
        return tl.dot(p, v)


@triton.jit
def _attend_tile(q, q_lo, q_hi, q_unit, q_fine, q_amax, acc, m_i, l_i, start, hi, kv_lo, diag, qi, k_base, KS, VS,
                 s_base, v_base, k_group_base, k_recent_base, v_group_base, v_recent_base, recent_lo,
                 stride_kn, stride_vn, stride_gg, stride_rn, score_coef, shift, softcap2, window, chunk_size, ring,
                 ring_lo, ring_count,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, INT4: tl.constexpr,
                 G8: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_RANGE: tl.constexpr, INTERPRET: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, RING: tl.constexpr,
                 V_STAGED: tl.constexpr, MASK_N: tl.constexpr, RECENT: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    """One tile of BLOCK_N cached tokens folded into (acc, m_i, l_i). MASK_N: the tile may run past ``hi``.
    INT4 / G8: the tile is one group (BLOCK_N = G) of packed 4-bit K (q in two halves, ``q_lo`` and ``q_hi``, and
    in fp32 as ``q_unit`` and ``q_fine``, transposed with KEYS_AS_ROWS) / of
    8-bit K and V (q as ``q_unit`` · ``q_amax``: q over its row's largest |q|, and that), or with RECENT the
    incomplete group's tokens from ``k_recent_base`` (and G8's V from ``v_recent_base``; slot ``recent_lo`` is
    their row 0). Per-token INT8 K: q as two INT8 parts ``q_unit`` and ``q_fine`` (decode_kernel) times ``q_amax``.
    V_STAGED: G8's V tile goes through shared memory in fp16 (:func:`_fp16_1024_plus`); per-token V's channel-major
    tile needs no staging.
    SOFTCAP: scores c·tanh(s / c) of the true score s (the smoothed score plus the row's ``shift``, in base 2,
    as ``softcap2`` = c·log2 e); WINDOW / CHUNK: the query at position diag + qi sees keys within ``window``
    of it / in its chunk of ``chunk_size``; RING: keys in the cyclic slot range of ``ring_count`` slots from
    ``ring_lo`` over a ring of ``ring`` slots.
    KEYS_AS_ROWS: the dots take the keys as their rows, Sᵀ = K̂ · q̂ᵀ and Oᵀ += V̂ᵀ · Pᵀ, with ``acc`` as Oᵀ (and
    per-token INT8's q̂ parts given transposed, (D_PAD, BLOCK_M)). A decode tile holds few query rows (GQA-4, one
    token: 4), which an mma pads to 16 as its rows but to 8 as its columns: the softmax handles half the elements,
    the tile half the mma's (what it measured: decode_launch's KEYS_AS_ROWS_UP_TO)."""
    KEY_AXIS: tl.constexpr = 0 if KEYS_AS_ROWS else 1
    CHANNEL_AXIS: tl.constexpr = KEY_AXIS  # of INT4's q halves in fp32 (q_unit, q_fine), oriented as the dots take q
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    if INT4 or G8:  # a grouped tile is one group: its scales, and G8's row dither, are the tile's
        tl.static_assert(BLOCK_N == KV_GROUP)
    if INT4:
        tl.static_assert(not INT4_DITHERED, "the INT4 tile is read as undithered groups")
        HALF: tl.constexpr = D_PAD // 2
        c = tl.arange(0, HALF)
        lo_ok = c < HEAD_DIM
        hi_ok = (c + HALF) < HEAD_DIM
        if RECENT:  # K − k̄ in full precision: rows of k_recent, masked past hi
            rows = k_recent_base + (offs_n - recent_lo)[:, None] * stride_rn
            k_lo = tl.load(rows + c[None, :], mask=n_ok[:, None] & lo_ok[None, :], other=0.0)
            k_hi = tl.load(rows + (c + HALF)[None, :], mask=n_ok[:, None] & hi_ok[None, :], other=0.0)
            qk = _scores(q_lo, k_lo, KEYS_AS_ROWS, INTERPRET) + _scores(q_hi, k_hi, KEYS_AS_ROWS, INTERPRET)
        else:  # one group: its scales folded into q, q · zero added to every key's score
            packed = _load_tile(k_base + offs_n[:, None] * stride_kn + c[None, :], n_ok, c >= 0, 0, MASK_N, True)
            group = k_group_base + (start // BLOCK_N) * stride_gg
            scale_lo = tl.load(group + c, mask=lo_ok, other=0.0).to(tl.float32)
            scale_hi = tl.load(group + c + HALF, mask=hi_ok, other=0.0).to(tl.float32)
            zero_lo = tl.load(group + HEAD_DIM + c, mask=lo_ok, other=0.0).to(tl.float32)
            zero_hi = tl.load(group + HEAD_DIM + c + HALF, mask=hi_ok, other=0.0).to(tl.float32)
            # q's halves in fp32 as q_unit (low) and q_fine (high), (channels, query rows) with KEYS_AS_ROWS
            qs_lo = q_unit * _per_key_or_channel(scale_lo, KEYS_AS_ROWS)
            qs_hi = q_fine * _per_key_or_channel(scale_hi, KEYS_AS_ROWS)
            row = (q_unit * _per_key_or_channel(zero_lo, KEYS_AS_ROWS)
                   + q_fine * _per_key_or_channel(zero_hi, KEYS_AS_ROWS))  # q · zero, summed below
            if INTERPRET:  # fp32 (see _scores)
                qk = (_scores_as_given(qs_lo, (packed & 15).to(tl.float32), KEYS_AS_ROWS)
                      + _scores_as_given(qs_hi, ((packed >> 4) & 15).to(tl.float32), KEYS_AS_ROWS))
            else:
                # bf16 keeps q ⊙ scale's range (fp16 could overflow on outlier channels). The nibbles become bf16
                # without a conversion instruction (_bf16_128_plus_nibble), so the dot gives Σ qs·u + 128·Σ qs, and
                # the row term takes the 128·Σ qs back out.
                qs_lo = qs_lo.to(tl.bfloat16)
                qs_hi = qs_hi.to(tl.bfloat16)
                row = row - 128.0 * (qs_lo.to(tl.float32) + qs_hi.to(tl.float32))
                qk = (_scores_as_given(qs_lo, _bf16_128_plus_nibble(packed, 0), KEYS_AS_ROWS)
                      + _scores_as_given(qs_hi, _bf16_128_plus_nibble(packed, 4), KEYS_AS_ROWS))
            row = tl.sum(row, axis=CHANNEL_AXIS)
            qk = qk + _per_query(row, KEYS_AS_ROWS)
    elif G8:
        c = tl.arange(0, D_PAD)
        if RECENT:
            k = tl.load(k_recent_base + (offs_n - recent_lo)[:, None] * stride_rn + c[None, :],
                        mask=n_ok[:, None] & (c < HEAD_DIM)[None, :], other=0.0)
            qk = _scores(q, k, KEYS_AS_ROWS, INTERPRET)
        else:  # one group: its scales folded into q, q · zero added to every key's score
            u = _load_tile(k_base + offs_n[:, None] * stride_kn + c[None, :], n_ok, c < HEAD_DIM, 0, MASK_N, EVEN_D)
            group = k_group_base + (start // BLOCK_N) * stride_gg
            scale = tl.load(group + c, mask=c < HEAD_DIM, other=0.0).to(tl.float32)
            zero = tl.load(group + HEAD_DIM + c, mask=c < HEAD_DIM, other=0.0).to(tl.float32)
            if INTERPRET:
                qs = q_unit * scale[None, :]
                qk = _scores(qs, u, KEYS_AS_ROWS, INTERPRET)
                offset = tl.zeros([BLOCK_N], tl.float32)
            else:
                # fp16: 11 bits of q̂ ⊙ scale, its rounding 1/8 of the 8-bit values' own; in range, as q̂ is q over
                # its row's max |q| (a scale ≥ 65504 would need a K channel's range in a group ≥ 1.6e7). u as
                # 1024 + u (_fp16_1024_plus): the dot gives Σ qs·u + 1024·Σ qs, and 1024·Σ qs is taken back out
                # (one dot: a bf16 hi + lo pair in two took 1.4× the time at B8, decode-regs-sweep-*-11-25.md in
                # eval/results)
                qs = q_unit * scale.to(tl.float16)[None, :]
                qk = _scores(qs, _fp16_1024_plus(u, False), KEYS_AS_ROWS, INTERPRET)
                offset = tl.full([BLOCK_N], 1024.0, tl.float32)
            if G8_DITHERED:  # key r's values are u − φ_r
                offset = offset + group_dither(tl.arange(0, BLOCK_N))
            # Σ q̂ ⊙ scale (as the dot took it) and q̂ · zero: one reduction across the tile's threads
            qs_sum, q_zero = tl.split(tl.sum(tl.join(qs.to(tl.float32), q_unit.to(tl.float32) * zero[None, :]),
                                             axis=1))
            qk = ((qk - _per_query(qs_sum, KEYS_AS_ROWS) * _per_key_or_channel(offset, KEYS_AS_ROWS)
                   + _per_query(q_zero, KEYS_AS_ROWS)) * _per_query(q_amax, KEYS_AS_ROWS))
    else:
        c = tl.arange(0, D_PAD)
        k = _load_tile(k_base + offs_n[:, None] * stride_kn + c[None, :], n_ok, c < HEAD_DIM, 0, MASK_N, EVEN_D)
        # q̂ = q_unit + q_fine / 254 (in 127ths of the row's largest |q|): two INT8 dots with K̂ as stored, no
        # conversion of K; exact in int32 (|254 · q_unit · K̂ + q_fine · K̂| ≤ 255 · 127² · D < 2^31 for D ≤ 256)
        if KEYS_AS_ROWS:  # q_unit, q_fine: (D_PAD, BLOCK_M)
            if INTERPRET:
                qk = (254.0 * _scores(tl.trans(q_unit), k, True, INTERPRET)
                      + _scores(tl.trans(q_fine), k, True, INTERPRET))
            else:
                qk = tl.dot(k, q_fine, acc=tl.dot(k, q_unit, out_dtype=tl.int32) * 254, out_dtype=tl.int32)
        elif INTERPRET:
            qk = 254.0 * _scores(q_unit, k, False, INTERPRET) + _scores(q_fine, k, False, INTERPRET)
        else:
            k_t = tl.trans(k)
            qk = tl.dot(q_fine, k_t, acc=tl.dot(q_unit, k_t, out_dtype=tl.int32) * 254, out_dtype=tl.int32)
        qk = qk.to(tl.float32) * _per_query(q_amax, KEYS_AS_ROWS)
    if not G8:  # V's per-token scale
        if MASK_N:
            v_scale = tl.load(VS + s_base + offs_n, mask=n_ok, other=0.0)
        else:
            v_scale = tl.load(VS + s_base + offs_n)
    if INT4 or G8:
        s = qk * score_coef
    else:
        if MASK_N:
            k_scale = tl.load(KS + s_base + offs_n, mask=n_ok, other=0.0)
        else:
            k_scale = tl.load(KS + s_base + offs_n)
        s = qk * _per_key_or_channel(k_scale * score_coef, KEYS_AS_ROWS)
    if SOFTCAP:  # tanh(t) = 1 − 2 / (exp(2t) + 1), saturating to ±1 (no tanh in the interpreter's math)
        t = (s + _per_query(shift, KEYS_AS_ROWS)) / softcap2
        s = softcap2 * (1.0 - 2.0 / (tl.math.exp2(t * 2.885390081777927) + 1.0))
    if MASK_N or HAS_KV_RANGE or CAUSAL or WINDOW or CHUNK or RING:
        key = _per_key_or_channel(offs_n, KEYS_AS_ROWS)
        visible = _per_key_or_channel(n_ok, KEYS_AS_ROWS)
        if HAS_KV_RANGE:
            visible = visible & (key >= kv_lo)
        if CAUSAL:
            visible = visible & (key <= _per_query(diag + qi, KEYS_AS_ROWS))
        if WINDOW:
            visible = visible & (key > _per_query(diag + qi - window, KEYS_AS_ROWS))
        if CHUNK:
            visible = visible & ((key // chunk_size) == _per_query((diag + qi) // chunk_size, KEYS_AS_ROWS))
        if RING:
            visible = visible & ((key + ring - ring_lo) % ring < ring_count)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=KEY_AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.math.exp2(s - _per_query(m_use, KEYS_AS_ROWS))
    alpha = tl.math.exp2(m_i - m_use)
    if G8 and not RECENT:
        # the weights as the group's dot takes them (P ≤ 1: fp16 holds it to 11 bits); their sum, which the zero
        # point's 1024 · scale must cancel exactly, is the denominator's too; with P · φ, one reduction
        p_w = p.to(tl.float16)
        dither = _per_key_or_channel(group_dither(tl.arange(0, BLOCK_N)), KEYS_AS_ROWS)
        p_sum, p_phi = tl.split(tl.sum(tl.join(p_w.to(tl.float32), p_w.to(tl.float32) * dither), axis=KEY_AXIS))
    elif not G8:
        # per-token V: P times each token's largest |V̂| (δV · 127, fp16's normal range), as the dot takes it; V̂
        # stored as u = V̂ + 128 and read as 1024 + u (_fp16_1024_plus), so 1152 · Σ of these weights comes off the
        # dot; with ΣP, one reduction
        p_w = (p * _per_key_or_channel(v_scale * 127.0, KEYS_AS_ROWS)).to(tl.float16)
        if INTERPRET:
            p_sum = tl.sum(p, axis=KEY_AXIS)
        else:
            p_sum, p_w_sum = tl.split(tl.sum(tl.join(p, p_w.to(tl.float32)), axis=KEY_AXIS))
    else:
        p_sum = tl.sum(p, axis=KEY_AXIS)
    l_i = l_i * alpha + p_sum
    offs_d = tl.arange(0, D_PAD)
    if G8 and RECENT:  # V − v̄ in full precision
        v = tl.load(v_recent_base + (offs_n - recent_lo)[:, None] * stride_rn + offs_d[None, :],
                    mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        if INTERPRET:
            pv = _weighted(p, v.to(tl.float32), KEYS_AS_ROWS)
        else:
            pv = _weighted(p.to(v.dtype), v, KEYS_AS_ROWS)
    elif G8:  # one group: O += (P · u) ⊙ scale + ΣP · zero
        u = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], n_ok, offs_d < HEAD_DIM, 0, MASK_N,
                       EVEN_D)
        group = v_group_base + (start // BLOCK_N) * stride_gg
        scale = tl.load(group + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        zero = tl.load(group + HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        if INTERPRET:
            pv = _weighted(p_w.to(tl.float32), u.to(tl.float32), KEYS_AS_ROWS)
        else:
            # u as 1024 + u (_fp16_1024_plus): the dot gives P · u + 1024 · ΣP, and the zero point takes
            # 1024 · scale back out
            pv = _weighted(p_w, _fp16_1024_plus(u, V_STAGED), KEYS_AS_ROWS)
            zero = zero - 1024.0 * scale
        if G8_DITHERED:  # key r's values are u − φ_r: P · φ comes off before the scale
            pv = pv - _per_query(p_phi, KEYS_AS_ROWS)
        pv = (pv * _per_key_or_channel(scale, KEYS_AS_ROWS)
              + _per_query(p_sum, KEYS_AS_ROWS) * _per_key_or_channel(zero, KEYS_AS_ROWS))
    else:  # per-token INT8 V (its 127 and equalizers σ_V come back in the output, at the end)
        # channel-major tiles of V_TILE slots (formats.KV_V_TILE): the tile's Vᵀ (D_PAD, BLOCK_N) rows are runs of
        # V_TILE contiguous keys, as the dot's operand pairs them: 16-byte loads, converted in place, no staging
        RUN: tl.constexpr = V_TILE if V_TILE < BLOCK_N else BLOCK_N  # a row's contiguous keys (powers of two both)
        # (no mask by key: the storage holds whole tiles, and a key past hi weighs p_w = 0 against a finite value)
        key_off = tl.max_contiguous(tl.multiple_of((offs_n // V_TILE) * stride_vn + offs_n % V_TILE, RUN), RUN)
        vt = v_base + key_off[None, :] + offs_d[:, None] * V_TILE
        if EVEN_D:
            vt = tl.load(vt)
        else:
            vt = tl.load(vt, mask=(offs_d < HEAD_DIM)[:, None], other=0)
        if INTERPRET:
            pv = _weighted(p_w.to(tl.float32), tl.trans(vt.to(tl.float32) - V_OFFSET), KEYS_AS_ROWS)
        else:  # (see p_w above)
            pv = (_weighted(p_w, tl.trans(_fp16_1024_plus(vt, False)), KEYS_AS_ROWS)
                  - (1024.0 + V_OFFSET) * _per_query(p_w_sum, KEYS_AS_ROWS))
    acc = acc * _per_query(alpha, KEYS_AS_ROWS) + pv
    return acc, m_new, l_i


@triton.jit
def _with_sink(acc, m, l, seen, sink2, v_bar):
    """O + v̄·l / l′ from the (merged) accumulators with a sink: exp2(sink − m) joins the denominator
    (l′ = l + it), so the weights sum to l / l′ and V's center comes back in that share. Rows that saw no
    key give zeros, as without a sink."""
    denom = tl.where(seen, l, 1.0) + tl.where(seen, tl.math.exp2(sink2 - tl.where(seen, m, 0.0)), 0.0)
    return tl.where(seen[:, None], (acc + l[:, None] * v_bar[None, :]) / denom[:, None], 0.0)


@triton.jit(do_not_specialize=["NK", "SPLIT_LEN", "NUM_SPLITS"])
def decode_kernel(
    Q, KQ, KS, VQ, VS, KR, VR, V_BAR, K_EQ, V_EQ, KV_START, KV_END, O, PART_O, PART_M, PART_L, COUNTER, LEN, K_BAR,
    SINKS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn,
    stride_sb, stride_sh,
    stride_gb, stride_gh, stride_gg,
    stride_rb, stride_rh, stride_rn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_on, stride_oh, stride_od,
    HK, NQ, NK, SPLIT_LEN, NUM_SPLITS, score_coef, softcap2, window, chunk_size, ring,
    GROUPS: tl.constexpr, QT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT4: tl.constexpr, G8: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KV_RANGE: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    DEVICE_LEN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
    CHUNK: tl.constexpr, RING: tl.constexpr, V_STAGED: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
):
    GROUPED: tl.constexpr = INT4 or G8
    if DEVICE_LEN:  # the cached token count from device memory; NK was the capacity the splits were planned for
        NK = tl.minimum(tl.load(LEN), NK)
    chunk = tl.program_id(0)
    bh = tl.program_id(1)  # b·Hk + hk
    split = tl.program_id(2)
    score_coef = tl.cast(score_coef, tl.float32)
    b = (bh // HK).to(tl.int64)
    hk = bh % HK
    r = tl.arange(0, BLOCK_M)
    qi = chunk * QT + r // GROUPS  # query token of each row
    head = hk * GROUPS + r % GROUPS  # query head of each row
    row_ok = (r < QT * GROUPS) & (qi < NQ)

    # --- the group's queries, in their own dtype (K̂ converts to it exactly)
    q_rows = Q + b * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qn
    if INT4:
        HALF: tl.constexpr = D_PAD // 2
        c = tl.arange(0, HALF)
        q_lo = tl.load(q_rows + c[None, :] * stride_qd, mask=row_ok[:, None] & (c < HEAD_DIM)[None, :], other=0.0)
        q_hi = tl.load(q_rows + (c + HALF)[None, :] * stride_qd,
                       mask=row_ok[:, None] & ((c + HALF) < HEAD_DIM)[None, :], other=0.0)
        q = q_lo
    else:
        c = tl.arange(0, D_PAD)
        q = tl.load(q_rows + c[None, :] * stride_qd, mask=row_ok[:, None] & (c < HEAD_DIM)[None, :], other=0.0)
        q_lo = q
        q_hi = q
    # the 8-bit formats' q: over its row's largest |value| (q_unit), and that largest value (q_amax). G8's q̂ takes
    # the K groups' scales in its tiles (_attend_tile): fp16, 11 bits. INT8 K's q is first multiplied by K's
    # equalizers σ_K (q · σ_K ⊙ K̂ = q · K), then split into two INT8 parts, the dot's own type with K̂ as stored:
    # q̂ · 127 = q_unit + q_fine / 254, within 1/(2 · 127 · 254) of the row's max (fp16: 2^−12 of each value)
    q_amax = tl.full([BLOCK_M], 1.0, tl.float32)
    q_unit = q.to(tl.float32)
    q_fine = q_unit
    if INT4:  # q's two halves in fp32, which the whole groups' tiles scale (_attend_tile)
        q_fine = q_hi.to(tl.float32)
    if not GROUPED:
        q_unit = q_unit * tl.load(K_EQ + bh * HEAD_DIM + c, mask=c < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    if not INT4:
        q_amax = tl.max(tl.abs(q_unit), axis=1)
        q_amax = tl.where(q_amax > 0, q_amax, 1.0)
        q_unit = q_unit / q_amax[:, None]
        if not GROUPED:  # (a NaN or ±Inf in q would round to some integer: it reaches the scores through q_amax)
            q_amax = _nan_unless_finite(q_amax, q_unit, 1)
            q127 = q_unit * 127.0
            q_unit = round_half_even(q127)
            q_fine = round_half_even((q127 - q_unit) * 254.0)
            q_amax = q_amax / (127.0 * 254.0)
            if not INTERPRET:  # (the interpreter's dots run in fp32, exact for these integers)
                q_unit = q_unit.to(tl.int8)
                q_fine = q_fine.to(tl.int8)
        elif not INTERPRET:  # the dtype of G8's K tile dot (_attend_tile)
            q_unit = q_unit.to(tl.float16)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM

    # --- the row's dropped term sm_scale·q·k̄ (base 2): soft-capping needs the true score, and a sink is
    # compared with the smoothed scores, which lack it
    shift = tl.zeros([BLOCK_M], tl.float32)
    if SOFTCAP or HAS_SINKS:
        if INT4:  # q in two halves, as loaded above
            kc = tl.arange(0, D_PAD // 2)
            kb_lo = tl.load(K_BAR + bh * HEAD_DIM + kc, mask=kc < HEAD_DIM, other=0.0)
            kb_hi = tl.load(K_BAR + bh * HEAD_DIM + kc + D_PAD // 2, mask=(kc + D_PAD // 2) < HEAD_DIM, other=0.0)
            shift = (tl.sum(q_lo.to(tl.float32) * kb_lo[None, :], axis=1)
                     + tl.sum(q_hi.to(tl.float32) * kb_hi[None, :], axis=1))
        else:
            kc = tl.arange(0, D_PAD)
            kb = tl.load(K_BAR + bh * HEAD_DIM + kc, mask=kc < HEAD_DIM, other=0.0)
            shift = tl.sum(q.to(tl.float32) * kb[None, :], axis=1)
        shift = shift * score_coef
    sink2 = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # in the units of the kernel's scores: base 2, smoothed unless capped
        sink2 = tl.load(SINKS + head, mask=row_ok, other=0.0) * 1.4426950408889634
        if not SOFTCAP:
            sink2 = sink2 - shift

    # --- this split's keys: [lo, hi) ∩ [kv_lo, kv_hi) ∩ causal
    kv_lo = 0
    kv_hi = NK
    ring_lo = 0
    ring_count = 0
    if RING:  # (first slot, count) of a cyclic range: every slot is read, the range masks
        ring_lo = tl.load(KV_START + b).to(tl.int32)
        ring_count = tl.load(KV_END + b).to(tl.int32)
    elif HAS_KV_RANGE:
        kv_lo = tl.load(KV_START + b).to(tl.int32)
        kv_hi = tl.minimum(tl.load(KV_END + b).to(tl.int32), NK)
    diag = NK - NQ  # query i sees keys ≤ diag + i
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, kv_hi)
    if CAUSAL:
        last_q = tl.minimum(chunk * QT + QT, NQ) - 1
        hi = tl.minimum(hi, diag + last_q + 1)
    first_key = kv_lo  # no key before it is visible to any query of the program
    if WINDOW:
        first_key = tl.maximum(first_key, diag + chunk * QT - window + 1)
    if CHUNK:
        first_key = tl.maximum(first_key, tl.maximum(diag + chunk * QT, 0) // chunk_size * chunk_size)
    lo = tl.maximum(lo, tl.maximum(first_key, 0) // BLOCK_N * BLOCK_N)
    # grouped formats: whole groups are quantized (a tile each), the incomplete group's tokens from NK // G · G on
    # are in KR (and VR)
    if GROUPED:
        tl.static_assert(BLOCK_N == KV_GROUP)
        packed_hi = NK // BLOCK_N * BLOCK_N
    else:
        packed_hi = NK
    hi_packed = tl.minimum(hi, packed_hi)
    # whole tiles first (no bound mask: wide loads), then at most one partial tile
    hi_full = tl.maximum(lo, lo + (hi_packed - lo) // BLOCK_N * BLOCK_N)

    k_base = KQ + b * stride_kb + hk * stride_kh
    s_base = b * stride_sb + hk * stride_sh
    v_base = VQ + b * stride_vb + hk * stride_vh
    g_base = KS  # the group scales and recent rows, where the format has them
    r_base = KS
    vg_base = VS
    vr_base = VS
    if GROUPED:
        g_base = KS + b * stride_gb + hk * stride_gh
        r_base = KR + b * stride_rb + hk * stride_rh
    if G8:
        vg_base = VS + b * stride_gb + hk * stride_gh
        vr_base = VR + b * stride_rb + hk * stride_rh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if KEYS_AS_ROWS:  # Oᵀ, and per-token INT8's q̂ parts (INT4's q halves in fp32) transposed once (_attend_tile)
        acc = tl.zeros([D_PAD, BLOCK_M], tl.float32)
        if not G8:
            q_unit = tl.trans(q_unit)
            q_fine = tl.trans(q_fine)
    else:
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # whole tiles, a partial one, and (grouped formats) the incomplete group's rows: at most one tile, in the split
    # that reaches it; the three differ only in the last two switches, MASK_N and RECENT. Only the first loop is
    # software-pipelined: the other two run at most one tile each, and their stage buffers (the recent rows in the
    # model's floats) would set the program's shared memory and so the programs an SM holds (INT4 d128 bf16:
    # 68 KB and three programs pipelined, 42 KB and five not)
    for start in range(lo, hi_full, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, q_lo, q_hi, q_unit, q_fine, q_amax, acc, m_i, l_i, start, hi, kv_lo, diag, qi, k_base, KS, VS, s_base,
            v_base, g_base, r_base, vg_base, vr_base, packed_hi, stride_kn, stride_vn, stride_gg, stride_rn, score_coef,
            shift, softcap2, window, chunk_size, ring, ring_lo, ring_count, HEAD_DIM, D_PAD, BLOCK_N, INT4, G8, CAUSAL,
            HAS_KV_RANGE, INTERPRET, SOFTCAP, WINDOW, CHUNK, RING, V_STAGED, False, False, KEYS_AS_ROWS)
    for start in tl.range(hi_full, hi_packed, BLOCK_N, num_stages=1):
        acc, m_i, l_i = _attend_tile(
            q, q_lo, q_hi, q_unit, q_fine, q_amax, acc, m_i, l_i, start, hi, kv_lo, diag, qi, k_base, KS, VS, s_base,
            v_base, g_base, r_base, vg_base, vr_base, packed_hi, stride_kn, stride_vn, stride_gg, stride_rn, score_coef,
            shift, softcap2, window, chunk_size, ring, ring_lo, ring_count, HEAD_DIM, D_PAD, BLOCK_N, INT4, G8, CAUSAL,
            HAS_KV_RANGE, INTERPRET, SOFTCAP, WINDOW, CHUNK, RING, V_STAGED, True, False, KEYS_AS_ROWS)
    if GROUPED:
        for start in tl.range(tl.maximum(lo, packed_hi), hi, BLOCK_N, num_stages=1):
            acc, m_i, l_i = _attend_tile(
                q, q_lo, q_hi, q_unit, q_fine, q_amax, acc, m_i, l_i, start, hi, kv_lo, diag, qi, k_base, KS, VS,
                s_base, v_base, g_base, r_base, vg_base, vr_base, packed_hi, stride_kn, stride_vn, stride_gg, stride_rn,
                score_coef, shift, softcap2, window, chunk_size, ring, ring_lo, ring_count, HEAD_DIM, D_PAD, BLOCK_N,
                INT4, G8, CAUSAL, HAS_KV_RANGE, INTERPRET, SOFTCAP, WINDOW, CHUNK, RING, V_STAGED, True, True,
                KEYS_AS_ROWS)

    if KEYS_AS_ROWS:
        acc = tl.trans(acc)
    o_ptrs = O + b * stride_ob + qi[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    v_bar = tl.load(V_BAR + bh * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    v_eq = tl.full([D_PAD], 1.0, tl.float32)
    if not G8:  # per-token V: its equalizers σ_V, and the 127 that P · δV · 127 took (_attend_tile)
        v_eq = tl.load(V_EQ + bh * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32) / 127.0
    if SPLIT:
        part0 = ((b * HK * GROUPS + head) * NQ + qi) * NUM_SPLITS
        part = part0 + split
        tl.store(PART_O + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PART_M + part, m_i, mask=row_ok)
        tl.store(PART_L + part, l_i, mask=row_ok)
        # The last split of this (query chunk, batch·kv-head) to finish merges all the splits, so a
        # decode step is one launch. The counter goes back to 0 for the next launch.
        tl.debug_barrier()  # every thread's partial stores precede the release below
        counter = COUNTER + chunk * tl.num_programs(1) + bh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_run = tl.zeros([BLOCK_M], tl.float32)
            o_run = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            # MERGE splits a step, their loads issued together: a split a step would wait on L2 once per split,
            # and the merge is the launch's tail (64 splits at B1 128k). A split past NUM_SPLITS reads as
            # (−inf, 0, 0), which weighs nothing
            MERGE: tl.constexpr = max(1, min(4, 4096 // (BLOCK_M * D_PAD)))
            ts = tl.arange(0, MERGE)
            for t0 in range(0, NUM_SPLITS, MERGE):
                parts = part0[None, :] + (t0 + ts)[:, None]  # (MERGE, BLOCK_M)
                ok = row_ok[None, :] & ((t0 + ts) < NUM_SPLITS)[:, None]
                m_t = tl.load(PART_M + parts, mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_t = tl.load(PART_L + parts, mask=ok, other=0.0, cache_modifier=".cg")
                o_t = tl.load(PART_O + parts[:, :, None] * D_PAD + offs_d[None, None, :], mask=ok[:, :, None],
                              other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_run, tl.max(m_t, axis=0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                a_run = tl.math.exp2(m_run - m_use)
                a_t = tl.math.exp2(m_t - m_use[None, :])
                l_run = l_run * a_run + tl.sum(l_t * a_t, axis=0)
                o_run = o_run * a_run[:, None] + tl.sum(o_t * a_t[:, :, None], axis=0)
                m_run = m_new
            seen = l_run != 0.0  # NaN (non-finite input) stays NaN
            o_run = o_run * v_eq[None, :]
            if HAS_SINKS:
                out = _with_sink(o_run, m_run, l_run, seen, sink2, v_bar)
            else:
                out = tl.where(seen[:, None], o_run / tl.where(seen, l_run, 1.0)[:, None] + v_bar[None, :], 0.0)
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        seen = l_i != 0.0  # 0 only for rows that saw no key; NaN (non-finite input) stays NaN
        acc = acc * v_eq[None, :]
        if HAS_SINKS:
            out = _with_sink(acc, m_i, l_i, seen, sink2, v_bar)
        else:
            out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None] + v_bar[None, :], 0.0)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

