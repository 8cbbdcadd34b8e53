"""The K/V pass's buffers, kept from one attention call to the next call of the same shapes on the same stream.

Why: a call's passes write the centers, K̂, V̂ᵀ, their scales and ΔS into buffers that only its attention kernel
reads. Allocating them (six ``torch.empty`` and a ``torch.full``) and describing them to TMA (three descriptors)
anew each call is host time, and short calls are bound by the host (eval/results/host-overhead-prefill-*.md).
Calls on one stream run in stream order, so the next call's passes overwrite the buffers only after this call's
kernel has read them: they are kept, per (device, stream, the buffers' shapes and dtypes), with what is derived
from them (``Workspace.derived``: the TMA descriptors).

Not kept: while the stream is being captured into a CUDA graph (a replay would write buffers that eager calls
share, out of their stream order), and beyond ``HF_QATTN_WORKSPACE_MB`` of kept buffers in all (least recently
used first out; ``0``: never kept, every call allocates). Only the attention calls, which read their buffers
before they return, ask for kept ones (``launch.quantize_kv(keep=True)``); a caller that holds a ``QuantizedKV``
gets its own.
"""

from __future__ import annotations

import collections
import math

import torch

from . import settings

# (name, shape, dtype) of each buffer, in a fixed order: the key of a workspace, with the device and stream
Spec = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


class Workspace:
    """The buffers of one spec by name, and ``derived``: objects built from them (kept with them)."""

    def __init__(self, spec: Spec, device: torch.device):
        self.tensors = {name: torch.empty(shape, device=device, dtype=dtype) for name, shape, dtype in spec}
        self.nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in spec)
        self.derived: dict = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


_KEPT: collections.OrderedDict = collections.OrderedDict()  # (device, stream, spec) → Workspace, oldest use first


def _stream_of(device: torch.device):
    """The current stream's handle on ``device``, or None where nothing is kept on it (capturing) — or 0 off CUDA."""
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():  # the launch runs under a guard of the inputs' device
        return None
    return torch.cuda.current_stream(device).cuda_stream


def get(spec: Spec, device: torch.device, keep: bool) -> Workspace:
    """The buffers of ``spec`` on ``device``: with ``keep`` the ones kept for this stream (made and kept the first
    time, within the budget), else new ones."""
    budget = settings.workspace_bytes() if keep else 0
    stream = _stream_of(device) if budget else None
    if stream is None:
        return Workspace(spec, device)
    key = (device, stream, spec)
    found = _KEPT.get(key)
    if found is not None:
        _KEPT.move_to_end(key)
        return found
    made = Workspace(spec, device)
    if made.nbytes <= budget:
        held = sum(w.nbytes for w in _KEPT.values())
        while _KEPT and held + made.nbytes > budget:
            held -= _KEPT.popitem(last=False)[1].nbytes
        _KEPT[key] = made
    return made


def kept_bytes() -> int:
    """Bytes of the buffers kept now (all devices and streams)."""
    return sum(w.nbytes for w in _KEPT.values())


def release() -> None:
    """Drop every kept buffer (their memory returns to PyTorch's allocator once no call uses them)."""
    _KEPT.clear()
