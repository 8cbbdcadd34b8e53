"""The consumers: warpgroups of 64 query rows that turn K̂/V̂ᵀ tiles into an output (two a warp-specialized CTA,
or one SOLO CTA's).

Prologue (``quantize_q``): the warpgroup loads its Q rows in the model's dtype (any layout, by
strides), subtracts q̄ and quantizes each row to INT8 (±127, or ±7 for qattn-4b) with its own
scale: per token, finer than the paper's per warp and free here, since the scale multiplies a
row of S anyway. The INT8 rows go to shared memory, the A operand of every Q·Kᵀ wgmma.

Main loop (``attend``), FA3's intra-warpgroup order: while P·V of tile j runs on the tensor
cores, the softmax of tile j+1 runs on the FP32/MUFU units:

    issue  S(j+1) = Q̂·K̂(j+1)ᵀ          INT8 wgmma, int32 accumulator
    issue  O += P̂(j)·V̂ᵀ(j)             FP8 wgmma accumulating in O (P̂ from registers)
    wait   S(j+1);  softmax(j+1):  s = S·δQ·δK·sm_scale·log2 e + ΔS + qc·kc,  m, l,  P = 2^(s − m + log2 448)
                                   [S_FLOAT_BY_ADD: S → float by an integer add; s carries a row constant]
                                   [V_DITHER: ΔS includes log2 φ, V̂'s tile dither: l sums P / φ]
                                   (qc·kc: K's split channel, rank one; only for kv heads that have one)
                                   [SOFTCAP: s ← c·tanh(s_true / c)·log2 e, s_true = s / log2 e + sm_scale·q·k̄]
    wait   P·V(j);  release stage j;  O ·= 2^(m_old − m)
    every PV_TILES tiles:  O_smem = O_smem·2^(m_flush − m) + O;  O = 0      (two-level accumulation)

P is produced at the FP8 scale directly (448 = E4M3's largest value, folded into exp2). Keys are
relabelled inside each 32-key group (and V̂ᵀ's columns permuted to match by the K/V pass), so P
goes from the S accumulator registers to the P·V A operand without shuffles.

Two-level accumulation: Hopper's FP8 wgmma adds its products into the accumulator with fewer bits
than FP32, so the error of one accumulator grows with the tiles summed in it (measured on the H100:
RelL1 0.0032 at 4k keys, 0.0241 at 131k). The wgmma accumulator ``acc`` therefore holds at most
PV_TILES tiles; then it is added into ``o_smem``, an FP32 sum in shared memory kept at the row maximum
of its last flush (m_flush) and rescaled only when flushed. Shared memory, not registers: a second
64-register accumulator carried through the loop spilled the causal main loop.

SOLO (``attend_solo``): a CTA of one warpgroup that issues its own TMA loads and runs each tile's steps in
turn — S, softmax, P·V into a fresh accumulator, O = O·α + P·V in FP32 registers — three such CTAs an SM
overlapping one another's steps instead of the order above (eval/results/solo-*.md).

Variants (constexpr switches, off by default at no cost): WINDOW / CHUNK visit only the key tiles
[first, first + n) the scheduler gives, masking the tiles that cross a row's window or chunk start
(``first_key``) or the diagonal; the tiles between them run unmasked. SOFTCAP caps the true score:
the per-row term sm_scale·q·k̄ that K's smoothing took out (the ΔS term carries Q's smoothing) is added
back before the tanh, so capped scores are true scores (the epilogue adds no shift to their lse).
"""

from .. import formats
from .gluon_api import fence_async_shared, gl, gluon, mbarrier, partition_barrier, warpgroup_mma, warpgroup_mma_wait
from .loader import load_tile
from .scheduler import first_key

_ROUND_MAGIC = gl.constexpr(formats.ROUND_MAGIC)
_ROUND_MAGIC_BITS = gl.constexpr(formats.ROUND_MAGIC_BITS)
_LOG2E = gl.constexpr(formats.LOG2E)
_V_DITHER_LEVELS = gl.constexpr(formats.V_DITHER_LEVELS)
_V_DITHER_STEP = gl.constexpr(formats.V_DITHER_STEP)


@gluon.jit
def quantize_q(prob, cfg, q_smem, shift_smem, b, h, bhq, bhk, split_ptr, row0, BM: gl.constexpr,
               qk_layout: gl.constexpr, o_layout: gl.constexpr):
    """Q̂ into ``q_smem`` (the A operand of Q·Kᵀ); returns each row's score coefficient δQ·sm_scale·log2 e;
    with SPLIT, its part of the split channel's score term, (q_c − q̄_c)·sm_scale·log2 e (c from
    ``split_ptr``; 0 when it is −1); with SOFTCAP, its tanh offset 2·log2 e·sm_scale·q·k̄ / c (``_softcap``).
    A value whose switch is off is a placeholder (q_coef again) the compiler drops. With RETURN_LSE or SINKS
    (and no SOFTCAP), each row's sm_scale·q·k̄ goes to ``shift_smem`` for the epilogue."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, cfg.D_PAD, layout=gl.SliceLayout(0, blocked))
    inside = (rows < prob.NQ)[:, None] & (cols < cfg.HEAD_DIM)[None, :]
    base = prob.Q + b.to(gl.int64) * prob.stride_qb + h.to(gl.int64) * prob.stride_qh
    q = gl.load(base + rows.to(gl.int64)[:, None] * prob.stride_qn + cols[None, :] * prob.stride_qd, mask=inside,
                other=0.0).to(gl.float32)
    if cfg.RETURN_LSE or cfg.SINKS or cfg.SOFTCAP:  # the true scores less the kernel's: sm_scale·q·k̄ a row
        k_bar = gl.load(prob.K_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
        shift = gl.sum(q * k_bar[None, :], axis=1) * prob.sm_scale
    q_bar = gl.load(prob.Q_BAR + bhq * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
    qs = gl.where(inside, q - q_bar[None, :], 0.0)
    q_scale = gl.maximum(gl.max(gl.abs(qs), axis=1), 1e-30) / cfg.QK_MAX
    q_inv = gl.div_rn(gl.full([BM], 1.0, gl.float32, layout=gl.SliceLayout(1, blocked)), q_scale)  # see common.reciprocal
    qs_b, q_inv_b = gl.broadcast(qs, q_inv[:, None])
    # mul.rn: a product of its own, not fused into the rounding add (the reference rounds it first)
    scaled = gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [qs_b, q_inv_b], dtype=gl.float32,
                                       is_pure=True, pack=1)
    r = (scaled + _ROUND_MAGIC) - _ROUND_MAGIC
    # shared memory, not registers: 16 registers held all loop long spilled the main loop
    q_smem.store(gl.minimum(gl.maximum(r, -cfg.QK_MAX), cfg.QK_MAX).to(gl.int8))
    fence_async_shared()
    partition_barrier()  # the warpgroup's four warps wrote one operand
    # max and clamp drop NaN: a row holding NaN/Inf gets a NaN coefficient, so its output is NaN (as SDPA's)
    row_sum = gl.sum(qs, axis=1)
    finite = (row_sum == row_sum) & (gl.abs(row_sum) < float("inf"))
    q_coef = gl.where(finite, q_scale * prob.score_coef, float("nan"))
    q_split = q_coef
    if cfg.SPLIT:
        q_split = gl.sum(gl.where((cols == gl.load(split_ptr))[None, :], qs, 0.0), axis=1) * prob.score_coef
    q_cap = q_coef
    if cfg.SOFTCAP:
        q_cap = shift * ((2.0 * _LOG2E) / prob.softcap)
    elif cfg.RETURN_LSE or cfg.SINKS:
        shift_smem.store(gl.convert_layout(shift, gl.SliceLayout(1, o_layout)))  # read back by these threads
    row: gl.constexpr = gl.SliceLayout(1, qk_layout)
    return gl.convert_layout(q_coef, row), gl.convert_layout(q_split, row), gl.convert_layout(q_cap, row)


@gluon.jit
def _k_scale(cfg, KS_bh, tile, col: gl.constexpr):
    """δK of the tile: its one scale (a scalar, loaded before the Q·Kᵀ wait hides its latency), or per token."""
    if cfg.K_TOKEN_SCALE:
        return gl.load(KS_bh + tile * cfg.BLOCK_N + gl.arange(0, cfg.BLOCK_N, layout=col))
    else:
        return gl.load(KS_bh + tile)


@gluon.jit
def _v_dither(tile):
    """φ of key tile ``tile``: V̂'s tile was quantized with δV·φ (kernels/common.py v_dither, the same formula)."""
    return 1.0 + ((tile * _V_DITHER_STEP) % _V_DITHER_LEVELS).to(gl.float32) / _V_DITHER_LEVELS


@gluon.jit
def _scaling_max(m):
    """The row maximum P and O are scaled to: m, or 0 for a row that has seen no key yet (m = −inf)."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _softcap(s, q_cap, cap_in, cap_out):
    """c·tanh(s_true / c)·log2 e from a kernel score s (base 2, smoothed): with x = s_true / c,
    tanh x = 1 − 2 / (e^{2x} + 1) and e^{2x} = 2^{s·(2/c) + q_cap} (``cap_in`` = 2/c, ``cap_out`` = c·log2 e).
    Through exp2 rather than tanh.approx: its 2^−11 error, times c, would move the weights by percents.
    A masked score (−inf) stays −inf (the formula would give −c)."""
    e = gl.exp2(s * cap_in + q_cap[:, None])
    return gl.where(s == float("-inf"), s, cap_out - (2.0 * cap_out) / (e + 1.0))


@gluon.jit
def _softmax(cfg, prob, qk, q_coef, q_split, q_cap, cap_in, cap_out, ds, kc_tile, k_scale, m_i, l_i, tile,
             first_row, row0, lo_last, BM: gl.constexpr, qk_layout: gl.constexpr, MASK: gl.constexpr):
    """One tile of the online softmax in base 2; P comes out at the FP8 scale (×448). ``lo_last``: the first
    key the warpgroup's last row sees (WINDOW / CHUNK): a tile starting left of it crosses some row's start.
    ``MASK``: the tile may cross the diagonal or a window / chunk start (checked here); False: it does not."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    NQ = prob.NQ
    NK = prob.NK
    offset = 0.0  # S_FLOAT_BY_ADD: what s holds above the true score, the same for every key of a row
    if cfg.K_TOKEN_SCALE:
        s = qk.to(gl.float32) * (q_coef[:, None] * k_scale[None, :]) + ds[None, :]
    elif cfg.S_FLOAT_BY_ADD:
        # S + 1.5·2^23's bits read as float32 are 1.5·2^23 + S exactly (|S| < 2^22): an integer add, where I2F
        # would take the quarter-rate unit that exp2 needs; the 1.5·2^23·δ it adds is a row constant, kept in s
        # (one FFMA an element, as before) and taken out of the row maximum below
        coef = q_coef * k_scale
        s = (qk + _ROUND_MAGIC_BITS).to(gl.float32, bitcast=True) * coef[:, None] + ds[None, :]
        offset = coef * _ROUND_MAGIC
    else:
        s = qk.to(gl.float32) * (q_coef * k_scale)[:, None] + ds[None, :]
    if cfg.SPLIT:  # the rank-one term of K's split channel (kc and q_split are 0 for kv heads without one)
        s += q_split[:, None] * kc_tile.load(gl.SliceLayout(0, qk_layout))[None, :]
    if cfg.SOFTCAP:
        s = _softcap(s, q_cap, cap_in, cap_out)
    # keys outside [kv_start, kv_end) and padding keys already hold ΔS = −inf (the K/V pass wrote it);
    # only the causal diagonal (and a window's or chunk's start) is masked here, in the few tiles that cross it
    start = tile * BLOCK_N
    if not MASK:
        pass
    elif cfg.WINDOW or cfg.CHUNK:
        if (start + BLOCK_N > first_row + (NK - NQ) + 1) | (start < lo_last):
            offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
            pos = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, qk_layout)) + (NK - NQ)
            visible = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] >= first_key(prob, cfg, pos)[:, None])
            s = gl.where(visible, s, float("-inf"))
    elif cfg.CAUSAL:
        # CAUSAL_SPLIT: this loop runs only the tiles at the diagonal, each masked without a test. Positions compare
        # as floats (exact below 2^24): with int32 indices Triton 3.9 kept the tile's 32 column indices a thread
        # live across both loops of a SOLO CTA and spilled them (or its output) into local memory every tile
        if cfg.CAUSAL_SPLIT or (start + BLOCK_N > first_row + (NK - NQ) + 1):
            offs_n = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))).to(gl.float32)
            offs_m = (row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, qk_layout))).to(gl.float32)
            s = gl.where(offs_n[None, :] <= offs_m[:, None] + (NK - NQ), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) - offset)
    m_use = _scaling_max(m_new)
    p = gl.exp2(s - (m_use + offset - cfg.P_LOG2)[:, None])
    alpha = gl.exp2(m_i - m_use)
    if cfg.V_DITHER:  # P carries the tile's dither φ (ΔS holds log2 φ, so m includes it and P̂ ≤ 448); l does not
        l_i = l_i * alpha + gl.fdiv(gl.sum(p, axis=1), _v_dither(tile))
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _p_fp8(p, BM: gl.constexpr, BLOCK_N: gl.constexpr):
    """P (fp32, S accumulator layout) → FP8, keys relabelled within 32-key groups as V̂ᵀ's columns are."""
    p8 = gl.reshape(p.to(gl.float8e4nv), [BM, BLOCK_N // 32, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(p8, [0, 1, 2, 4, 5, 3, 6]), [BM, BLOCK_N])


@gluon.jit
def _p_operand(p, BM: gl.constexpr, BLOCK_N: gl.constexpr, p_layout: gl.constexpr):
    """P → the FP8 register A operand of P·V (the relabelling makes the conversion a no-op)."""
    return gl.convert_layout(_p_fp8(p, BM, BLOCK_N), p_layout, assert_trivial=True)


@gluon.jit
def _flushed(o_smem, m_smem, acc, m_i, first, o_layout: gl.constexpr):
    """O_smem·2^(m_flush − m) + acc: the sum so far at the current row maximum m_i (acc is at m_i already;
    O_smem at m_flush, the row maximum of the last flush, kept beside it in ``m_smem``). ``first``:
    nothing of this item is in shared memory yet (it is not read).

    A row that had seen no key at the last flush (causal with Nq > Nk, left padding) has m_flush = −inf
    and a zero sum: its factor is 0. Otherwise m_i ≥ m_flush, so the factor is at most 1."""
    if first:
        return acc
    row: gl.constexpr = gl.SliceLayout(1, o_layout)
    factor = gl.exp2(m_smem.load(row) - gl.convert_layout(_scaling_max(m_i), row))  # acc is at _scaling_max(m_i)
    return o_smem.load(o_layout) * factor[:, None] + acc


@gluon.jit
def _variant_constants(cfg, prob, row0, BM: gl.constexpr):
    """The variants' per-item constants of the softmax (0 where their switch is off): ``lo_last``, the first key
    the warpgroup's last row sees (WINDOW / CHUNK), and SOFTCAP's ``cap_in`` = 2/c, ``cap_out`` = c·log2 e."""
    lo_last = 0
    if cfg.WINDOW or cfg.CHUNK:
        lo_last = first_key(prob, cfg, row0 + BM - 1 + (prob.NK - prob.NQ))
    cap_in = 0.0
    cap_out = 0.0
    if cfg.SOFTCAP:
        cap_in = 2.0 / prob.softcap
        cap_out = prob.softcap * _LOG2E
    return lo_last, cap_in, cap_out


@gluon.jit
def _steps(cfg, prob, ring, q_smem, o_smem, m_smem, KS_bh, q_coef, q_split, q_cap, cap_in, cap_out,
           qk_zero, base, first, lo, hi, acc, p, m_i, l_i, first_row, row0, lo_last, BM: gl.constexpr,
           qk_layout: gl.constexpr, o_layout: gl.constexpr, MASK: gl.constexpr):
    """The main loop's steps i in [lo, hi): S of tile i + 1 and P·V of tile i on the tensor cores, the softmax of
    tile i + 1 meanwhile; every PV_TILES tiles the accumulator is flushed first. Returns (acc, P, m, l)."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    PV_TILES: gl.constexpr = cfg.PV_TILES
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    col: gl.constexpr = gl.SliceLayout(0, qk_layout)
    for i in range(lo, hi):
        s = (base + i) % STAGES
        s1 = (base + i + 1) % STAGES
        # flush before P is packed: P's FP8 operand live across the branch is split into bytes by the
        # lowering (+130 SASS instructions a tile on the path that does not flush)
        if (i % PV_TILES == 0) & (i > 0):
            o_smem.store(_flushed(o_smem, m_smem, acc, m_i, i == PV_TILES, o_layout))
            m_smem.store(gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)))  # read back by these threads
            acc = gl.zeros([BM, cfg.D_PAD], gl.float32, layout=o_layout)
        p8 = _p_operand(p, BM, BLOCK_N, p_layout)
        k_scale = _k_scale(cfg, KS_bh, first + i + 1, col)
        mbarrier.wait(ring.ready.index(s1), ((base + i + 1) // STAGES) & 1)
        qk = warpgroup_mma(q_smem, ring.k.index(s1).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p8, ring.v.index(s).permute((1, 0)), acc, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
        ds = ring.ds.index(s1).load(col)
        p_next, alpha, m_i, l_i = _softmax(cfg, prob, qk, q_coef, q_split, q_cap, cap_in, cap_out, ds,
                                           ring.kc.index(s1), k_scale, m_i, l_i, first + i + 1, first_row, row0,
                                           lo_last, BM, qk_layout, MASK)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty.index(s), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = p_next
    return acc, p, m_i, l_i


@gluon.jit
def attend(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, o_smem, m_smem, KS_bh, base, first, n, first_row,
           row0, BM: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr):
    """The main loop over the n key tiles [first, first + n): returns (O unnormalized, l, m). ``base`` counts
    the ring's tiles before this work item (the ring runs on across a persistent CTA's items): the item's
    i-th tile sits in stage (base + i) % STAGES. ``first`` is 0 unless WINDOW or CHUNK.

    CAUSAL_SPLIT (causal, no window or chunk): two loops, the tiles left of the CTA's first row's diagonal
    without the mask's code, then the few that cross it (eval/results/causal-split-*.md, one-consumer-*.md); the
    launch picks it by key count and head dim (kernels.json CAUSAL_SPLIT_FROM).
    """
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    PV_TILES: gl.constexpr = cfg.PV_TILES
    MASKED: gl.constexpr = cfg.CAUSAL or cfg.WINDOW or cfg.CHUNK
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row: gl.constexpr = gl.SliceLayout(1, qk_layout)
    col: gl.constexpr = gl.SliceLayout(0, qk_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row)
    l_i = gl.full([BM], 0.0, gl.float32, layout=row)
    acc = gl.zeros([BM, cfg.D_PAD], gl.float32, layout=o_layout)  # the wgmma accumulator: ≤ PV_TILES tiles
    qk_zero = gl.zeros([BM, BLOCK_N], gl.int32, layout=qk_layout)
    lo_last, cap_in, cap_out = _variant_constants(cfg, prob, row0, BM)
    if n > 0:
        k_scale = _k_scale(cfg, KS_bh, first, col)
        s0 = base % STAGES
        mbarrier.wait(ring.ready.index(s0), (base // STAGES) & 1)
        ds = ring.ds.index(s0).load(col)  # ΔS of the tile's keys, brought by the loader
        qk = warpgroup_mma(q_smem, ring.k.index(s0).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        p, alpha, m_i, l_i = _softmax(cfg, prob, qk, q_coef, q_split, q_cap, cap_in, cap_out, ds, ring.kc.index(s0),
                                      k_scale, m_i, l_i, first, first_row, row0, lo_last, BM, qk_layout, MASKED)
        # P is carried in fp32 and packed to FP8 where it is used: a loop-carried fp8 tensor is split
        # into bytes by the lowering (about 200 extra instructions a tile).
        if cfg.CAUSAL_SPLIT:
            # tiles [0, n_plain) end left of the first row's diagonal; the step of index i runs tile i + 1's softmax
            n_plain = gl.minimum(gl.maximum(first_row + (prob.NK - prob.NQ) + 1, 0) // BLOCK_N, n)
            acc, p, m_i, l_i = _steps(cfg, prob, ring, q_smem, o_smem, m_smem, KS_bh, q_coef, q_split, q_cap,
                                      cap_in, cap_out, qk_zero, base, first, 0, n_plain - 1, acc, p, m_i, l_i,
                                      first_row, row0, lo_last, BM, qk_layout, o_layout, False)
            acc, p, m_i, l_i = _steps(cfg, prob, ring, q_smem, o_smem, m_smem, KS_bh, q_coef, q_split, q_cap,
                                      cap_in, cap_out, qk_zero, base, first, gl.maximum(n_plain - 1, 0), n - 1, acc,
                                      p, m_i, l_i, first_row, row0, lo_last, BM, qk_layout, o_layout, True)
        else:
            acc, p, m_i, l_i = _steps(cfg, prob, ring, q_smem, o_smem, m_smem, KS_bh, q_coef, q_split, q_cap,
                                      cap_in, cap_out, qk_zero, base, first, 0, n - 1, acc, p, m_i, l_i, first_row,
                                      row0, lo_last, BM, qk_layout, o_layout, MASKED)
        s = (base + n - 1) % STAGES
        acc = warpgroup_mma(_p_operand(p, BM, BLOCK_N, p_layout), ring.v.index(s).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty.index(s), count=1)
        if n > PV_TILES + 1:  # a flush happened (at tile PV_TILES < n − 1)
            acc = _flushed(o_smem, m_smem, acc, m_i, False, o_layout)
    return acc, l_i, m_i


@gluon.jit
def _solo_steps(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, cap_in, cap_out, KS_bh, k_desc, vt_desc, ds_desc,
                rows, qk_zero, pv_zero, first, n, lo, hi, o, m_i, l_i, first_row, row0, lo_last, BM: gl.constexpr,
                qk_layout: gl.constexpr, o_layout: gl.constexpr, MASK: gl.constexpr):
    """SOLO's tiles i in [lo, hi) of the item's n: wait for stage i % STAGES, S = Q̂·K̂ᵀ, softmax, P̂·V̂ᵀ into a
    fresh wgmma accumulator (S's registers are dead by then), refill the stage with tile i + STAGES, and
    O = O·2^(m_old − m) + P̂·V̂ᵀ. Returns (O, m, l)."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    col: gl.constexpr = gl.SliceLayout(0, qk_layout)
    for i in range(lo, hi):
        s = i % STAGES
        k_scale = _k_scale(cfg, KS_bh, first + i, col)
        mbarrier.wait(ring.ready.index(s), (i // STAGES) & 1)
        qk = warpgroup_mma(q_smem, ring.k.index(s).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        ds = ring.ds.index(s).load(col)
        p, alpha, m_i, l_i = _softmax(cfg, prob, qk, q_coef, q_split, q_cap, cap_in, cap_out, ds, ring.kc.index(s),
                                      k_scale, m_i, l_i, first + i, first_row, row0, lo_last, BM, qk_layout, MASK)
        pv = warpgroup_mma(_p_operand(p, BM, BLOCK_N, p_layout), ring.v.index(s).permute((1, 0)), pv_zero,
                           use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        partition_barrier()  # all four warps are done with stage s (ΔS by loads, K̂ and V̂ᵀ by their wgmmas)
        if i + STAGES < n:
            load_tile(cfg, ring, k_desc, vt_desc, ds_desc, s, (first + i + STAGES) * BLOCK_N, rows)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None] + pv
    return o, m_i, l_i


@gluon.jit
def attend_solo(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, KS_bh, k_desc, vt_desc, ds_desc, rows, first, n,
                first_row, row0, BM: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr):
    """SOLO: one warpgroup that loads its own key tiles and runs each tile's steps one after another, as
    SageAttention2's sm90 kernel does — three such CTAs share an SM and overlap one another's steps, where the
    warp-specialized CTA overlaps a loader and consumers on one ring. The FP32 output lives in registers and each
    tile's P̂·V̂ᵀ is added into it (two-level accumulation at one tile, one FFMA an element, no flush to shared
    memory). The first STAGES tiles are in flight before the loop; CAUSAL_SPLIT runs the tiles left of the first
    row's diagonal without the mask's code, as ``attend``. Returns (O unnormalized, l, m) as ``attend``."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    STAGES: gl.constexpr = cfg.STAGES
    MASKED: gl.constexpr = cfg.CAUSAL or cfg.WINDOW or cfg.CHUNK
    row: gl.constexpr = gl.SliceLayout(1, qk_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row)
    l_i = gl.full([BM], 0.0, gl.float32, layout=row)
    o = gl.zeros([BM, cfg.D_PAD], gl.float32, layout=o_layout)
    qk_zero = gl.zeros([BM, BLOCK_N], gl.int32, layout=qk_layout)
    pv_zero = gl.zeros([BM, cfg.D_PAD], gl.float32, layout=o_layout)
    lo_last, cap_in, cap_out = _variant_constants(cfg, prob, row0, BM)
    for j in gl.static_range(STAGES):
        if j < n:
            load_tile(cfg, ring, k_desc, vt_desc, ds_desc, j, (first + j) * BLOCK_N, rows)
    if cfg.CAUSAL_SPLIT:
        n_plain = gl.minimum(gl.maximum(first_row + (prob.NK - prob.NQ) + 1, 0) // BLOCK_N, n)
        o, m_i, l_i = _solo_steps(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, cap_in, cap_out, KS_bh, k_desc,
                                  vt_desc, ds_desc, rows, qk_zero, pv_zero, first, n, 0, n_plain, o, m_i, l_i,
                                  first_row, row0, lo_last, BM, qk_layout, o_layout, False)
        o, m_i, l_i = _solo_steps(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, cap_in, cap_out, KS_bh, k_desc,
                                  vt_desc, ds_desc, rows, qk_zero, pv_zero, first, n, n_plain, n, o, m_i, l_i,
                                  first_row, row0, lo_last, BM, qk_layout, o_layout, True)
    else:
        o, m_i, l_i = _solo_steps(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, cap_in, cap_out, KS_bh, k_desc,
                                  vt_desc, ds_desc, rows, qk_zero, pv_zero, first, n, 0, n, o, m_i, l_i, first_row,
                                  row0, lo_last, BM, qk_layout, o_layout, MASKED)
    return o, l_i, m_i
