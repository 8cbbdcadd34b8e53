"""The kernel: SOLO CTAs (tuning.hopper_solo: one warpgroup of 64 query rows that loads its own key tiles,
``mainloop.attend_solo``, three an SM: head dims up to 128), or warp-specialized CTAs of two consumer warpgroups
of 64 query rows (``consumer``, FA3's "MMA + softmax" role) and one loader warp (``load_kv``), meeting on a ring
of STAGES shared-memory stages (head dim 256, persistent grids). A work item is 64·CONSUMERS query rows of one
batch·query-head; the scheduler (``scheduler.py``) deals items to CTAs, one each, or, with PERSISTENT, many to
each of one CTA per SM.

Inputs besides Q (model dtype, any layout by strides) come from the K/V pass
(``kernels/quantize.py``), in buffers padded to whole key tiles (BLOCK_N: 128, or 64 at head dim 256) and
head dims of 64, 128 or 256:
K̂ int8 (B·Hk·NK_PAD, D_PAD) with δK per tile (or per token), V̂ᵀ FP8 (B·Hk·D_PAD, NK_PAD) with
keys permuted inside 32-key groups and V's per-channel range, ΔS per (query head, key) and the split
channel of K per (kv head, key) — through TMA descriptors, loaded by the loader warp — and the
smoothing centers. SPLIT (an option, ``qattn(split_channel=True)``): K's split channel per kv head
adds its rank-one term to the scores (kernels/quantize.py says which channel and why). GQA/MQA: query head
h reads K/V head h // GROUPS, no copies. The attention variants (sliding WINDOW, CHUNK, SINKS, SOFTCAP; the
semantics of ``hf_qattn.qattn``) are switches too: the scheduler narrows each item's key tiles, the
consumers mask and cap scores, the epilogue adds the sinks.
"""

from .epilogue import store_output
from .gluon_api import gl, gluon, mbarrier
from .loader import load_kv, tile_rows
from .mainloop import attend, attend_solo, quantize_q
from .params import Config, Problem, Ring
from .scheduler import item_range, key_tiles, work_item

CONSUMER_REGISTERS = gl.constexpr(232)  # of the 64K per SM: 2 consumer warpgroups × 232 + 1 loader warp × 24
# head dim 256: a consumer holds a 64×256 FP32 output, 128 registers a thread. The second consumer is a worker
# partition with this count, the first the default partition, which gets what the workers leave (256 at most):
# 232 spilled the worker, 248 left the default 240 and spilled it; 240 leaves it 248 and spills neither
CONSUMER_REGISTERS_D256 = gl.constexpr(240)
LOADER_REGISTERS = gl.constexpr(24)
# SOLO (one warpgroup, no loader) takes no warp_specialize register split: the launch caps its registers a thread
# (kernels.json SOLO_REGISTERS, tuning.hopper_register_cap) so that several CTAs share an SM


@gluon.jit
def consume_item(t, base, cfg, prob, ring, q_smem, o_smem, m_smem, shift_smem, descs,
                 WARPGROUP: gl.constexpr):
    """One work item's 64 rows of this warpgroup: Q prologue, main loop, epilogue. Returns the ring
    position after it (``base`` + its key tiles, counted as the loader counts them)."""
    BM: gl.constexpr = 64
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, cfg.BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, cfg.D_PAD, 32])
    m_block, bhq = work_item(t, prob, cfg)
    b = bhq // prob.HQ
    h = bhq % prob.HQ
    bhk = b * (prob.HQ // prob.GROUPS) + h // prob.GROUPS
    first, end = key_tiles(prob, cfg, b, m_block)
    if cfg.K_TOKEN_SCALE:
        KS_bh = prob.KS + bhk.to(gl.int64) * prob.NK_PAD
    else:
        KS_bh = prob.KS + bhk.to(gl.int64) * prob.NUM_TILES
    cta_row0 = m_block * cfg.BLOCK_M
    row0 = cta_row0 + WARPGROUP * BM
    q_coef, q_split, q_cap = quantize_q(prob, cfg, q_smem, shift_smem, b, h, bhq, bhk, prob.SPLIT_CHANNEL + bhk,
                                        row0, BM, qk_layout, o_layout)
    if cfg.SOLO:
        k_desc, vt_desc, ds_desc = descs
        acc, l_i, m_i = attend_solo(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, KS_bh, k_desc, vt_desc, ds_desc,
                                    tile_rows(prob, cfg, bhq, bhk), first, end - first, cta_row0, row0, BM,
                                    qk_layout, o_layout)
    else:
        acc, l_i, m_i = attend(cfg, prob, ring, q_smem, q_coef, q_split, q_cap, o_smem, m_smem, KS_bh, base,
                               first, end - first, cta_row0, row0, BM, qk_layout, o_layout)
    store_output(prob, cfg, acc, l_i, m_i, shift_smem, b, h, bhq, bhk, row0, BM, o_layout)
    return base + (end - first)


@gluon.jit
def consumer(cfg, prob, ring, q_all, o_all, m_all, shift_all, WARPGROUP: gl.constexpr, descs=None):
    q_smem = q_all.index(WARPGROUP)
    o_smem = o_all.index(WARPGROUP)
    m_smem = m_all.index(WARPGROUP)
    shift_smem = shift_all.index(WARPGROUP)
    if cfg.PERSISTENT:
        first, step = item_range(prob.NUM_ITEMS, cfg.PERSISTENT)
        base = 0  # the ring's tiles consumed before this item (the loader counts alike)
        for t in range(first, prob.NUM_ITEMS, step):
            base = consume_item(t, base, cfg, prob, ring, q_smem, o_smem, m_smem, shift_smem, descs,
                                WARPGROUP)
    else:
        consume_item(gl.program_id(0), 0, cfg, prob, ring, q_smem, o_smem, m_smem, shift_smem, descs,
                     WARPGROUP)


@gluon.jit
def attention_kernel(
    Q, k_desc, vt_desc, ds_desc, KS, SPLIT_CHANNEL, Q_BAR, K_BAR, V_BAR, V_SCALE, KV_END, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
    HQ, GROUPS, NQ, NK, NK_PAD, NUM_TILES, NUM_ITEMS, KC_ROW0, score_coef, sm_scale, window, chunk, SINK, softcap,
    HEAD_DIM: gl.constexpr, D_PAD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    QK_MAX: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_RANGE: gl.constexpr, K_TOKEN_SCALE: gl.constexpr,
    P_LOG2: gl.constexpr, RETURN_LSE: gl.constexpr, PERSISTENT: gl.constexpr,
    SPLIT: gl.constexpr, PV_TILES: gl.constexpr, CONSUMERS: gl.constexpr,
    WINDOW: gl.constexpr, CHUNK: gl.constexpr, SINKS: gl.constexpr, SOFTCAP: gl.constexpr, V_DITHER: gl.constexpr,
    CAUSAL_SPLIT: gl.constexpr, SOLO: gl.constexpr, S_FLOAT_BY_ADD: gl.constexpr,
):
    # the launch binds the arguments by name; the roles get them in three groups (params.py)
    gl.static_assert(not (SOLO and PERSISTENT), "a SOLO CTA runs one work item (its ring restarts at each)")
    gl.static_assert(not (CAUSAL_SPLIT and (WINDOW or CHUNK)), "the split counts tiles from key 0, not a span's start")
    gl.static_assert(not (S_FLOAT_BY_ADD and (SOFTCAP or K_TOKEN_SCALE)),
                     "the cap needs true scores, and δK per token would make the offset per element")
    gl.static_assert((SOLO and CONSUMERS == 1) or (not SOLO and CONSUMERS == 2),
                     "a SOLO CTA is one warpgroup; a warp-specialized one has two")
    BLOCK_M: gl.constexpr = 64 * CONSUMERS  # query rows of a work item
    cfg = Config(HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, STAGES, QK_MAX, CAUSAL, HAS_KV_RANGE, K_TOKEN_SCALE, P_LOG2,
                 RETURN_LSE, PERSISTENT, SPLIT, PV_TILES, WINDOW, CHUNK, SINKS, SOFTCAP, V_DITHER, CAUSAL_SPLIT, SOLO,
                 S_FLOAT_BY_ADD)
    prob = Problem(Q, Q_BAR, K_BAR, V_BAR, V_SCALE, KS, SPLIT_CHANNEL, KV_END, O, LSE, stride_qb, stride_qh,
                   stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od, HQ, GROUPS, NQ, NK, NK_PAD,
                   NUM_TILES, NUM_ITEMS, KC_ROW0, score_coef, sm_scale, window, chunk, SINK, softcap)
    q_all = gl.allocate_shared_memory(gl.int8, [CONSUMERS, 64, D_PAD],
                                      gl.NVMMASharedLayout.get_default_for([64, D_PAD], gl.int8))
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D_PAD], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D_PAD, BLOCK_N], vt_desc.layout)
    ds_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ds_desc.layout)
    kc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ds_desc.layout)  # split channel of K
    # each consumer warpgroup's row maxima at its FP32 output sum's last flush
    m_all = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if SOLO:  # its FP32 output lives in registers (mainloop.attend_solo)
        o_all = m_all
    else:  # each consumer warpgroup's FP32 output sum (two-level accumulation, mainloop.py)
        o_all = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64, D_PAD],
                                          gl.NVMMASharedLayout.get_default_for([64, D_PAD], gl.float32))
    # each row's sm_scale·q·k̄ from the prologue for the epilogue (the lse and the sinks need it): shared memory,
    # not registers (two registers a row all loop long spilled), nor Q read again (at head dim 256 the
    # reloaded rows beside the accumulator spilled the epilogue); m_all stands in where nothing needs it
    if RETURN_LSE or SINKS:
        shift_all = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        shift_all = m_all
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer warpgroup releases a stage
    ring = Ring(k_smem, v_smem, ds_smem, kc_smem, kv_ready, kv_empty)

    if SOLO:  # no partitions: the one warpgroup loads its tiles itself
        consumer(cfg, prob, ring, q_all, o_all, m_all, shift_all, 0, (k_desc, vt_desc, ds_desc))
    else:
        gl.warp_specialize([
            (consumer, (cfg, prob, ring, q_all, o_all, m_all, shift_all, 0)),
            (consumer, (cfg, prob, ring, q_all, o_all, m_all, shift_all, 1)),
            (load_kv, (cfg, prob, ring, k_desc, vt_desc, ds_desc)),
        ], [4, 1], [CONSUMER_REGISTERS_D256 if D_PAD > 128 else CONSUMER_REGISTERS, LOADER_REGISTERS])
