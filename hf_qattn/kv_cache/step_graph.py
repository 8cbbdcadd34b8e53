"""A full-attention cache layer's eager decode step — append the token, attend over the cache — as one CUDA graph.

``model.generate(ids, cache=QAttnCache(model))`` runs transformers' own eager loop: every layer of every step
issues its kernels from Python, and a one-token step's host work (two launches with ~50 arguments each, the
checks around them) was what made it slower than eager SDPA (eval/results/host-overhead-decode-*). Here a plain
one-token step of a :class:`~hf_qattn.kv_cache.cache.QAttnLayer` on a GPU is recorded once as a CUDA graph —
the append kernel writing the token at the slot the device-side count names, the count's increment, the decode
kernel reading the count — and later steps only copy q, k and v into the graph's inputs and replay it:

- ``update`` defers the append (:func:`defers`): the layer keeps the token as *pending* and counts it; whatever
  reads or changes the storage first appends it eagerly (``QAttnLayer._flush``), so nothing can see a cache
  without it.
- the attention over the layer (:func:`run`) replays the layer's graph for a plain step — one query a row, no
  key range (padding), no window, chunk, sinks or soft-cap — and appends eagerly otherwise. The first such step
  runs eagerly in exactly the captured form (it compiles the kernels' specializations), the second captures.
- the graph remembers the call that recorded it (``call``: the integration's key of every input its decisions
  read, :func:`hf_qattn.integrations.transformers.attention.replay_key`); a later step with the same key replays
  at once (:func:`replay_recorded`), without taking those decisions again.
- the output is the graph's own buffer, handed out as an alias (no copy: a copy of a few KB costs the host a
  ``cudaMemcpyAsync``, as much as the replay itself) while nothing else still holds the last step's output; the
  first time something does, the layer records a new graph with a buffer of its own and copies from then on.

The graph lives in the layer's launch memo, which is emptied whenever its storage moves (growth, a batch
selection, a crop into a group, a reset): the next plain step warms and captures anew. ``HF_QATTN_STEP_GRAPHS=0``
turns this off (every step launches eagerly). :class:`~hf_qattn.CapturedDecodeStep` (a whole model step in one
graph) runs its own capture: no layer defers inside it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..kernels import settings
from .attention import _captured_step, decode_launch

_MEMO_KEY = "step graph"  # in the layer's launch memo (``QAttnLayer._launches``)
_WARM = "warm"  # the memo's entry after the eager step in the captured form


def _device_ok(device: torch.device) -> bool:
    """Where steps are graphed: CUDA devices (the CPU tests replay the recorded step eagerly instead)."""
    return device.type == "cuda"


def defers(layer, key_states: torch.Tensor) -> bool:
    """Whether ``layer.update`` keeps this token pending for a step graph: a one-token step of a plain
    full-attention layer on a GPU, outside any capture or compilation."""
    return (key_states.shape[-2] == 1 and _device_ok(key_states.device) and settings.step_graphs()
            and not _captured_step.get() and not torch.compiler.is_compiling()
            and not (key_states.is_cuda and torch.cuda.is_current_stream_capturing()))


def _plain(query: torch.Tensor, layer, pattern, window, chunk, sinks, softcap) -> bool:
    """A step the graph reproduces: one query a row over the whole cache, no per-sequence range, no variant."""
    return (query.shape[2] == 1 and pattern.kv_start is None and pattern.kv_end is None
            and int(pattern.kv_len) == layer.get_seq_length() and window is None and chunk is None
            and sinks is None and softcap is None)


class _StepGraph:
    """One layer's captured step: input buffers for q, k, v, the output buffer, the graph, and the call that
    recorded it (``call``; None: none to compare, the step is replayed only through :func:`run`)."""

    def __init__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, decode, call,
                 copy_out: bool = False):
        self.key = _signature(query, key, scaling)
        self.call = call
        self.q, self.k, self.v = query.clone(), key.clone(), value.clone()
        self.out = _output_for(query)
        self.copy_out = copy_out or _STORAGE_USES is None  # a torch without the count: always a copy
        if not self.copy_out:
            self._out_storage = StorageWeakRef(self.out.untyped_storage())
            self._own_uses = _uses(self._out_storage)  # the buffer's own references, before any alias is handed out

        def step():
            layer.append_pending(self.k, self.v)
            decode(self.q, self.out)

        self._run = record(step).replay if query.is_cuda else step  # the CPU tests: the step, run as it is

    def held(self) -> bool:
        """Whether the output handed out last (or a view of it) is still alive: replaying would overwrite it."""
        return not self.copy_out and _uses(self._out_storage) > self._own_uses

    def replay(self, query, key, value) -> torch.Tensor:
        # one launch for the three copies on a GPU (a multi-tensor copy: the buffers are clones, same strides)
        torch._foreach_copy_((self.q, self.k, self.v), (query, key, value))
        return self.execute()

    def execute(self) -> torch.Tensor:
        """The step on the inputs the buffers hold; its output."""
        self._run()
        return self.out.clone() if self.copy_out else self.out.detach()  # detach: an alias, counted by held()


# torch's count of the references to a storage (its CUDA-graph trees ask it of their outputs): private, so read
# once here; without it every step graph copies its output
_STORAGE_USES = getattr(torch._C, "_storage_Use_Count", None)


def _uses(storage: StorageWeakRef) -> int:
    """Tensors (views included) that share the storage, however they were made."""
    return _STORAGE_USES(storage.cdata)


def record(step) -> torch.cuda.CUDAGraph:
    """``step`` recorded as a CUDA graph (nothing runs), on a side stream of the current device — a layer's step
    here, a whole model's in :class:`~hf_qattn.CapturedDecodeStep`. Not through ``torch.cuda.graph``: that
    synchronises the device and empties the allocator's cache first, which in the middle of a generation (a graph
    is re-recorded whenever a layer's storage grows, a model's step at every ``captured_generate`` call) hands every
    cached block back to the driver, and the model's next allocations wait for new ones."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = _capture_stream(current.device)
    side.wait_stream(current)  # the inputs' clones are written on the current stream
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            step()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the capture's own error would hide the step's
                graph.capture_end()
            raise
        graph.capture_end()
    current.wait_stream(side)
    return graph


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _signature(query: torch.Tensor, key: torch.Tensor, scaling) -> tuple:
    return query.shape, query.dtype, key.shape, key.dtype, scaling


def _output_for(query: torch.Tensor) -> torch.Tensor:
    """The decode's output (B, 1, Hq, D) for query (B, Hq, 1, D)."""
    return torch.empty(query.shape[0], 1, query.shape[1], query.shape[3], device=query.device, dtype=query.dtype)


def replay_recorded(layer, query: torch.Tensor, scaling, call) -> torch.Tensor | None:
    """The step's output from the layer's graph when the graph was recorded by this very call (``call``: the key of
    everything the integration's decisions read, which then end where they ended for the recording step) and
    takes this query; else None (the caller takes its decisions and attends through :func:`run`)."""
    entry, pending = layer.launch_memo().get(_MEMO_KEY), layer.pending()
    if (pending is None or not isinstance(entry, _StepGraph) or entry.call is None or entry.call != call
            or entry.held() or entry.key != _signature(query, pending[0], scaling)):
        return None
    return entry.replay(query, *layer.take_pending())


def run(layer, query: torch.Tensor, pattern, scaling, window, chunk, sinks, softcap, call=None) -> torch.Tensor | None:
    """The step's attention output (B, 1, Hq, D) with the pending token appended, from the layer's graph
    (captured here on its second plain step), or None where the step is not plain (the caller appends the
    token eagerly and attends as usual). Arguments as ``packed_attention``'s; ``call`` as :func:`replay_recorded`'s."""
    if not _plain(query, layer, pattern, window, chunk, sinks, softcap):
        return None
    key, value = layer.take_pending()  # written below, by the graph or eagerly
    memo = layer.launch_memo()
    entry = memo.get(_MEMO_KEY)
    fits = isinstance(entry, _StepGraph) and entry.key == _signature(query, key, scaling)
    if fits and not entry.held():
        entry.call = call
        return entry.replay(query, key, value)

    def decode(q, out):  # the captured form, run eagerly or recorded alike: every slot to the device-side count
        store = layer.storage()
        decode_launch().decode(q, store, store.v_bar, store.capacity, sm_scale=scaling, causal=pattern.causal,
                               length=store.device_length, k_bar=store.k_bar, out=out, launches=store.launches)

    if fits:  # the last output is still held: a new graph with a buffer of its own
        step = _StepGraph(layer, query, key, value, scaling, decode, call, copy_out=True)
    elif entry != _WARM:  # the first plain step on this storage or shape: eagerly, as the graph will run it
        layer.append_pending(key, value)
        out = _output_for(query)
        decode(query, out)
        memo[_MEMO_KEY] = _WARM
        return out
    else:
        step = _StepGraph(layer, query, key, value, scaling, decode, call)  # its inputs hold this step's q, k, v
    memo[_MEMO_KEY] = step
    return step.execute()
