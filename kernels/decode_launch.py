"""Host side of the quantized KV cache kernels (see ``decode.py`` for the storage format).

``append`` quantizes new K/V tokens into a layer's buffers; ``decode`` runs attention of a few
query tokens (1..16 typically; any number works) against the cached tokens, reading the
quantized storage directly. Inputs are HND views by strides (B, H, N, D); the output is written
as (B, Nq, Hq, D), the layout transformers' attention functions return.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from . import tuning
from .fast_launch import fast
from .decode import append_kernel, combine_kernel, decode_kernel

from .formats import LOG2E


def packed_width(head_dim: int, int4: bool) -> int:
    """Bytes of K per token and head: D for INT8, D_PAD/2 for INT4 (two channels a byte)."""
    return tuning.padded_head_dim(head_dim) // 2 if int4 else head_dim


def append(k, v, k_bar, v_bar, kq, ks, vq, vs, pos0: int | torch.Tensor, *, int4: bool) -> None:
    """Quantize k, v (B, Hk, N, D) into slots [pos0, pos0 + N) of kq, ks, vq, vs (B, Hk, CAP, ·): one launch.
    ``pos0`` may be a one-element int32 tensor on the device (read by the kernel: CUDA-graph replayable)."""
    b, hk, n, d = k.shape
    if n == 0:
        return
    block_t = 16 if tuning.interpreting() else (32 if n > 16 else 16)  # one token (decoding): a smaller tile
    device_pos = isinstance(pos0, torch.Tensor)
    fast(append_kernel)[(triton.cdiv(n, block_t), b * hk)](
        k, v, k_bar, v_bar, kq, ks, vq, vs, 0 if device_pos else pos0, pos0 if device_pos else None,
        *k.stride(), *v.stride(), *kq.stride()[:3], *ks.stride()[:2], *vq.stride()[:3],
        hk, n,
        HEAD_DIM=d, D_PAD=tuning.padded_head_dim(d), BLOCK_T=block_t, INT4=int4,
        GRID_ROUND=tuning.interpreting(), DEVICE_POS=device_pos, num_warps=4,
    )


# Split-count heuristic: enough (query chunk, batch·kv-head, split) programs for WAVES programs per
# SM, never more splits than key tiles, nor a split shorter than MIN_SPLIT_TILES tiles unless that
# is needed to reach one program per SM. ``decode(waves=…)`` overrides it (bench_decode.py --sweep).
# WAVES 8 (was 2): more programs keep more of the cache in flight; on the H100 at B8 L16k / L64k,
# INT8 125.6 → 123.9 / 474.7 → 423.0 µs, INT4 169.0 → 146.5 / 640.0 → 543.9 µs
# (eval/results/decode-sweep-*-waves.log; 16 waves and 2 warps win at 64k, lose at 16k).
# MAX_SPLITS 32 (was 128): the fused combine merges the splits one after another in one program, and
# with 128 splits (B1 L64k at 8 waves) that tail cost 116 µs a step against 72 with 33 splits; more
# than MAX_SPLITS only when fewer would leave SMs idle (MQA at batch 1).
WAVES = 8
MIN_SPLIT_TILES = 4
MAX_SPLITS = 32
# Registers a thread, capped: Nsight Compute showed the kernel at 144 registers, 3 programs an SM
# (18.75 % occupancy) and 64 % (INT8) / 38 % (INT4) of DRAM bandwidth at B8 L64k
# (eval/results/ncu/ncu-decode-*.txt). At 128 (no spills for INT8, 2 for INT4) B8 L16k / L64k went
# 122.7 → 120.2 / 430.0 → 424.5 µs (INT8) and 148.7 → 139.4 / 549.4 → 507.7 µs (INT4); 104 and 88
# spill and lose (eval/results/decode-regs-sweep-*.md).
MAXNREG = 128
# Merge the splits inside the decode launch (the last split program of a tile to finish, through an
# arrival counter) instead of a second kernel. Validated on the H100 by eval/check_decode.py (fused
# and two-kernel results agree with the reference; repeats are identical) and faster there at short
# caches (B1 L1k: 42 vs 113 µs a step; eval/results/decode-*.md). The interpreter does not exercise
# its memory ordering.
FUSED_COMBINE = True


@functools.lru_cache(maxsize=4096)
def _plan(b: int, hk: int, groups: int, nq: int, nk: int, sms: int, interp: bool, block_n: int | None,
          num_splits: int | None, waves: float | None) -> tuple:
    if block_n is None:
        block_n = 16 if interp else 64
    qt = max(1, min(nq, 64 // groups))  # query tokens per tile: G·QT rows, at most 64 (≥ 16 by padding)
    block_m = max(16, triton.next_power_of_2(qt * groups))
    chunks = triton.cdiv(nq, qt)
    tiles = max(1, triton.cdiv(nk, block_n))
    if num_splits is None:
        if interp:
            num_splits = min(2, tiles)
        else:
            programs = chunks * b * hk
            fill = triton.cdiv(sms, programs)  # splits for one program per SM
            want = triton.cdiv(int(sms * (WAVES if waves is None else waves)), programs)
            num_splits = min(want, max(fill, tiles // MIN_SPLIT_TILES), max(fill, MAX_SPLITS))
    num_splits = max(1, min(num_splits, tiles))
    split_len = triton.cdiv(tiles, num_splits) * block_n
    num_splits = triton.cdiv(max(nk, 1), split_len)  # no empty trailing split
    return block_n, block_m, qt, chunks, num_splits, split_len


def plan_launch(b: int, hk: int, groups: int, nq: int, nk: int, device: torch.device, *,
                block_n: int | None = None, num_splits: int | None = None, waves: float | None = None) -> dict:
    """Tile sizes and the split count of one decode call."""
    interp = tuning.interpreting() or device.type != "cuda"
    sms = 0 if interp else tuning.sm_count(device.index if device.index is not None else torch.cuda.current_device())
    block_n, block_m, qt, chunks, splits, split_len = _plan(b, hk, groups, nq, nk, sms, interp, block_n,
                                                            num_splits, waves)
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, QT=qt, chunks=chunks, num_splits=splits, split_len=split_len)


# Scratch of the split path, kept per device and grown as needed (no allocation per decode step):
# the partial (acc, m, l) of every split, and the fused combine's arrival counters, which the kernel
# leaves at zero. Launches on one stream use it one after the other; calls from several streams
# at once on one device would need one workspace per stream (not done).
_WORKSPACE: dict = {}


def _workspace(device: torch.device, rows: int, d_pad: int, tiles: int):
    key = (device.type, device.index)
    ws = _WORKSPACE.get(key)
    if ws is None or ws[0].shape[0] < rows or ws[0].shape[1] < d_pad or ws[3].numel() < tiles:
        old_rows, old_d, old_tiles = (0, 0, 0) if ws is None else (ws[0].shape[0], ws[0].shape[1], ws[3].numel())
        rows, d_pad, tiles = max(rows, old_rows), max(d_pad, old_d), max(tiles, old_tiles, 1024)
        part_o = torch.empty(rows, d_pad, device=device, dtype=torch.float32)
        part_m = torch.empty(rows, device=device, dtype=torch.float32)
        ws = (part_o, part_m, torch.empty_like(part_m), torch.zeros(tiles, device=device, dtype=torch.int32))
        _WORKSPACE[key] = ws
    return ws


def decode(q, kq, ks, vq, vs, v_bar, nk: int, *, int4: bool, sm_scale: float | None = None, causal: bool = True,
           kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None,
           length: torch.Tensor | None = None,
           out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
           num_warps: int = 4, num_stages: int | None = None, waves: float | None = None,
           fused_combine: bool | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` cached tokens → (B, Nq, Hq, D) in q's dtype.

    ``causal`` aligns the diagonal bottom-right (query i sees keys ≤ nk − Nq + i); with one query it
    changes nothing. ``kv_start`` / ``kv_end`` (B,) restrict each sequence to keys [start, end).
    ``length``: a one-element int32 tensor on the device holding the cached token count (≤ ``nk``, which
    is then the capacity the launch is planned for): the kernel reads it, so a captured CUDA graph
    replays correctly as the cache grows.
    No host synchronization, no allocation but ``out`` when it is not given; one kernel launch, two
    with several splits unless ``fused_combine`` (default: :data:`FUSED_COMBINE`) merges them in it.
    ``block_n``, ``num_warps``, ``num_stages``, ``num_splits`` / ``waves``, ``maxnreg`` (the register cap per
    thread, default :data:`MAXNREG`, 0 for none: more programs per SM) tune the launch.
    """
    b, hq, nq, d = q.shape
    hk = kq.shape[1]
    groups = hq // hk
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty(b, nq, hq, d, device=q.device, dtype=q.dtype)
    if nq == 0:
        return out
    interp = tuning.interpreting()
    d_pad = tuning.padded_head_dim(d)
    cfg = plan_launch(b, hk, groups, nq, nk, q.device, block_n=block_n, num_splits=num_splits, waves=waves)
    has_range = kv_start is not None or kv_end is not None
    if has_range:
        kv_start = (torch.zeros(b, device=q.device, dtype=torch.int32) if kv_start is None
                    else kv_start.to(device=q.device, dtype=torch.int32).contiguous())
        kv_end = (torch.full((b,), nk, device=q.device, dtype=torch.int32) if kv_end is None
                  else kv_end.to(device=q.device, dtype=torch.int32).contiguous())
    splits = cfg["num_splits"]
    split = splits > 1
    if fused_combine is None:
        fused_combine = FUSED_COMBINE
    if split:
        part_o, part_m, part_l, counter = _workspace(q.device, b * hq * nq * splits, d_pad, cfg["chunks"] * b * hk)
    else:
        part_o = part_m = part_l = counter = None
    extra = {} if num_stages is None else {"num_stages": num_stages}
    extra.update(tuning.register_cap(MAXNREG if maxnreg is None else maxnreg))
    fast(decode_kernel)[(cfg["chunks"], b * hk, splits)](
        q, kq, ks, vq, vs, v_bar, kv_start, kv_end, out, part_o, part_m, part_l, counter, length,
        *q.stride(), *kq.stride()[:3], *ks.stride()[:2], *vq.stride()[:3], *out.stride(),
        hk, nq, nk, cfg["split_len"], splits, sm_scale * LOG2E,
        GROUPS=groups, QT=cfg["QT"], HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        INT4=int4, CAUSAL=bool(causal) and nq > 1, HAS_KV_RANGE=has_range, SPLIT=split,
        FUSED_COMBINE=split and fused_combine, INTERPRET=interp, DEVICE_LEN=length is not None,
        num_warps=num_warps, **extra,
    )
    if split and not fused_combine:
        fast(combine_kernel)[(b * hq * nq,)](
            part_o, part_m, part_l, v_bar, out, *out.stride(), hq, nq, splits,
            GROUPS=groups, HEAD_DIM=d, D_PAD=d_pad, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
            num_warps=4 if d_pad >= 128 else 2,
        )
    return out
