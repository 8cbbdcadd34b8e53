"""Small Triton helpers shared by the kernels."""

import triton
import triton.language as tl

from . import formats

# Adding and subtracting 1.5·2^23 leaves a float32 rounded to the nearest integer, ties to even,
# for |x| < 2^22 — the same rounding as torch.round, and it also runs under TRITON_INTERPRET.
_ROUND_MAGIC = tl.constexpr(formats.ROUND_MAGIC)
_ROUND_MAGIC_BITS = tl.constexpr(formats.ROUND_MAGIC_BITS)  # see formats

# Scales never go below this, so an all-zero group quantizes to zeros instead of NaN.
SCALE_FLOOR = tl.constexpr(formats.SCALE_FLOOR)
FP8_MAX = tl.constexpr(formats.FP8_E4M3_MAX)
_V_DITHER_LEVELS = tl.constexpr(formats.V_DITHER_LEVELS)
_V_DITHER_STEP = tl.constexpr(formats.V_DITHER_STEP)
LOG2E = tl.constexpr(formats.LOG2E)  # the softmax runs in base 2
KV_GROUP = tl.constexpr(formats.KV_GROUP)  # the KV cache's grouped formats: tokens a group (see formats)
V_OFFSET = tl.constexpr(formats.KV_V_OFFSET)  # the KV cache's per-token V, offset binary (see formats)
V_TILE = tl.constexpr(formats.KV_V_TILE)  # ... and channel-major in tiles of this many tokens
INT4_LEVELS = tl.constexpr(formats.KV_GROUP_LEVELS["int4"])
G8_LEVELS = tl.constexpr(formats.KV_GROUP_LEVELS["int8g"])
INT4_DIRECTED = tl.constexpr(formats.KV_GROUP_DIRECTED["int4"])
G8_DIRECTED = tl.constexpr(formats.KV_GROUP_DIRECTED["int8g"])
INT4_DITHERED = tl.constexpr(formats.KV_GROUP_DITHERED["int4"])
G8_DITHERED = tl.constexpr(formats.KV_GROUP_DITHERED["int8g"])
_DITHER_STRIDE = tl.constexpr(formats.KV_GROUP_DITHER_STRIDE)


@triton.jit
def round_half_even(x):
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def int32_to_float(x):
    """Exact for |x| < 2^22 (an INT8 Q·Kᵀ over head_dim ≤ 256 stays below 127²·256 < 2^22)."""
    return (x + _ROUND_MAGIC_BITS).to(tl.float32, bitcast=True) - _ROUND_MAGIC


@triton.jit
def reciprocal(scale):
    """1 / scale, correctly rounded. Every quantizer multiplies by it instead of dividing each value:
    one IEEE division per scale instead of one per value (a division is a dozen instructions; the
    references in hf_qattn.quant compute the same reciprocal, so both round alike)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def mul_rn(x, y, INTERPRETED: tl.constexpr):
    """x · y rounded to float32 on its own: a compiled kernel would otherwise fuse the product into
    the rounding add below (one FMA, one rounding), and round differently from the reference at
    ties. The interpreter (numpy) never fuses."""
    if INTERPRETED:
        return x * y
    else:
        x, y = tl.broadcast(x, y)
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def quantize_symmetric(x, scale, QMAX: tl.constexpr, INTERPRETED: tl.constexpr):
    """int8 holding round(x · (1 / scale)), for ``scale`` = max |x| of x's group / QMAX (broadcasts against x)."""
    # no clamp: scale is the group's max |x| / QMAX, so |x · (1 / scale)| rounds to at most QMAX (a
    # NaN/Inf group gets a NaN scale from the caller, whatever its integers hold)
    return round_half_even(mul_rn(x, reciprocal(scale), INTERPRETED)).to(tl.int8)


@triton.jit
def scale_to_fp8(x, scale, GRID_ROUND: tl.constexpr):
    """FP8 E4M3 holding x · (1 / scale); ``scale`` broadcasts against ``x``."""
    return to_fp8_e4m3(x * reciprocal(scale), GRID_ROUND)


@triton.jit
def to_fp8_e4m3(x, GRID_ROUND: tl.constexpr):
    """float32 → FP8 E4M3, round to nearest even (inputs already within ±448).

    With GRID_ROUND the value is first rounded onto the E4M3 grid in float32, so the cast is
    exact: Triton's interpreter (3.9) drops the carry when rounding crosses a power of two
    (124.6 → 64). Compiled kernels use the hardware conversion and pass GRID_ROUND=False.
    """
    if GRID_ROUND:
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = tl.maximum(exponent, -6)  # below 2^-6 the grid is the subnormal step 2^-9
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        x = round_half_even(x / step) * step
    return x.to(tl.float8e4nv)


@triton.jit
def to_bf16(x, GRID_ROUND: tl.constexpr):
    """float32 → bf16, round to nearest even (finite inputs). With GRID_ROUND the float32 bits are rounded to
    bf16's first 16 first, so the cast is exact: Triton's interpreter (3.9) truncates instead."""
    if GRID_ROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def to_bf16_toward(x, UP: tl.constexpr, GRID_ROUND: tl.constexpr):
    """float32 → bf16 rounded up (toward +∞) or down, as ``kv_cache.reference._bf16_toward``: to nearest, then
    one bf16 step the other way where that went past x (NaN stays NaN: it compares false)."""
    r = to_bf16(x, GRID_ROUND)
    bits = r.to(tl.int16, bitcast=True)
    if UP:
        past = r.to(tl.float32) < x
        away = bits >= 0
    else:
        past = r.to(tl.float32) > x
        away = bits < 0
    return tl.where(past, tl.where(away, bits + 1, bits - 1).to(tl.bfloat16, bitcast=True), r)


@triton.jit
def group_dither(r):
    """φ_r of row r (0 ≤ r < KV_GROUP) of a dithered group (formats.KV_GROUP_DITHERED says why); exact in
    float32, so the PyTorch reference (``kv_cache.reference.group_dither``) rounds alike."""
    return (((r * _DITHER_STRIDE) % KV_GROUP).to(tl.float32) + 0.5) / KV_GROUP


@triton.jit
def v_dither(tile):
    """φ_t of key tile ``tile``, the factor on V's per-channel scale that varies its FP8 rounding from tile to
    tile (formats.V_DITHER_LEVELS says why); exact in float32, so the PyTorch reference rounds alike."""
    return 1.0 + ((tile * _V_DITHER_STEP) % _V_DITHER_LEVELS).to(tl.float32) / _V_DITHER_LEVELS
