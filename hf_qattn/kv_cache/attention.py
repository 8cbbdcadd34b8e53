"""The part of :mod:`hf_qattn.kv_cache.cache` that the attention function needs, importable without transformers.

``is_packed(key)`` tells the qattn attention function that ``key`` is a QAttnCache layer's
:class:`PackedKV` handle; ``packed_attention`` then runs the decode kernel on the layer's quantized
storage (or its PyTorch reference on a CPU without the Triton interpreter), and ``dequantize``
rebuilds full-precision K/V for the rare call the kernel cannot serve (gradients, dropout, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from .. import stats, support
from . import reference


class QAttnCacheError(RuntimeError):
    """The quantized cache was used in a way it cannot serve (wrong attention implementation, overflow, ...)."""


def _kernels_available(device: torch.device) -> bool:
    """Whether the cache on ``device`` runs the Triton append and decode kernels (CUDA, or any device under
    the Triton interpreter) or their PyTorch reference: the one choice for writing and for reading the
    cache (:meth:`QAttnLayer._append <hf_qattn.kv_cache.cache.QAttnLayer._append>`, :func:`packed_attention`)."""
    launch = decode_launch()
    return launch is not None and (device.type == "cuda" or launch.tuning.interpreting())


@functools.cache
def decode_launch():
    """``hf_qattn.kernels.decode_launch``, or None without triton; imported once (a decode step's host path runs
    this for every layer)."""
    try:
        from ..kernels import decode_launch as module  # needs triton
    except ImportError:
        return None
    return module


class PackedKV(torch.Tensor):
    """Stand-in for a layer's whole K or V: shape, dtype and device only; the data is in ``layer``.

    Any tensor operation on it raises :class:`QAttnCacheError`: only the qattn attention function
    can read the quantized storage.
    """

    layer: object  # hf_qattn.kv_cache.cache.QAttnLayer

    @staticmethod
    def __new__(cls, layer, which: str):
        shape = (layer.batch_size, layer.num_heads, layer.packed_length(), layer.head_dim)
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
    reading of the call's mask) outside CapturedDecodeStep. Inside it, the pattern of an unpadded step
    (:func:`_replayed_pattern`): while capturing taken as is (reading the mask then would be a host sync), in the
    eager warm-up steps checked against ``read_mask()`` — a mask with other key ranges (padding) raises."""
    if not _captured_step.get():
        return read_mask()
    replayed = _replayed_pattern(query, key)
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return replayed, None
    pattern, reason = read_mask()
    kv_len = key.shape[2]
    # the first key an unpadded step's mask shows every row: 0, or where a chunked layer's newest chunk starts
    first = 0 if replayed.chunk is None else kv_len - min(key.layer.device_count(), kv_len)
    if (reason is not None or pattern.kv_end is not None or pattern.kv_len != kv_len
            or ({0} if pattern.kv_start is None else set(pattern.kv_start.tolist())) != {first}):
        raise QAttnCacheError(f"CapturedDecodeStep: the step's attention mask is not the one of an unpadded step "
                              f"over {kv_len} cached tokens ({reason or pattern}); padded batches cannot be replayed")
    return replayed, None


def _replayed_pattern(query: torch.Tensor, key: "PackedKV"):
    """The pattern a CapturedDecodeStep's step reads with: causal over all cached tokens; for a chunked layer, its
    chunk (the newest, :func:`_device_read`: slots [0, the device count))."""
    from ..masks import MaskPattern

    layer = key.layer
    chunk = layer.span if getattr(layer, "kind", None) == "chunked_attention" else None
    return MaskPattern(query.shape[2] > 1, key.shape[2], chunk=chunk)


def is_packed(t) -> bool:
    """True when an attention function received a QAttnCache layer's packed K/V instead of tensors."""
    return isinstance(t, PackedKV)


def _ring_read(layer, batch: int, pattern, window, chunk):
    """How a one-token query reads a sliding / chunked layer's ring: (kv_start, kv_end, wraps). Without wraps,
    slot ranges [kv_start, kv_end) (None: every held slot); with wraps (some sequence's range runs past the ring's
    end: left padding), each sequence's first slot and slot count of a cyclic range (the decode kernel's ring
    mode), and for the reference, which reads the slots in position order, offsets from the oldest held position.

    The query's visible positions [lo, hi): what the layer holds, cut by the mask's range (in mask coordinates:
    the last of ``kv_len`` keys is the newest token), a narrower ``window``, and the chunk — the mask's range
    where there is one (with left padding, transformers counts chunks from each sequence's first real token),
    chunks counted from position 0 where the caller passes ``chunk``, else every held key (the mask shows them
    all: a padded sequence's chunk can cover the whole ring without starting at a multiple of the span).
    """
    first, seen = layer.held_positions()
    span, held = layer.span, seen - first
    if layer.kind == "sliding_attention" and window is not None and window > span:
        raise QAttnCacheError(f"this sliding-window cache layer holds {span} tokens; the attention asks for a "
                              f"window of {window}")
    if chunk is not None and (layer.kind != "chunked_attention" or chunk != span):
        raise QAttnCacheError(f"this {layer.kind} cache layer (span {span}) holds no chunks of {chunk} tokens")
    lo, hi = first, seen
    if window is not None:
        lo = max(lo, seen - window)
    has_range = pattern.kv_start is not None or pattern.kv_end is not None
    if chunk is not None and not has_range:
        lo = max(lo, (seen - 1) // span * span)
    if has_range:
        offset = seen - int(pattern.kv_len)
        lo = torch.full((batch,), lo, dtype=torch.int64)
        hi = torch.full((batch,), hi, dtype=torch.int64)
        if pattern.kv_start is not None:
            lo = torch.maximum(lo, pattern.kv_start.detach().to("cpu", torch.int64) + offset)
        if pattern.kv_end is not None:
            hi = torch.minimum(hi, pattern.kv_end.detach().to("cpu", torch.int64) + offset)
        count = (hi - lo).clamp_min(0)
        if bool((count == held).all()):
            return None, None, False
        begin = lo % span
        if bool((begin + count <= span).all()):
            return begin, begin + count, False
        return begin, count, True
    if hi - lo == held:
        return None, None, False
    begin = lo % span  # one range for the whole batch; a chunk starts at a multiple of span: no wrap
    wraps = begin + hi - lo > span
    return (torch.full((batch,), begin, dtype=torch.int32),
            torch.full((batch,), hi - lo if wraps else begin + hi - lo, dtype=torch.int32), wraps)


def _device_read(layer, pattern, window, chunk) -> bool:
    """Whether a one-token step over a window layer's static storage reads the slots [0, device count)
    (:meth:`~hf_qattn.kv_cache.cache.QAttnWindowLayer.device_count`) — what :func:`_ring_read` finds, without
    reading the host's counts (graph-replayable): no key ranges (padding), and the call's window the layer's or
    none (a sliding layer: every held slot), or its chunk the layer's (a chunked layer: the newest chunk)."""
    if pattern.kv_start is not None or pattern.kv_end is not None:
        return False
    if layer.kind == "sliding_attention":
        return chunk is None and window in (None, layer.span)
    return window is None and chunk == layer.span


def _on_device(query: torch.Tensor):
    """The query's GPU made current where it is not (a model split over GPUs): launches and graphs are per device."""
    if query.device.type == "cuda" and query.device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(query.device)
    return contextlib.nullcontext()


def replay_recorded(query: torch.Tensor, key: PackedKV, scaling: float | None, call) -> torch.Tensor | None:
    """The output (B, 1, Hq, D) of a one-token step replayed from the layer's step graph when the graph was recorded
    by a call with the same key (``call``: the integration's key of every input its decisions read; see
    :func:`hf_qattn.kv_cache.step_graph.replay_recorded`), else None: the caller decides as usual and calls
    :func:`packed_attention` with the same ``call``."""
    if key.layer.pending() is None:
        return None
    from . import step_graph  # (it imports this module)

    with _on_device(query):
        out = step_graph.replay_recorded(key.layer, query, scaling, call)
    if out is not None:
        stats.record_call("triton")
    return out


def packed_attention(query: torch.Tensor, key: PackedKV, pattern, scaling: float | None, *,
                     window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None, call=None) -> torch.Tensor:
    """Attention of query (B, Hq, Nq, D) over the quantized layer behind ``key``: (B, Nq, Hq, D).

    ``pattern`` is the integration's reading of the mask (``causal``, ``kv_len``, ``kv_start``, ``kv_end``),
    in its coordinates: key j of ``kv_len`` is the j-th of the positions the mask covers, the last one the
    newest token. ``window``, ``chunk``, ``sinks``, ``softcap`` as in :func:`hf_qattn.qattn` (the query at
    position p sees keys p − W < j ≤ p, or j of p's chunk; one logit per query head in the denominator;
    scores c·tanh(s / c)). A sliding-window or chunked layer (:class:`~hf_qattn.kv_cache.cache.QAttnWindowLayer`)
    holds the last window / chunk-size tokens as a ring, which a one-token query reads whole (a window) or as a
    slot range (a chunk, padding: :func:`_ring_read`), cyclic where it wraps around the ring's end. ``call``: the
    key a step graph recorded here remembers (:func:`replay_recorded`), or None.
    """
    # the arguments as qattn takes them (a read of the cache is causal: its newest key is the query's position)
    variants = support.check_variants(window=window, chunk=chunk, sinks=sinks, softcap=softcap, is_causal=True,
                                      heads=query.shape[1], device=query.device)
    window, chunk, softcap = variants["window"], variants["chunk"], variants["softcap"]
    layer = key.layer
    if layer.pending() is not None:  # a deferred token: the layer's step graph
        from . import step_graph  # (it imports this module)

        with _on_device(query):  # graphs are per device
            out = step_graph.run(layer, query, pattern, scaling, window, chunk, sinks, softcap, call)
        if out is not None:
            stats.record_call("triton")
            return out
    store = layer.storage()  # (appends a deferred token)
    heads = store.kq.shape[1]
    if query.shape[1] % heads:
        raise QAttnCacheError(f"{query.shape[1]} query heads are not a multiple of {heads} cached heads")
    kv_start, kv_end = pattern.kv_start, pattern.kv_end
    ring = None  # a cyclic slot range of a window layer's ring
    if hasattr(layer, "held_positions"):  # a sliding / chunked layer: one query (several get tensors)
        if query.shape[2] != 1:
            raise QAttnCacheError(f"a {layer.kind} cache layer is read by one-token steps only; got "
                                  f"{query.shape[2]} queries")
        by_device = store.device_length is not None and _device_read(layer, pattern, window, chunk)
        if by_device:
            kv_start = kv_end = None  # slots [0, the count in device memory) (graph-replayable)
        else:
            kv_start, kv_end, wraps = _ring_read(layer, query.shape[0], pattern, window, chunk)
            ring = layer.span if wraps else None
        window = chunk = None  # in the ranges now
        nk = layer.device_count() if by_device else store.length  # the kernel reads the device's instead
    else:
        nk = min(int(pattern.kv_len), store.length)
        # static storage read to its end: the kernel takes the count from device memory (graph-replayable)
        by_device = store.device_length is not None and nk == store.length
    if _kernels_available(query.device):
        stats.record_call("triton")
        with _on_device(query):
            return decode_launch().decode(query, store, store.v_bar, store.capacity if by_device else nk,
                                        sm_scale=scaling, causal=pattern.causal, kv_start=kv_start,
                                        kv_end=kv_end, length=store.device_length if by_device else None,
                                        window=window, chunk=chunk, sinks=sinks, softcap=softcap, k_bar=store.k_bar,
                                        ring=ring, launches=store.launches)
    stats.record_call("reference")
    buffers = store  # the storage view has the fields of reference.Buffers
    if ring is not None:  # the slots in position order (INT8: rings hold no INT4), ranges as offsets from the oldest
        first, _ = layer.held_positions()
        slots = layer.chronological_slots()
        buffers = reference.in_slot_order(store, slots)
        kv_start = (kv_start - first) % ring
        kv_end = kv_start + kv_end
    return reference.decode_attention(query, buffers, store.v_bar, nk, sm_scale=scaling, causal=pattern.causal,
                                      kv_start=kv_start, kv_end=kv_end, window=window, chunk=chunk, sinks=sinks, softcap=softcap, k_bar=store.k_bar,
                                      dtype=torch.float32)


def dequantize(t: PackedKV) -> torch.Tensor:
    """The full-precision K or V rebuilt from the storage, for calls the decode kernel cannot serve."""
    k, v = t.layer.dequantized()
    return k if t.which == "keys" else v

