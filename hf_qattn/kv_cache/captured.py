"""One decode step of a causal LM captured in a CUDA graph and replayed, over a static QAttnCache.

Eager decoding at batch 1 is bound by the host: a transformers model issues a few hundred small
kernels a step from Python (measured for an 8-layer Llama-3-8B-shaped model at a 16k prompt on the
H100: ≈ 10 ms of host per step against ≈ 2.5 ms of GPU; eval/results/probe-generate-step-*.log).
Replaying the step as a CUDA graph removes the host from the loop. That needs a step whose GPU work
reads nothing from the host that changes between steps: a :class:`~hf_qattn.QAttnCache` with
``static_max_len`` keeps its token count in device memory, where the append and decode kernels read
it, and this class keeps the token ids and positions in fixed buffers::

    cache = hf_qattn.QAttnCache(model, static_max_len=prompt_len + max_new_tokens)
    logits = model(ids, cache=cache, use_cache=True).logits             # the prefill runs eagerly
    step = hf_qattn.CapturedDecodeStep(model, cache)
    token = logits[:, -1:].argmax(-1)
    for _ in range(max_new_tokens):
        token = step(token)[:, -1].argmax(-1, keepdim=True)            # logits (B, 1, vocab) of the step

The first call runs eagerly (it compiles and warms the kernels), the second captures the step and
runs it, later calls only copy the new tokens in and replay. Every row of the batch is at the same
position (no left padding: pass ``position_ids`` to the model yourself for that). Attention calls
inside replays are not counted in :func:`hf_qattn.fallback_stats` (the capture's one call per layer is).
The returned logits are a buffer the next call overwrites: clone them to keep them.
"""

from __future__ import annotations

import inspect

import torch

from ..stats import record_degraded
from ..support import check_count
from .attention import QAttnCacheError, _captured_step
from .step_graph import record


def cache_argument(model) -> str:
    """The keyword under which ``model`` takes its cache: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _capture_device_ok(device: torch.device) -> bool:
    return device.type == "cuda"


class CapturedDecodeStep:
    """``step(input_ids) -> logits``: a decode step of ``model`` over ``cache``, replayed from a CUDA graph.

    Args:
        model: a causal LM with ``attn_implementation="qattn"``, on a CUDA device.
        cache: a :class:`~hf_qattn.QAttnCache` built with ``static_max_len`` and already filled by the
            prefill; every layer quantized (a plan's full-precision layers grow, and cannot be replayed),
            sliding-window and chunked layers included (a chunked layer's replayed read is its newest chunk from
            position 0: unpadded sequences; a padded step's read comes from host counts and is not replayable).
        warmup: eager steps before the capture (they compile the kernels; at least 1). They run the
            step exactly as captured.
    """

    def __init__(self, model, cache, *, warmup: int = 1):
        from .cache import QAttnCache, QAttnLayer

        if not isinstance(cache, QAttnCache):
            raise TypeError(f"cache must be an hf_qattn.QAttnCache; got {type(cache).__name__}")
        kinds = {type(layer).__name__ for layer in cache.layers if not isinstance(layer, QAttnLayer)}
        if kinds:
            raise QAttnCacheError(f"CapturedDecodeStep needs every cache layer quantized; this cache also has "
                                  f"{sorted(kinds)} layers (full-precision or special layers grow every step)")
        if any(layer.max_len is None for layer in cache.layers):
            raise QAttnCacheError("CapturedDecodeStep needs QAttnCache(..., static_max_len=N): storage that "
                                  "never moves and a token count kept on the device")
        if any(not layer.is_initialized or layer.get_seq_length() == 0 for layer in cache.layers):
            raise QAttnCacheError("run the prefill (model(ids, cache=cache)) before CapturedDecodeStep")
        if not _capture_device_ok(cache.layers[0].device):
            raise QAttnCacheError(f"CapturedDecodeStep replays a CUDA graph and needs the cache on a CUDA device; "
                                  f"it is on {cache.layers[0].device}")
        check_count("warmup", warmup, what="eager steps before the capture")
        first = cache.layers[0]
        self.model, self.cache, self._warmup = model, cache, warmup
        self._cache_kwargs = {cache_argument(model): cache}
        self.batch_size = first.batch_size
        self._ids = torch.zeros(self.batch_size, 1, device=first.device, dtype=torch.long)
        self._position = torch.full((1,), first.get_seq_length(), device=first.device, dtype=torch.long)
        self._storage = self._storage_ptrs()
        self._graph = None
        self._logits = None
        self._loaded = None  # the cache's count when _load ran (None: nothing loaded)

    def _run_eagerly_after(self, error: RuntimeError, counts: list[int]) -> torch.Tensor:
        """A capture failed: nothing captured ran, so the layers' host counts go back to ``counts`` (those the
        step's appends advanced); this step and every later one run eagerly, counted and warned once."""
        for layer, count in zip(self.cache.layers, counts):
            if layer.get_seq_length() != count:
                layer.advance_after_replay(count - layer.get_seq_length())
        self._graph = False
        reason = str(error).splitlines()[0][:160]
        record_degraded(f"CapturedDecodeStep: the model's step cannot be captured in a CUDA graph ({reason})",
                        "eager decode-step")
        return self._forward()

    def _storage_ptrs(self) -> tuple:
        return tuple(layer.storage().kq.data_ptr() for layer in self.cache.layers)

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        token = _captured_step.set(True)
        try:
            out = self.model(input_ids=self._ids, position_ids=self._position.expand(self.batch_size, 1),
                             cache_position=self._position, use_cache=True, **self._cache_kwargs)
        finally:
            _captured_step.reset(token)
        return out.logits

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._load(input_ids)
        return self._run()

    def _load(self, input_ids: torch.Tensor) -> None:
        """The step's host half: the checks, and the token ids and position copied into the graph's inputs.
        Side-effect free for the cache, so a loop can do it before it waits on its stop test (the GPU then
        waits for no Python between the test and the replay); :meth:`_run` runs the step it loaded."""
        if input_ids.shape != self._ids.shape:
            raise ValueError(f"input_ids must have shape {tuple(self._ids.shape)} (batch, 1); "
                             f"got {tuple(input_ids.shape)}")
        layers = self.cache.layers
        for layer in layers:  # a sliding-window layer's ring never fills
            if not hasattr(layer, "held_positions") and layer.get_seq_length() >= layer.get_max_length():
                raise QAttnCacheError(f"QAttnCache(static_max_len={layer.get_max_length()}) is full")
        if self._storage_ptrs() != self._storage:
            raise QAttnCacheError("the cache's storage moved (reorder/select of the batch): build a new "
                                  "CapturedDecodeStep")
        self._ids.copy_(input_ids)
        # the position from the cache's own count, every call (outside any capture): steps run on the cache
        # by other code in between keep the replayed step's positions right
        self._loaded = layers[0].get_seq_length()
        self._position.fill_(self._loaded)

    def _run(self) -> torch.Tensor:
        """Runs the step :meth:`_load` prepared (eagerly while warming up, then captured, then replayed)."""
        layers = self.cache.layers
        if self._loaded != layers[0].get_seq_length():
            raise QAttnCacheError("no step is loaded for the cache as it is now: call the step with its input_ids")
        self._loaded = None
        if self._warmup > 0:  # eager: compiles and warms every kernel the captured step launches
            self._warmup -= 1
            return self._forward()
        if self._graph is None:
            if self._ids.device.type != "cuda":
                raise QAttnCacheError(f"CUDA graphs need a CUDA device; the cache is on {self._ids.device}")
            counts = [layer.get_seq_length() for layer in layers]
            logits = []
            try:  # host state (the layers' lengths) advances here, once
                graph = record(lambda: logits.append(self._forward()))
            except RuntimeError as error:  # the model's own step cannot be captured (a host copy in its MoE, say)
                return self._run_eagerly_after(error, counts)
            self._logits = logits[0]
            graph.replay()
            self._graph = graph
            return self._logits
        if self._graph is False:
            return self._forward()
        self._graph.replay()
        for layer in layers:  # what the step's Python would have done
            layer.advance_after_replay(1)
        return self._logits
