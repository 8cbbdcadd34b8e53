"""Host side of the kernels: one quantized attention call is centers → K/V pass → attention.

Two attention kernels share the first two steps:

- ``triton_attention``: the portable Triton kernel (sm80/89/90, and the CPU interpreter);
- ``hopper_attention``: the warp-specialized Gluon kernel for sm90 (``kernels/hopper/``).

Inputs are already validated by :func:`hf_qattn.qattn`; this module only lays out buffers and
launches, on the current device (the caller holds a ``torch.cuda.device`` guard). Views are HND
by strides (an NHD tensor is passed as its transposed view: no copy).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import tuning, workspace
from .fast_launch import fast
from .attention import attention_kernel
from .formats import INT_MAX, LOG2E, P_LOG2_FP8, P_SCALE
from .quantize import centers_kernel, quantize_kv_kernel

# the sm90 kernel's causal mask compares key and query positions as float32 (kernels/hopper/mainloop.py), exact
# below 2^24: a causal call whose positions reach it is refused rather than masked wrong (a window or chunk
# is masked in int32)
HOPPER_CAUSAL_POSITIONS = 1 << 24


def smoothing_centers(q, k, v, smooth_q: bool, smooth_k: bool, smooth_v: bool, *, v_range: torch.Tensor | None = None,
                      k_range: torch.Tensor | None = None, maxnreg: int = 0, centers: torch.Tensor | None = None,
                      **overrides):
    """(q̄, k̄, v̄) as float32 (B·H, D) views of one buffer; zeros where smoothing is off; V's from more
    sampled tokens than Q's and K's (kernels.json says why). With ``v_range`` ((B·Hk, 2, D_PAD) float32,
    −inf-filled) the same launch also writes V's range per channel there (see ``centers_kernel``); ``k_range``,
    the same for K (the K/V pass picks the split channel from it). One launch for all of it saves the host
    ≈ 40–50 µs a call against two. Its shape (rows a mean program sums a step, rows a range program reduces
    and a step of it, warps) is kernels.json's ``centers`` (tuning.centers_config); ``overrides`` replace its
    keys (to measure others). ``centers``: the (B·Hq + 2·B·Hk, D) float32 buffer to write, or None for a new one."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    d_pad = tuning.padded_head_dim(d)
    config = tuning.centers_config(d_pad)
    if overrides:  # a study's shapes; a call takes the table's as they are
        unknown = sorted(overrides.keys() - config.keys())
        if unknown:
            raise TypeError(f"smoothing_centers: unknown keys {unknown}; kernels.json's centers keys are "
                            f"{sorted(config)}")
        config = {**config, **overrides}
    sample, v_sample = tuning.center_sample(), tuning.v_center_sample()
    if centers is None:
        centers = torch.empty(b * hq + 2 * b * hk, d, device=q.device, dtype=torch.float32)
    blocks = math.ceil(nk / config["RANGE_ROWS"])
    range_programs = b * hk * blocks * ((v_range is not None) + (k_range is not None))
    fast(centers_kernel)[(b * hq + 2 * b * hk + range_programs,)](
        q, k, v, centers, v_range, k_range, *q.stride(), *k.stride(), *v.stride(),
        hq, hk, b * hq, b * hk, nq, nk, math.ceil(nq / sample) if nq > sample else 1,
        math.ceil(nk / sample) if nk > sample else 1, math.ceil(nk / v_sample) if nk > v_sample else 1, blocks,
        HEAD_DIM=d, D_PAD=d_pad, ROWS=config["MEAN_ROWS"], RANGE_ROWS=config["RANGE_ROWS"],
        CHUNK_ROWS=config["CHUNK_ROWS"], SMOOTH_Q=smooth_q, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v,
        WITH_V_RANGE=v_range is not None, WITH_K_RANGE=k_range is not None, num_warps=config["num_warps"],
        **tuning.register_cap(maxnreg),
    )
    return centers[: b * hq], centers[b * hq: b * (hq + hk)], centers[b * (hq + hk):]


@dataclasses.dataclass
class QuantizedKV:
    """What the K/V pass hands an attention kernel (shapes in ``kernels/quantize.py``)."""

    kq: torch.Tensor
    ks: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    ds: torch.Tensor  # (B·Hq [+ B·Hk], NK_PAD): ΔS rows, then (with split) each kv head's row kc
    split: torch.Tensor  # with split: (B·Hk,) int32, the split channel of K or −1; else empty
    q_bar: torch.Tensor
    k_bar: torch.Tensor
    v_bar: torch.Tensor
    nk_pad: int
    tiles: int
    v_dither: bool = False  # V̂'s tile dither (kernels/formats.py): ΔS holds log2 φ
    derived: dict = dataclasses.field(default_factory=dict)  # built from these buffers (TMA descriptors), kept with them

    @property
    def with_split(self) -> bool:
        return self.split.numel() > 0

    @property
    def delta_s(self) -> torch.Tensor:
        """ΔS·sm_scale·log2 e, (B·Hq, NK_PAD)."""
        return self.ds[: self.ds.shape[0] - self.split.numel()]

    @property
    def kc(self) -> torch.Tensor:
        """The split channel of K − k̄ per key, (B·Hk, NK_PAD), zeros for kv heads without one; empty
        without split."""
        return self.ds[self.ds.shape[0] - self.split.numel():]


def quantize_kv(q, k, v, *, sm_scale: float, qk: str, v_fp8: bool, smooth_q: bool, smooth_k: bool, smooth_v: bool,
                kv_start, kv_end, block_n: int, k_token_scale: bool, v_channel_scale: bool = False,
                permute_v: bool = False, num_warps: int | None = None,
                split: bool = False, v_dither: bool = False, maxnreg: tuple[int, int] = (0, 0),
                keep: bool = False) -> QuantizedKV:
    """Centers (and, for per-channel V scales, V's range: one read of V in the same launch), then one
    pass over K and V (which also writes ΔS).
    ``split``: also K's split channel per kv head (kernels/quantize.py), out of K̂ and into ``kc``.
    ``v_dither`` (with per-channel V scales): V̂'s tile dither, its log2 φ into ΔS (kernels/formats.py).
    ``maxnreg``: register caps a thread of the centers launch and of the K/V pass (0: none).
    ``keep``: into the buffers kept for this stream and these shapes (kernels/workspace.py), which the next such
    call overwrites — for a caller that reads them before it returns; else new ones."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    device = q.device
    d_pad = tuning.padded_head_dim(d)
    tiles = math.ceil(nk / block_n)
    nk_pad = tiles * block_n
    f32 = torch.float32
    buffers = workspace.get((
        # per-channel V scales need V's range over all keys before the pass, and the split channel K's: the
        # centers launch finds them, into one buffer filled with −inf below
        ("ranges", (int(v_channel_scale) + int(split), b * hk, 2, d_pad), f32),
        ("vs_tiles", (0,) if v_channel_scale else (b * hk, tiles, d_pad), f32),
        ("centers", (b * hq + 2 * b * hk, d), f32),
        ("split_channel", (b * hk if split else 0,), torch.int32),
        ("kq", (b * hk * nk_pad, d_pad), torch.int8),
        ("ks", (b * hk, nk_pad if k_token_scale else tiles), f32),
        ("vq", (b * hk * d_pad, nk_pad), torch.float8_e4m3fn if v_fp8 else torch.float16),
        ("ds", (b * hq + (b * hk if split else 0), nk_pad), f32),
    ), device, keep)
    ranges = buffers["ranges"].fill_(float("-inf"))
    vs = ranges[0] if v_channel_scale else buffers["vs_tiles"]
    k_range = ranges[-1] if split else None
    q_bar, k_bar, v_bar = smoothing_centers(q, k, v, smooth_q, smooth_k, smooth_v,
                                            v_range=vs if v_channel_scale else None, k_range=k_range,
                                            maxnreg=maxnreg[0], centers=buffers["centers"])
    split_channel, kq, ks, vq, ds = (buffers[name] for name in ("split_channel", "kq", "ks", "vq", "ds"))
    has_range = kv_start is not None or kv_end is not None
    num_warps = num_warps or tuning.quantize_num_warps(block_n, d)
    fast(quantize_kv_kernel)[(tiles, b * hk)](
        k, v, k_bar, v_bar, q_bar, kv_start, kv_end, kq, ks, vq, vs, ds, k_range, split_channel, ds[b * hq:],
        *k.stride(), *v.stride(),
        hk, hq // hk, nk, nk_pad, tiles, sm_scale * LOG2E,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, QK_MAX=INT_MAX[qk],
        K_TOKEN_SCALE=k_token_scale, V_FP8=v_fp8, V_CHANNEL_SCALE=v_channel_scale, V_DITHER=v_dither,
        PERMUTE_V=permute_v,
        HAS_KV_RANGE=has_range, GRID_ROUND=tuning.interpreting(), SPLIT=split,
        num_warps=num_warps, **tuning.register_cap(maxnreg[1]),
    )
    return QuantizedKV(kq, ks, vq, vs, ds, split_channel, q_bar, k_bar, v_bar, nk_pad, tiles, v_dither,
                       buffers.derived)


def _key_spans(window: int, chunk: int, nk: int) -> tuple[int, int]:
    """(window, chunk) as the kernels take them: a span of Nk keys or more restricts nothing (every p < Nk), so it
    is off (0), and the kernels' position ints stay 32-bit. (That they need a causal call is checked by the op.)"""
    return tuple(size if 0 < size < nk else 0 for size in (window, chunk))


def _key_range(kv_start, kv_end, b: int, nk: int, device):
    """Both ends as contiguous int32 (the kernels index them by batch), or (None, None) for all keys."""
    if kv_start is None and kv_end is None:
        return None, None
    start = torch.zeros(b, device=device, dtype=torch.int32) if kv_start is None else kv_start.to(torch.int32)
    end = torch.full((b,), nk, device=device, dtype=torch.int32) if kv_end is None else kv_end.to(torch.int32)
    return start.contiguous(), end.contiguous()


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    is_causal: bool,
    sm_scale: float,
    qk: str,
    v_fp8: bool,
    smooth_q: bool,
    smooth_k: bool,
    smooth_v: bool,
    kv_start: torch.Tensor | None,
    kv_end: torch.Tensor | None,
    return_lse: bool,
    config: dict | None = None,
    split_channel: bool = False,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """The portable Triton kernel. q (B, Hq, Nq, D), k/v (B, Hk, Nk, D), out like q — all HND views.
    window / chunk / softcap: 0 for none; sinks (Hq,) or None. Writes ``out``; returns lse or None."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    device = q.device
    if config is None:
        config = tuning.attention_config(tuning.arch_of(device), d, is_causal, "fp8" if v_fp8 else "fp16", qk)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    d_pad = tuning.padded_head_dim(d)
    window, chunk = _key_spans(window, chunk, nk)
    kv_start, kv_end = _key_range(kv_start, kv_end, b, nk, device)
    kv = quantize_kv(q, k, v, sm_scale=sm_scale, qk=qk, v_fp8=v_fp8, smooth_q=smooth_q, smooth_k=smooth_k,
                     smooth_v=smooth_v, kv_start=kv_start, kv_end=kv_end, block_n=block_n,
                     k_token_scale=config["K_TOKEN_SCALE"], split=split_channel, keep=True)
    descriptors = kv.derived.get(("triton", block_n))
    if descriptors is None:
        descriptors = kv.derived[("triton", block_n)] = (TensorDescriptor.from_tensor(kv.kq, [block_n, d_pad]),
                                                         TensorDescriptor.from_tensor(kv.vq, [d_pad, block_n]))
    kq_desc, vq_desc = descriptors
    lse = torch.empty(b, hq, nq, device=device, dtype=torch.float32) if return_lse else None
    fast(attention_kernel)[(triton.cdiv(nq, block_m), b * hq)](
        q, kq_desc, kv.ks, vq_desc, kv.vs, kv.ds, kv.kc, kv.split, kv.q_bar, kv.k_bar, kv.v_bar,
        kv_start, kv_end, None if sinks is None else sinks.contiguous(), out, lse,
        *q.stride(), *out.stride(),
        hq, hq // hk, nq, nk, kv.nk_pad, kv.tiles, sm_scale * LOG2E, window, chunk,
        # the soft cap's two constants (see kernels/attention.py); 0 when off (then unread)
        softcap * LOG2E, 2.0 / softcap if softcap else 0.0,
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, Q_GROUP=config["Q_GROUP"],
        QK_MAX=INT_MAX[qk], CAUSAL=is_causal, HAS_KV_RANGE=kv_start is not None,
        K_TOKEN_SCALE=config["K_TOKEN_SCALE"], V_FP8=v_fp8,
        P_LOG2=math.log2(P_SCALE["fp8_e4m3"] if v_fp8 else P_SCALE["fp16"]),
        RETURN_LSE=return_lse, GRID_ROUND=tuning.interpreting(), SPLIT=kv.with_split,
        HAS_WINDOW=bool(window), HAS_CHUNK=bool(chunk), SINKS_ON=sinks is not None, SOFTCAP=bool(softcap),
        ROW_LO=bool(window or chunk), ROW_TERM=bool(softcap or sinks is not None or return_lse),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return lse


def hopper_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    is_causal: bool,
    sm_scale: float,
    qk: str,
    smooth_q: bool,
    smooth_k: bool,
    smooth_v: bool,
    kv_start: torch.Tensor | None,
    kv_end: torch.Tensor | None,
    return_lse: bool,
    stages: int | None = None,
    persistent: bool | None = None,
    split_channel: bool = False,
    pv_tiles: int | None = None,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """The sm90 Gluon kernel (INT8 Q·Kᵀ, FP8 P·V; head dim ≤ 256). Same contract as ``triton_attention``,
    the variants included (window / chunk / softcap: 0 for none; sinks (Hq,) or None)."""
    kv_start, kv_end = _key_range(kv_start, kv_end, q.shape[0], k.shape[2], q.device)
    kv = hopper_quantize_kv(q, k, v, sm_scale=sm_scale, qk=qk, smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v,
                            kv_start=kv_start, kv_end=kv_end, split=split_channel, softcap=softcap, keep=True)
    return hopper_kernel_launch(q, k.shape[1], k.shape[2], kv, out, is_causal=is_causal, sm_scale=sm_scale, qk=qk,
                                kv_end=kv_end, return_lse=return_lse, stages=stages,
                                persistent=persistent, pv_tiles=pv_tiles, window=window, chunk=chunk, sinks=sinks,
                                softcap=softcap)


def hopper_quantize_kv(q, k, v, *, sm_scale: float, qk: str = "int8", smooth_q: bool = True, smooth_k: bool = True,
                       smooth_v: bool = True, kv_start=None, kv_end=None, split: bool = False, softcap: float = 0.0,
                       keep: bool = False) -> QuantizedKV:
    """``quantize_kv`` as the sm90 kernel takes its result: FP8 V̂ᵀ with per-channel scales (and the tile dither
    unless soft-capped) in the kernel's key order, its key tile, the pass's warps for it (kernels.json ``hopper``).
    ``hopper_kernel_launch`` runs the kernel on it; the benchmarks time the two apart."""
    config = tuning.hopper_config(q.shape[-1])
    return quantize_kv(q, k, v, sm_scale=sm_scale, qk=qk, v_fp8=True, smooth_q=smooth_q, smooth_k=smooth_k,
                       smooth_v=smooth_v, kv_start=kv_start, kv_end=kv_end, block_n=config["BLOCK_N"],
                       k_token_scale=False, v_channel_scale=True, permute_v=True, num_warps=config["KV_PASS_WARPS"],
                       split=split, v_dither=tuning.v_dither(bool(softcap)), keep=keep)


def hopper_kernel_launch(q, hk: int, nk: int, kv: QuantizedKV, out, *, is_causal: bool, sm_scale: float, qk: str,
                         kv_end, return_lse: bool, stages: int | None = None, persistent: bool | None = None,
                         pv_tiles: int | None = None, window: int = 0, chunk: int = 0,
                         sinks: torch.Tensor | None = None, softcap: float = 0.0, solo: bool | None = None):
    """The Gluon kernel alone, on the output of ``quantize_kv`` (the benchmark times it by itself).
    window / chunk / softcap: 0 for none; sinks (Hq,) or None (hf_qattn.qattn's semantics). ``stages``,
    ``persistent``, ``pv_tiles``, ``solo`` (CTAs of one warpgroup that loads its own tiles,
    hopper/mainloop.attend_solo; False: the warp-specialized CTA of two consumer warpgroups and a loader warp):
    the tuned configuration's unless given (to measure others); ``persistent`` or ``pv_tiles`` given without
    ``solo`` launch the warp-specialized CTA (SOLO sums one key tile a P·V accumulator)."""
    from .hopper.attention import attention_kernel as hopper_kernel
    from .hopper.gluon_api import TensorDescriptor as GluonDescriptor

    b, hq, nq, d = q.shape
    config = tuning.hopper_config(d)
    window, chunk = _key_spans(window, chunk, nk)
    if is_causal and not (window or chunk) and max(nq, nk) + config["BLOCK_N"] > HOPPER_CAUSAL_POSITIONS:
        most = HOPPER_CAUSAL_POSITIONS - config["BLOCK_N"]
        raise ValueError(f"is_causal: the sm90 kernel masks causal calls of up to {most:,} queries and keys "
                         f"(positions compared as float32, exact below 2**24); got {nq:,} and {nk:,}")
    persistent = config["PERSISTENT"] if persistent is None else persistent
    variant = bool(window or chunk or softcap) or sinks is not None
    solo, consumers, stages, maxnreg = tuning.hopper_cta_shape(d, persistent=persistent, variant=variant, solo=solo,
                                                               pv_tiles=pv_tiles, stages=stages)
    block_n, d_pad = config["BLOCK_N"], tuning.padded_head_dim(d)
    descriptors = kv.derived.get(("hopper", block_n))
    if descriptors is None:
        k_layout, vt_layout, ds_layout = _hopper_layouts(block_n, d_pad)
        descriptors = kv.derived[("hopper", block_n)] = (
            GluonDescriptor.from_tensor(kv.kq, [block_n, d_pad], k_layout),
            GluonDescriptor.from_tensor(kv.vq, [d_pad, block_n], vt_layout),
            GluonDescriptor.from_tensor(kv.ds.view(-1), [block_n], ds_layout))
    k_desc, vt_desc, ds_desc = descriptors
    lse = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32) if return_lse else None
    items = triton.cdiv(nq, 64 * consumers) * b * hq  # work items: 64 query rows a consumer warpgroup, one batch·head
    sms = tuning.sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if persistent and q.is_cuda else 0
    grid = min(items, sms * config["PERSISTENT_CTAS_PER_SM"]) if persistent else items
    fast(hopper_kernel)[(grid,)](
        q, k_desc, vt_desc, ds_desc, kv.ks, kv.split, kv.q_bar, kv.k_bar, kv.v_bar, kv.vs, kv_end, out, lse,
        *q.stride(), *out.stride(),
        hq, hq // hk, nq, nk, kv.nk_pad, kv.tiles, items, b * hq, sm_scale * LOG2E, sm_scale,
        int(window), int(chunk), None if sinks is None else sinks.contiguous(), float(softcap),
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, STAGES=stages, QK_MAX=float(INT_MAX[qk]),
        CAUSAL=is_causal, HAS_KV_RANGE=kv_end is not None, K_TOKEN_SCALE=False,
        P_LOG2=P_LOG2_FP8, RETURN_LSE=return_lse, PERSISTENT=persistent,
        SPLIT=kv.with_split, PV_TILES=pv_tiles or config["PV_TILES"], CONSUMERS=consumers,
        WINDOW=bool(window), CHUNK=bool(chunk), SINKS=sinks is not None, SOFTCAP=bool(softcap),
        V_DITHER=kv.v_dither, CAUSAL_SPLIT=tuning.hopper_causal_split(d, causal=is_causal,
                                                                      variant_span=bool(window or chunk), keys=nk),
        SOLO=solo, S_FLOAT_BY_ADD=tuning.hopper_s_float_by_add(d, causal=is_causal, variant=variant,
                                                              softcap=bool(softcap), split=kv.with_split),
        num_warps=4, **tuning.register_cap(maxnreg),
    )
    return lse


@functools.lru_cache(maxsize=None)
def _hopper_layouts(block_n: int, d_pad: int):
    """Shared-memory layouts of the K̂, V̂ᵀ and ΔS tiles (fixed per configuration: built once, not per call)."""
    from .hopper.gluon_api import gl

    return (gl.NVMMASharedLayout.get_default_for([block_n, d_pad], gl.int8),
            gl.NVMMASharedLayout.get_default_for([d_pad, block_n], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([block_n], gl.float32))

