"""The kernel's parameters in three groups (as FA3's Mainloop/Epilogue/Scheduler Params and Gluon's attention
examples group theirs), built once in ``attention_kernel`` and handed to every role whole:

    Config    the compile-time switches and tile sizes (constexpr)
    Problem   the global tensors, their strides and the sizes: what the launch passes, by value
    Ring      the shared-memory stages the loader fills and the consumers read, with their barriers

An aggregate costs nothing at run time: its fields are passed as separate values, and the compiled kernel
is the one the fields passed one by one give. Each class has an explicit ``__init__`` (not every
supported Triton generates one), a ``constexpr_function`` (Triton 3.9 hashes no other), and annotations
of real types, not strings (older releases check each field against its annotation as written).
"""

from .gluon_api import aggregate, gl, gluon

# a runtime argument: a tensor, or a constexpr where the launch specializes it (an int equal to 1, a None pointer)
Value = gl.tensor | gl.constexpr


@gluon.constexpr_function
def _value(x):
    """A runtime argument as a field (a constexpr_function gets a specialized argument as a plain Python value)."""
    return x if isinstance(x, gl.tensor) else gl.constexpr(x)


@aggregate
class Config:
    """HEAD_DIM: the true head dim; D_PAD: padded to 64 or 128 (the buffers' width). BLOCK_M query rows a work
    item, BLOCK_N keys a tile, STAGES stages in the ring. QK_MAX: the INT8 range of Q̂ (127, or 7 for
    qattn-4b). P_LOG2: log2 of P's FP8 scale. PV_TILES: key tiles a P·V wgmma accumulator holds
    (mainloop.py). The switches: CAUSAL, HAS_KV_RANGE (KV_END is given), K_TOKEN_SCALE (δK per token, not
    per tile), RETURN_LSE, PERSISTENT (scheduler.py), SPLIT (K's split channel), and the attention variants
    (their sizes are runtime values in Problem): WINDOW (sliding window), CHUNK (chunked attention), SINKS
    (one extra logit per query head in the denominator, epilogue.py), SOFTCAP (c·tanh(s/c) on the scores).
    V_DITHER: V̂ was quantized with its tile dither (kernels/formats.py), whose log2 φ ΔS carries: l sums P / φ.
    CAUSAL_SPLIT: causal, the main loop split at the diagonal (mainloop.attend). SOLO: no loader warp; one
    warpgroup loads its own tiles and runs each tile's steps in turn, several CTAs an SM (mainloop.attend_solo).
    S_FLOAT_BY_ADD: the int32 scores become float32 by an integer add, not I2F (mainloop._softmax; per-tile δK,
    no SOFTCAP)."""
    HEAD_DIM: gl.constexpr
    D_PAD: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    QK_MAX: gl.constexpr
    CAUSAL: gl.constexpr
    HAS_KV_RANGE: gl.constexpr
    K_TOKEN_SCALE: gl.constexpr
    P_LOG2: gl.constexpr
    RETURN_LSE: gl.constexpr
    PERSISTENT: gl.constexpr
    SPLIT: gl.constexpr
    PV_TILES: gl.constexpr
    WINDOW: gl.constexpr
    CHUNK: gl.constexpr
    SINKS: gl.constexpr
    SOFTCAP: gl.constexpr
    V_DITHER: gl.constexpr
    CAUSAL_SPLIT: gl.constexpr
    SOLO: gl.constexpr
    S_FLOAT_BY_ADD: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, STAGES, QK_MAX, CAUSAL, HAS_KV_RANGE, K_TOKEN_SCALE,
                 P_LOG2, RETURN_LSE, PERSISTENT, SPLIT, PV_TILES, WINDOW, CHUNK, SINKS, SOFTCAP, V_DITHER,
                 CAUSAL_SPLIT, SOLO, S_FLOAT_BY_ADD):
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.D_PAD = gl.constexpr(D_PAD)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.STAGES = gl.constexpr(STAGES)
        self.QK_MAX = gl.constexpr(QK_MAX)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.HAS_KV_RANGE = gl.constexpr(HAS_KV_RANGE)
        self.K_TOKEN_SCALE = gl.constexpr(K_TOKEN_SCALE)
        self.P_LOG2 = gl.constexpr(P_LOG2)
        self.RETURN_LSE = gl.constexpr(RETURN_LSE)
        self.PERSISTENT = gl.constexpr(PERSISTENT)
        self.SPLIT = gl.constexpr(SPLIT)
        self.PV_TILES = gl.constexpr(PV_TILES)
        self.WINDOW = gl.constexpr(WINDOW)
        self.CHUNK = gl.constexpr(CHUNK)
        self.SINKS = gl.constexpr(SINKS)
        self.SOFTCAP = gl.constexpr(SOFTCAP)
        self.V_DITHER = gl.constexpr(V_DITHER)
        self.CAUSAL_SPLIT = gl.constexpr(CAUSAL_SPLIT)
        self.SOLO = gl.constexpr(SOLO)
        self.S_FLOAT_BY_ADD = gl.constexpr(S_FLOAT_BY_ADD)


@aggregate
class Problem:
    """Q (model dtype) and O by strides (b, h, n, d); the K/V pass's per-head vectors Q_BAR, K_BAR, V_BAR (the
    smoothing centers), V_SCALE (V's range per channel), KS (δK), SPLIT_CHANNEL (K's split channel per kv
    head); KV_END (per batch, with HAS_KV_RANGE); LSE (with RETURN_LSE). HQ query heads, GROUPS query heads
    per kv head, NQ/NK tokens, NK_PAD keys padded to whole tiles, NUM_TILES key tiles, NUM_ITEMS work
    items; KC_ROW0: the first kc row in the ΔS buffer. score_coef = sm_scale·log2 e. The variants' sizes (read
    only under their switch): window W and chunk C in keys, SINK (Hq,) logits (any float dtype) in the units of the
    true scores, softcap c."""
    Q: Value
    Q_BAR: Value
    K_BAR: Value
    V_BAR: Value
    V_SCALE: Value
    KS: Value
    SPLIT_CHANNEL: Value
    KV_END: Value
    O: Value
    LSE: Value
    stride_qb: Value
    stride_qh: Value
    stride_qn: Value
    stride_qd: Value
    stride_ob: Value
    stride_oh: Value
    stride_on: Value
    stride_od: Value
    HQ: Value
    GROUPS: Value
    NQ: Value
    NK: Value
    NK_PAD: Value
    NUM_TILES: Value
    NUM_ITEMS: Value
    KC_ROW0: Value
    score_coef: Value
    sm_scale: Value
    window: Value
    chunk: Value
    SINK: Value
    softcap: Value

    @gluon.constexpr_function
    def __init__(self, Q, Q_BAR, K_BAR, V_BAR, V_SCALE, KS, SPLIT_CHANNEL, KV_END, O, LSE, stride_qb, stride_qh,
                 stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od, HQ, GROUPS, NQ, NK, NK_PAD,
                 NUM_TILES, NUM_ITEMS, KC_ROW0, score_coef, sm_scale, window, chunk, SINK, softcap):
        self.Q = _value(Q)
        self.Q_BAR = _value(Q_BAR)
        self.K_BAR = _value(K_BAR)
        self.V_BAR = _value(V_BAR)
        self.V_SCALE = _value(V_SCALE)
        self.KS = _value(KS)
        self.SPLIT_CHANNEL = _value(SPLIT_CHANNEL)
        self.KV_END = _value(KV_END)
        self.O = _value(O)
        self.LSE = _value(LSE)
        self.stride_qb = _value(stride_qb)
        self.stride_qh = _value(stride_qh)
        self.stride_qn = _value(stride_qn)
        self.stride_qd = _value(stride_qd)
        self.stride_ob = _value(stride_ob)
        self.stride_oh = _value(stride_oh)
        self.stride_on = _value(stride_on)
        self.stride_od = _value(stride_od)
        self.HQ = _value(HQ)
        self.GROUPS = _value(GROUPS)
        self.NQ = _value(NQ)
        self.NK = _value(NK)
        self.NK_PAD = _value(NK_PAD)
        self.NUM_TILES = _value(NUM_TILES)
        self.NUM_ITEMS = _value(NUM_ITEMS)
        self.KC_ROW0 = _value(KC_ROW0)
        self.score_coef = _value(score_coef)
        self.sm_scale = _value(sm_scale)
        self.window = _value(window)
        self.chunk = _value(chunk)
        self.SINK = _value(SINK)
        self.softcap = _value(softcap)


@aggregate
class Ring:
    """STAGES stages of K̂ (BLOCK_N, D_PAD) int8, V̂ᵀ (D_PAD, BLOCK_N) FP8, ΔS and kc (BLOCK_N) fp32; ``ready[s]``:
    the loader's TMA delivered stage s, ``empty[s]``: every consumer warpgroup released it (loader.py)."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    ds: gl.shared_memory_descriptor
    kc: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k, v, ds, kc, ready, empty):
        self.k = k
        self.v = v
        self.ds = ds
        self.kc = kc
        self.ready = ready
        self.empty = empty
