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

The graph lives in the layer's launch memo, which is emptied whenever its storage moves (growth, a batch
selection, a crop into a group, a reset): the next plain step warms and captures anew. ``HF_QATTN_STEP_GRAPHS=0``
turns this off (every step launches eagerly). :class:`~hf_qattn.CapturedDecodeStep` (a whole model step in one
graph) runs its own capture: no layer defers inside it.
"""

from __future__ import annotations

import torch

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
    """One layer's captured step: input buffers for q, k, v, the output buffer, the graph."""

    def __init__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, decode):
        self.key = _signature(query, key, scaling)
        self.q, self.k, self.v = query.clone(), key.clone(), value.clone()
        self.out = _output_for(query)

        def step():
            layer.append_pending(self.k, self.v)
            decode(self.q, self.out)

        if query.is_cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records, runs nothing
                step()
            self._run = graph.replay
        else:  # the CPU tests: the recorded step, run as it is
            self._run = step

    def replay(self, query, key, value) -> torch.Tensor:
        self.q.copy_(query)
        self.k.copy_(key)
        self.v.copy_(value)
        self._run()
        return self.out.clone()  # the buffer is overwritten by the layer's next step


def _signature(query: torch.Tensor, key: torch.Tensor, scaling) -> tuple:
    return tuple(query.shape), query.dtype, tuple(key.shape), key.dtype, scaling


def _output_for(query: torch.Tensor) -> torch.Tensor:
    """The decode's output (B, 1, Hq, D) for query (B, Hq, 1, D)."""
    return torch.empty(query.shape[0], 1, query.shape[1], query.shape[3], device=query.device, dtype=query.dtype)


def run(layer, query: torch.Tensor, pattern, scaling, window, chunk, sinks, softcap) -> torch.Tensor | None:
    """The step's attention output (B, 1, Hq, D) with the pending token appended, from the layer's graph
    (captured here on its second plain step), or None where the step is not plain (the caller appends the
    token eagerly and attends as usual). Arguments as ``packed_attention``'s."""
    if not _plain(query, layer, pattern, window, chunk, sinks, softcap):
        return None
    key, value = layer.take_pending()  # written below, by the graph or eagerly
    memo = layer.storage().launches  # the current storage's launch memo
    entry = memo.get(_MEMO_KEY)
    if isinstance(entry, _StepGraph) and entry.key == _signature(query, key, scaling):
        return entry.replay(query, key, value)

    def decode(q, out):  # the captured form, run eagerly or recorded alike: every slot to the device-side count
        store = layer.storage()
        decode_launch().decode(q, store, store.v_bar, store.capacity, sm_scale=scaling, causal=pattern.causal,
                               length=store.device_length, k_bar=store.k_bar, out=out, launches=store.launches)

    if entry != _WARM:  # the first plain step on this storage or shape: eagerly, as the graph will run it
        layer.append_pending(key, value)
        out = _output_for(query)
        decode(query, out)
        memo[_MEMO_KEY] = _WARM
        return out
    step = _StepGraph(layer, query, key, value, scaling, decode)  # its inputs hold this step's q, k, v
    memo[_MEMO_KEY] = step
    step._run()
    return step.out.clone()
