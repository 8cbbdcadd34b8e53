"""Small Triton helpers shared by the kernels."""

import triton
import triton.language as tl

# Adding and subtracting 1.5·2^23 leaves a float32 rounded to the nearest integer, ties to even,
# for |x| < 2^22 — the same rounding as torch.round, and it also runs under TRITON_INTERPRET.
_ROUND_MAGIC = tl.constexpr(12582912.0)
# The same constant's bit pattern: an int32 |i| < 2^22 added to it and read as float32 is
# 1.5·2^23 + i exactly, so one integer add and one float subtract convert int32 → float32
# without the quarter-rate conversion unit (which the softmax's exp2 already saturates).
_ROUND_MAGIC_BITS = tl.constexpr(0x4B400000)

# Scales never go below this, so an all-zero group quantizes to zeros instead of NaN.
SCALE_FLOOR = tl.constexpr(1e-30)


@triton.jit
def round_half_even(x):
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def int32_to_float(x):
    """Exact for |x| < 2^22 (an INT8 Q·Kᵀ over head_dim ≤ 256 stays below 127²·256 < 2^22)."""
    return (x + _ROUND_MAGIC_BITS).to(tl.float32, bitcast=True) - _ROUND_MAGIC


@triton.jit
def quantize_symmetric(x, scale, QMAX: tl.constexpr):
    """int8 holding round(x / scale) clamped to ±QMAX; ``scale`` broadcasts against ``x``."""
    r = round_half_even(tl.math.div_rn(x, scale))
    return tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int8)


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
