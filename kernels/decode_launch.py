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
from .decode import append_kernel, combine_kernel, decode_kernel

LOG2E = 1.4426950408889634


def packed_width(head_dim: int, int4: bool) -> int:
    """Bytes of K per token and head: D for INT8, D_PAD/2 for INT4 (two channels a byte)."""
    return tuning.padded_head_dim(head_dim) // 2 if int4 else head_dim


def append(k, v, k_bar, v_bar, kq, ks, vq, vs, pos0: int, *, int4: bool) -> None:
    """Quantize k, v (B, Hk, N, D) into slots [pos0, pos0 + N) of kq, ks, vq, vs (B, Hk, CAP, ·)."""
    b, hk, n, d = k.shape
    if n == 0:
        return
    block_t = 16 if tuning.interpreting() else 32
    append_kernel[(triton.cdiv(n, block_t), b * hk)](
        k, v, k_bar, v_bar, kq, ks, vq, vs, pos0,
        *k.stride(), *v.stride(), *kq.stride()[:3], *ks.stride()[:2], *vq.stride()[:3],
        hk, n,
        HEAD_DIM=d, D_PAD=tuning.padded_head_dim(d), BLOCK_T=block_t, INT4=int4,
        GRID_ROUND=tuning.interpreting(), num_warps=4,
    )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_launch(b: int, hk: int, groups: int, nq: int, nk: int, device: torch.device, *,
                block_n: int | None = None, num_splits: int | None = None) -> dict:
    """Tile sizes and the split count of one decode call."""
    interp = tuning.interpreting() or device.type != "cuda"
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
            target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
            num_splits = min(triton.cdiv(target, chunks * b * hk), tiles, 128)
    num_splits = max(1, min(num_splits, tiles))
    split_len = triton.cdiv(tiles, num_splits) * block_n
    num_splits = triton.cdiv(max(nk, 1), split_len)  # no empty trailing split
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, QT=qt, chunks=chunks, num_splits=num_splits, split_len=split_len)


def decode(q, kq, ks, vq, vs, v_bar, nk: int, *, int4: bool, sm_scale: float | None = None, causal: bool = True,
           kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None,
           out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
           num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` cached tokens → (B, Nq, Hq, D) in q's dtype.

    ``causal`` aligns the diagonal bottom-right (query i sees keys ≤ nk − Nq + i); with one query it
    changes nothing. ``kv_start`` / ``kv_end`` (B,) restrict each sequence to keys [start, end).
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
    d_pad = tuning.padded_head_dim(d)
    cfg = plan_launch(b, hk, groups, nq, nk, q.device, block_n=block_n, num_splits=num_splits)
    has_range = kv_start is not None or kv_end is not None
    if has_range:
        kv_start = (torch.zeros(b, device=q.device, dtype=torch.int32) if kv_start is None
                    else kv_start.to(device=q.device, dtype=torch.int32).contiguous())
        kv_end = (torch.full((b,), nk, device=q.device, dtype=torch.int32) if kv_end is None
                  else kv_end.to(device=q.device, dtype=torch.int32).contiguous())
    splits = cfg["num_splits"]
    split = splits > 1
    if split:
        part_o = torch.empty(b * hq * nq * splits, d_pad, device=q.device, dtype=torch.float32)
        part_m = torch.empty(b * hq * nq * splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = None
    extra = {} if num_stages is None else {"num_stages": num_stages}
    decode_kernel[(cfg["chunks"], b * hk, splits)](
        q, kq, ks, vq, vs, v_bar, kv_start, kv_end, out, part_o, part_m, part_l,
        *q.stride(), *kq.stride()[:3], *ks.stride()[:2], *vq.stride()[:3], *out.stride(),
        hk, nq, nk, cfg["split_len"], splits, sm_scale * LOG2E,
        GROUPS=groups, QT=cfg["QT"], HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        INT4=int4, CAUSAL=bool(causal) and nq > 1, HAS_KV_RANGE=has_range, SPLIT=split,
        INTERPRET=tuning.interpreting(),
        num_warps=num_warps, **extra,
    )
    if split:
        combine_kernel[(b * hq * nq,)](
            part_o, part_m, part_l, v_bar, out, *out.stride(), hq, nq, splits,
            GROUPS=groups, HEAD_DIM=d, D_PAD=d_pad, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
            num_warps=4 if d_pad >= 128 else 2,
        )
    return out
