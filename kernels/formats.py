"""The number formats of the method, in one place for the kernels and the Python around them.

Plain Python (no torch, no triton), so that every layer can import it: the Triton and Gluon kernels
wrap these values as constexprs, the launchers pass them, and ``hf_qattn.quant`` (the PyTorch
reference of the same math) re-exports them.
"""

from __future__ import annotations

import math

# Largest magnitude of each low-precision format (symmetric integer ranges: INT4 is held in ±7).
INT_MAX = {"int8": 127.0, "int4": 7.0}
FP8_E4M3_MAX = 448.0
FLOAT_MAX = {"fp8_e4m3": FP8_E4M3_MAX, "fp8_e5m2": 57344.0}
# The static scale P̃ = exp(S − m) ∈ [0, 1] is multiplied by before P·V, per P·V format.
P_SCALE = {"fp8_e4m3": FP8_E4M3_MAX, "fp8_e5m2": 57344.0, "int8": 127.0, "fp16": 1.0, "none": 1.0}
P_LOG2_FP8 = math.log2(FP8_E4M3_MAX)  # the kernels fold the FP8 scale into exp2

# V's tile dither. With one scale per channel over all keys, every copy of a value of V (bf16 holds a few
# thousand distinct values a channel) rounds to FP8 the same way, so V̂'s rounding error keeps a mean over
# the keys that no sequence length averages away, while attention's output over many keys shrinks toward
# V's mean: measured on the H100, zero-mean V, cos to float32 0.99595 at 262k keys against 0.99921 at 4k
# (eval/results/v-dither-*.md). Key tile t is quantized with δV·φ_t, φ_t = 1 + ((t·STEP) mod LEVELS) / LEVELS
# ∈ [1, 2) (exact in float32: a power-of-two denominator), so a value's rounding changes from tile to tile;
# the kernel puts φ_t back into P (P̂ = FP8(P·φ_t), l summing P alone), not into the output's δV.
V_DITHER_LEVELS = 64
V_DITHER_STEP = 37  # odd: 64 consecutive tiles take every level once


def v_dither(tile: int) -> float:
    """φ_t of key tile ``tile`` (see V_DITHER_LEVELS)."""
    return 1.0 + ((tile * V_DITHER_STEP) % V_DITHER_LEVELS) / V_DITHER_LEVELS


# The quantized KV cache's grouped formats (KIVI's layout for K): K − k̄ (and in the 8-bit grouped format V − v̄
# too) per channel over groups of this many consecutive tokens, each (group, channel) with a bf16 scale and zero
# point and values u ∈ [0, levels], x ≈ zero + u · scale; the newest tokens of an incomplete group stay in full
# precision until it completes. 4-bit K per token (one scale over the channels) cost SmolLM2 +10 % perplexity,
# per-channel groups of 16–128 tokens +0.35–1.13 % (eval/results/cache-k-formats-*.md); with 8-bit K and V per
# token 6 of 20 greedy continuations stayed the float32 cache's, per channel over groups 14 (fake quantization
# around exact attention, eval/results/cache-greedy-formats-*.md). 64 is the decode kernel's key tile on the GPU,
# so a tile is a group and its K scales are folded into q once a tile. Scale and zero cost 8 bytes a token at d128.
KV_GROUP = 64
KV_GROUP_LEVELS = {"int4": 15, "int8g": 255}  # the largest value of u, by the cache's precision name
# How a group's bf16 zero and scale are rounded. Directed: zero = the min rounded down, scale = (max − zero) /
# levels rounded up, so every value is within half a step of its grid point; but a channel far from k̄ in a
# group (|min| ≫ its range: a slowly rotating RoPE pair) then gets a step up to |min| · 2^-8 / levels wider.
# Nearest: both rounded to nearest, values below the zero clamp to it (off by ≤ half a bf16 step of |min|), the
# top by ≤ levels · 2^-9 steps. At 4 bits the step dwarfs the clamp: SmolLM2 cache perplexity +0.54 % nearest,
# +0.86 % directed; at 8 bits the clamp can reach several steps: −0.00 % directed, +0.02 % nearest (CPU,
# eval/cache_accuracy.py's perplexity, 2026-11-25).
KV_GROUP_DIRECTED = {"int4": False, "int8g": True}
# int8g rounds with a subtractive dither: u = round(t + φ_r), read back as u − φ_r, φ_r = ((41·r mod 64) + 1/2) / 64
# for a value's row r in its group (64 evenly spread offsets, permuted). Without it the rounding errors of a channel
# share their mean from group to group: the bf16 zero point lies on the bf16 grid of the cached values, offset by
# the channel's fixed center, so the two grids meet at the same phase in every group. Over many keys that mean is
# what a zero-mean V's output keeps (the quantized V alone, float64 reference, 4k → 128k keys: RelL1 0.0059 → 0.0099
# undithered, 0.0055 → 0.0054 dithered; eval/results/cache-group-dither-cpu-2026-11-25.md). The scale then spans
# levels − 1 steps, so that t + φ stays under levels + 1/2. INT4 keeps its measured format (K's common error shifts
# a query's scores alike and the softmax drops it).
KV_GROUP_DITHERED = {"int4": False, "int8g": True}
KV_GROUP_DITHER_STRIDE = 41  # odd, so r ↦ 41·r mod 64 is a permutation; 41/64 ≈ the golden ratio's 0.618

# The cache's per-token formats (INT8 K, INT8 V) first divide channel c of K − k̄ (V − v̄) by its equalizer σ_c, the
# largest |value| of the channel over the layer's first fill (per batch row and head), and multiply it back when read:
# a token's scale is then set by its largest channel relative to that channel's usual range, not by the outlier
# channels (SmolLM2's K and V have some), which left the other channels a few of the 255 levels. The decode kernel
# folds σ_K into q once a program and σ_V into the output once: no work a key tile. SmolLM2 (fake quantization, CPU):
# 15 of 20 greedy continuations the float32 cache's with K and V equalized, 6 with INT8 K and FP8 V per token
# unequalized, perplexity −0.02 % against +0.22 % (eval/results/cache-greedy-equalized-smollm2-cpu-2026-11-28.md).
# A channel quiet in the first fill would be amplified without bound when it gets loud later; σ_c is kept at or above
# KV_EQ_FLOOR × the head's largest σ (SmolLM2 perplexity, σ from a 16-token first fill: −0.02 % unfloored, −0.01 % at
# 1/64, +0.08 % at 1/16, +0.10 % at 1/8; cache-greedy-equalized-*), and a first fill of fewer than KV_EQ_MIN_TOKENS
# tokens (too few to show a channel's range: three random tokens can put σ_c at a tenth of what follows) leaves σ = 1.
KV_EQ_FLOOR = 1.0 / 64
KV_EQ_MIN_TOKENS = 16
# Per-token V is stored offset binary, V̂ + 128 in a uint8 (K stays two's complement: the INT8 dot takes it as it is).
# The decode kernel's tile turns a byte u into the fp16 1024 + u with one byte permute a pair (kernels/decode.py
# _fp16_1024_plus); a signed byte took an xor of four first, 64 of a d128 tile's 892 instructions a warp (INT8 K).
KV_V_OFFSET = 128
# ... and channel-major in tiles of this many tokens, (B, H, CAP / KV_V_TILE, D, KV_V_TILE): the decode kernel's P·V
# dot, with the keys as the dots' rows, takes Vᵀ as its operand, whose registers pair two keys of one channel; a
# key-major tile had to be converted and staged through shared memory to be read back transposed. 64 tokens (a GPU
# key tile, an INT4 group): a load instruction then reads 512 contiguous bytes (8 channels of 64 keys), as a
# token-major tile's; 16-token tiles (16-byte runs 2 KB apart) read at 3.3 TB/s, not 4.2 (H200, INT8 B8 64k).
KV_V_TILE = 64

# A group whose values are all zero gets this scale, so that quantizing it gives zeros, never NaN.
SCALE_FLOOR = 1e-30

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: scores are scaled by sm_scale·log2 e
ROUND_MAGIC = 12582912.0  # 1.5·2^23: (x + M) − M rounds a float32 |x| < 2^22 to an integer, ties to even
# M's bit pattern: an int32 |i| < 2^22 added to it and read as float32 is M + i exactly, so an integer add
# and a float subtract convert int32 → float32 on the ALU/FMA pipes, not on the quarter-rate unit that
# also runs the softmax's exp2 (an INT8 Q·Kᵀ over head_dim ≤ 256 stays below 127²·256 < 2^22)
ROUND_MAGIC_BITS = 0x4B400000


def padded_head_dim(head_dim: int) -> int:
    """Power of two ≥ head_dim and ≥ 32 (the K depth of one INT8 tensor-core instruction)."""
    return max(32, 1 << (head_dim - 1).bit_length())
