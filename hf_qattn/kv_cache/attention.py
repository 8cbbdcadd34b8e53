"""The part of :mod:`hf_qattn.kv_cache.cache` that the attention function needs, importable without transformers.

``is_packed(key)`` tells the qattn attention function that ``key`` is a QAttnCache layer's
:class:`PackedKV` handle; ``packed_attention`` then runs the decode kernel on the layer's quantized
storage (or its PyTorch reference on a CPU without the Triton interpreter), and ``dequantize``
rebuilds full-precision K/V for the rare call the kernel cannot serve (gradients, dropout, ...).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .. import stats
from . import reference


class QAttnCacheError(RuntimeError):
    """The quantized cache was used in a way it cannot serve (wrong attention implementation, overflow, ...)."""


def _kernels_available(device: torch.device) -> bool:
    """Whether the cache on ``device`` runs the Triton append and decode kernels (CUDA, or any device under
    the Triton interpreter) or their PyTorch reference: the one choice for writing and for reading the
    cache (:meth:`QAttnLayer._append <hf_qattn.kv_cache.cache.QAttnLayer._append>`, :func:`packed_attention`)."""
    try:
        from ..kernels import tuning  # needs triton
    except ImportError:
        return False
    return device.type == "cuda" or tuning.interpreting()


class PackedKV(torch.Tensor):
    """Stand-in for a layer's whole K or V: shape, dtype and device only; the data is in ``layer``.

    Any tensor operation on it raises :class:`QAttnCacheError`: only the qattn attention function
    can read the quantized storage.
    """

    layer: object  # hf_qattn.kv_cache.cache.QAttnLayer

    @staticmethod
    def __new__(cls, layer, which: str):
        shape = (layer.batch_size, layer.num_heads, layer.get_seq_length(), layer.head_dim)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=layer.dtype, device=layer.device,
                                                requires_grad=False)
        t.layer = layer
        t.which = which
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise QAttnCacheError(
            f"hf_qattn.QAttnCache stores K/V quantized and only attn_implementation='qattn' can read it "
            f"(an attention implementation ran {func} on the cache). Load the model with "
            "attn_implementation='qattn' (or model.set_attn_implementation('qattn')), or use a DynamicCache.")

    def __repr__(self):
        return f"PackedKV({self.which}, shape={tuple(self.shape)}, precision={self.layer.precision})"


# Set by CapturedDecodeStep around its step. The step builds its own inputs (one token a row, the same
# position for every row, no attention_mask), so the mask transformers makes for it is the plain
# causal one; the eager warm-up steps check that, and the capture then does not read the mask (a
# host read of a GPU tensor is illegal while a CUDA graph is being captured).
_captured_step: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_qattn_captured_step", default=False)


def step_pattern(query: torch.Tensor, key: "PackedKV", read_mask):
    """(pattern, reason) of an attention call on a packed cache layer: ``read_mask()`` (the integration's
    reading of the call's mask) outside CapturedDecodeStep. Inside it, the plain causal pattern over all
    cached tokens: while capturing taken as is (reading the mask then would be a host sync), in the
    eager warm-up steps checked against ``read_mask()`` — a mask with key ranges (padding) raises."""
    if not _captured_step.get():
        return read_mask()
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        from ..masks import MaskPattern

        return MaskPattern(query.shape[2] > 1, key.shape[2]), None
    pattern, reason = read_mask()
    if reason is not None or pattern.kv_start is not None or pattern.kv_end is not None or pattern.kv_len != key.shape[2]:
        raise QAttnCacheError(f"CapturedDecodeStep: the step's attention mask is not the plain causal mask over all "
                              f"{key.shape[2]} cached tokens ({reason or pattern}); padded batches cannot be replayed")
    return pattern, reason


def is_packed(t) -> bool:
    """True when an attention function received a QAttnCache layer's packed K/V instead of tensors."""
    return isinstance(t, PackedKV)


def packed_attention(query: torch.Tensor, key: PackedKV, pattern, scaling: float | None) -> torch.Tensor:
    """Attention of query (B, Hq, Nq, D) over the quantized layer behind ``key``: (B, Nq, Hq, D).

    ``pattern`` is the integration's reading of the mask (``causal``, ``kv_len``, ``kv_start``, ``kv_end``).
    """
    store = key.layer.storage()
    heads = store.kq.shape[1]
    if query.shape[1] % heads:
        raise QAttnCacheError(f"{query.shape[1]} query heads are not a multiple of {heads} cached heads")
    nk = min(int(pattern.kv_len), store.length)
    if _kernels_available(query.device):
        from ..kernels import decode_launch

        stats.record_call("triton")
        other_gpu = query.device.type == "cuda" and query.device.index not in (None, torch.cuda.current_device())
        with torch.cuda.device(query.device) if other_gpu else contextlib.nullcontext():
            # static storage read to its end: the kernel takes the count from device memory (graph-replayable)
            by_device = store.device_length is not None and nk == store.length
            return decode_launch.decode(query, store.kq, store.ks, store.vq, store.vs, store.v_bar,
                                        store.capacity if by_device else nk, int4=store.precision == "int4",
                                        sm_scale=scaling, causal=pattern.causal, kv_start=pattern.kv_start,
                                        kv_end=pattern.kv_end, length=store.device_length if by_device else None)
    stats.record_call("reference")
    return reference.decode_attention(query, store.kq, store.ks, store.vq, store.vs, store.v_bar, nk,
                                      precision=store.precision, sm_scale=scaling, causal=pattern.causal,
                                      kv_start=pattern.kv_start, kv_end=pattern.kv_end, dtype=torch.float32)


def dequantize(t: PackedKV) -> torch.Tensor:
    """The full-precision K or V rebuilt from the storage, for calls the decode kernel cannot serve."""
    k, v = t.layer.dequantized()
    return k if t.which == "keys" else v

