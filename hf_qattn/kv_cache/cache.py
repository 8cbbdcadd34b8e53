"""QAttnCache: a transformers KV cache stored quantized, read directly by the decode kernel.

    cache = hf_qattn.QAttnCache(model)                      # model loaded with attn_implementation="qattn"
    out = model.generate(ids, cache=cache, max_new_tokens=256)   # past_key_values= before transformers 5.24
    cache.nbytes(), cache.nbytes(per_layer=True)            # bytes allocated (scales and centers included)
    cache.nbytes(used=True)                                 # the cached tokens' share of them

Each full-attention layer keeps K − k̄ in INT8 with one scale per token, or, where the model's plan
(``config.qattn_plan``, or ``plan=``) marks the layer ``int4``, in 4 bits per channel over groups of 64
tokens with a scale and zero point each (KIVI's layout; the newest tokens of an incomplete group wait in
full precision), and V − v̄ in INT8 with one scale per token; or, with ``int8_layout="groups"``, a layer
marked ``int8`` keeps both K − k̄ and V − v̄ in 8 bits per channel over 64-token groups (``int8g``). k̄, v̄ are
per-(batch, head, channel) centers fixed at the first fill, and so are the per-token formats' equalizers σ_K, σ_V
(each channel is divided by its range over the first fill before a token's scale is taken:
``formats.KV_EQ_FLOOR``). Every token is quantized once, when it is appended,
a grouped tensor when its group completes (``kernels/decode.py``; the formats in ``reference.py``).
Sliding-window and chunked layers (``config.layer_types``) are quantized the same way but hold only
the last window / chunk-size tokens, a ring (:class:`QAttnWindowLayer`): their storage never exceeds
that span rounded up to a whole block (64 tokens). A ring does not keep groups of consecutive tokens, so such a
layer stores INT8 K and V where the plan says ``int4`` or the layout groups (``precisions()`` shows it).
Layers the plan marks unquantized keep transformers' full-precision ``DynamicLayer`` (or its sliding-window layer); other special layer types (linear
attention, ...) keep transformers' own layer class.

What a layer's ``update`` returns:

- on the first fill (the prefill), the unquantized key/value states themselves, so the prefill
  attention is exactly what it is with a DynamicCache (the qattn prefill kernel quantizes them in
  its own tile format; sharing one quantization pass with the cache is not done yet);
- afterwards, :class:`PackedKV` handles: tensors with the shape (B, Hk, L, D) of the whole cache
  and no data. ``attn_implementation="qattn"`` recognises them (:func:`is_packed`) and runs
  :func:`packed_attention` on the quantized storage; any other attention implementation that
  touches them gets a :class:`QAttnCacheError` saying what to do.

``static_max_len`` preallocates every layer's storage for that many tokens (no reallocation while
generating; exceeding it raises) and keeps each layer's token count in device memory as well
(``QAttnLayer.storage().device_length``), which the append and decode kernels read: a decode step then
has no host-side value that changes from step to step, so it can be captured in a CUDA graph and
replayed (:class:`hf_qattn.CapturedDecodeStep`). A sliding-window or chunked layer's ring is its static storage:
the count a one-token read takes (every held slot, or the newest chunk's) and the next slot live in device memory
and advance there. A full-attention layer's eager one-token steps on a GPU keep the count in device memory too,
from their first one: each such step is replayed from the layer's own CUDA graph (:mod:`.step_graph`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..plan import PLAN_CONFIG_KEY, QAttnPlan
from ..support import check_count
from . import reference, step_graph
from .attention import PackedKV, QAttnCacheError, _kernels_available, decode_launch, is_packed  # noqa: F401

try:
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, DynamicLayer
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # transformers < 5: the cache is unavailable, the rest of hf_qattn still imports
    Cache = CacheLayerMixin = object
    DynamicLayer = DYNAMIC_LAYER_TYPE_MAPPING = get_layer_types_and_kwargs = None

CENTER_SAMPLE = 256
# Growth of a layer's storage (without static_max_len): whole blocks (reference.block_tokens: 64 tokens, per-token
# V's tiles or INT4's groups), and at least a sixteenth of what is held, so appending one token at a time reallocates
# (and copies) every L/16 tokens while what is allocated stays within about 1/16 of what is used — doubling
# (the usual rule) would hold twice the bytes of a 4k prompt from its first generated token on, more than a
# bf16 cache of the same tokens.
_GROWTH_DIVISOR = 16


def _whole_blocks(tokens: int, precision: str = "int8") -> int:
    block = reference.block_tokens(precision)
    return -(-tokens // block) * block


class CacheStorage(NamedTuple):
    """A read view of a :class:`QAttnLayer`'s storage (the tensors themselves, not copies; only the layer
    writes them): what the attention over the cache reads.

    ``precision``, ``kq``, ``ks``, ``vq``, ``vs``, ``k_recent``, ``v_recent``, ``k_eq``, ``v_eq`` as
    :class:`reference.Buffers` (which
    the kernels take), ``k_bar`` / ``v_bar`` (B, Hk, D) the centers; the first ``length`` tokens are cached.
    ``device_length``: the same count as a (1,) int32 tensor on the device with static storage or once the layer's
    step graph (step_graph.py) has been used, else None.
    """

    precision: str
    kq: torch.Tensor
    ks: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    k_recent: torch.Tensor | None
    v_recent: torch.Tensor | None
    k_eq: torch.Tensor | None
    v_eq: torch.Tensor | None
    k_bar: torch.Tensor
    v_bar: torch.Tensor
    length: int
    capacity: int
    device_length: torch.Tensor | None
    launches: dict | None = None  # the layer's memo of bound kernel launches (decode_launch.decode's ``launches``)


class QAttnLayer(CacheLayerMixin):
    """One layer of :class:`QAttnCache`: INT8 / INT4 K and INT8 V, or 8-bit K and V groups (``reference.Buffers``),
    fixed centers (and equalizers).

    The storage is the layer's own: it writes it in :meth:`update` (and ``crop``, ``reset``, the batch
    selections); the attention reads it through :meth:`storage`, and a replayed CUDA graph step reports
    its appended token through :meth:`advance_after_replay`.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, precision: str = "int8", max_len: int | None = None, center_sample: int | None = CENTER_SAMPLE):
        """``precision``: one of ``reference.PRECISIONS`` (the storage formats its docstring lists)."""
        super().__init__()
        if precision not in reference.PRECISIONS:
            raise ValueError(f"precision must be one of {reference.PRECISIONS} for a quantized layer; got {precision!r}")
        self.precision = precision
        # static storage holds whole blocks (as ``reserve``): the tokens it takes are the ones it holds
        self.max_len = None if max_len is None else _whole_blocks(max_len, precision)
        self.center_sample = center_sample
        self._length = 0
        self._capacity = 0
        self._buffers = None  # reference.Buffers
        self._k_bar = self._v_bar = None
        self._device_length = None  # static storage: the token count as a (1,) int32 tensor on the device
        # the append and decode launches bound to this storage (decode_launch's ``launches``) and the step graph
        # (step_graph.py): a decode step's host time; emptied whenever the storage or the centers are replaced,
        # which they hold
        self._launches = {}
        self._pending = None  # a step's (key, value) whose append step_graph.run does; see _flush

    def __repr__(self):
        return f"QAttnLayer({self.precision}, tokens={self._length})"

    # -- storage ----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        if value_states.shape[-1] != self.head_dim:
            raise QAttnCacheError("QAttnCache needs the same head dim for keys and values")
        if reference.k_grouped(self.precision) and self.head_dim > 256:
            raise QAttnCacheError("QAttnCache supports head dims up to 256")
        if self.max_len is not None:
            self._allocate(self.max_len)
            self._device_length = torch.zeros(1, device=self.device, dtype=torch.int32)
        self.is_initialized = True

    def _allocate(self, capacity: int) -> None:
        old = self._buffers
        self._buffers = reference.allocate(self.batch_size, self.num_heads, capacity, self.head_dim, self.precision,
                                           self.device, self.dtype)
        if old is not None and self._length:
            n, groups = self._length, self._length // reference.GROUP
            k_rows = groups if reference.k_grouped(self.precision) else n  # grouped scales: a row per whole group
            v_rows = groups if reference.v_grouped(self.precision) else n
            # per-token V: whole tiles of V_TILE slots (reference.allocate)
            vq_rows = n if reference.v_grouped(self.precision) else -(-n // reference.V_TILE)
            for new, prev, rows in zip(self._buffers[1:5], old[1:5], (n, k_rows, vq_rows, v_rows)):
                new[:, :, :rows].copy_(prev[:, :, :rows])
            for new, prev in zip(self._buffers[5:], old[5:]):
                if prev is not None:
                    new.copy_(prev)
        self._capacity = self._buffers.kq.shape[2]  # INT4 rounds up to whole groups
        self._launches = {}

    def _reserve(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        if self.max_len is not None:
            raise QAttnCacheError(f"QAttnCache(static_max_len={self.max_len}) is full: {needed} tokens asked for")
        capacity = max(needed, self._capacity + max(reference.block_tokens(self.precision),
                                                    self._capacity // _GROWTH_DIVISOR))
        self._allocate(_whole_blocks(capacity, self.precision))

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._flush()
        n = key_states.shape[-2]
        first = self._k_bar is None
        if first:  # the first fill fixes the centers, and (once the storage exists) the equalizers
            self._k_bar, self._v_bar = reference.centers(key_states, value_states, self.center_sample)
        self._reserve(self._length + n)
        if first:
            reference.set_equalizers(self._buffers, key_states, value_states, self._k_bar, self._v_bar)
        # static storage: the kernel reads the first slot from device memory (the same in every replay)
        self._write(key_states, value_states, self._length if self._device_length is None else self._device_length)
        self._length += n
        if self._device_length is not None:
            self._device_length.add_(n)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, slot: int | torch.Tensor) -> None:
        """Quantize the tokens into the consecutive slots from ``slot`` on (an int, or a (1,) device tensor)."""
        if _kernels_available(self.device):
            decode_launch().append(key_states, value_states, self._k_bar, self._v_bar, self._buffers, slot,
                                 launches=self._launches)
        else:
            reference.append(key_states, value_states, self._k_bar, self._v_bar, self._buffers, int(slot))

    # -- a decode step's deferred append (step_graph.py) -----------------------------------------------
    def _defer(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Count the token now, append it in the step's attention (its CUDA graph): room reserved first (a
        growth empties the memo, graph included), the count kept on the device too from now on."""
        self._flush()
        self._reserve(self._length + 1)
        if self._device_length is None:
            self._device_length = torch.full((1,), self._length, device=self.device, dtype=torch.int32)
        self._pending = (key_states, value_states)
        self._length += 1

    def pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deferred token's (key, value), or None."""
        return self._pending

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The deferred token, handed to whoever writes it (:meth:`append_pending`, its step graph)."""
        pending, self._pending = self._pending, None
        return pending

    def append_pending(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write a counted-but-unwritten token at the device-side count and advance that (the captured form)."""
        self._write(key_states, value_states, self._device_length)
        self._device_length.add_(1)

    def _flush(self) -> None:
        """Write a deferred token before anything reads or changes the storage."""
        if self._pending is not None:
            self.append_pending(*self.take_pending())

    def reserve(self, tokens: int) -> None:
        """Static storage for ``tokens`` (as ``static_max_len``), set before the first fill: allocated
        once, never moved, the token count kept on the device as well."""
        if self.is_initialized:
            if self.max_len is None or self.max_len < tokens:
                raise QAttnCacheError(f"the cache layer is filled already ({self._capacity} tokens of storage); "
                                      f"{tokens} tokens of static storage must be reserved before the first fill")
            return
        # whole blocks: the scales' strides stay divisible by 16, as every other capacity's (no new kernel
        # specialization for a generate of an odd length), and INT4's groups whole
        self.max_len = max(self.max_len or 0, _whole_blocks(tokens, self.precision))

    def advance_after_replay(self, tokens: int = 1) -> None:
        """Count ``tokens`` appended by a replayed CUDA graph: the captured append already wrote them and
        advanced the device count; only the host count, which the graph cannot touch, moves here."""
        self._length += tokens

    # -- CacheLayerMixin ------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self._length == 0
        if not first and step_graph.defers(self, key_states):  # (QAttnWindowLayer has its own update)
            self._defer(key_states, value_states)
        else:
            self._append(key_states, value_states)
        if first:
            return key_states, value_states
        return PackedKV(self, "keys"), PackedKV(self, "values")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def packed_length(self) -> int:
        """Tokens the mask of a one-token step covers, the token dim of the :class:`PackedKV` handles."""
        return self._length

    def get_seq_length(self) -> int:
        return self._length

    def get_max_length(self) -> int:
        return self.max_len if self.max_len is not None else -1

    def reset(self) -> None:
        self._pending = None
        self._length = 0
        if self._device_length is not None:
            self._device_length.zero_()
        self._k_bar = self._v_bar = None
        self._launches = {}
        if self.max_len is None:
            self._buffers = None
            self._capacity = 0
            self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self._flush()
        length = max(0, self._length + tokens_to_remove)
        group = reference.GROUP
        first = length // group * group
        if reference.k_grouped(self.precision) and length % group and first + group <= self._length:
            # back inside a group quantized already: a grouped tensor's kept tokens wait in its recent rows again
            # (dequantized, so they are quantized twice when the group completes anew)
            buf, kept, at = self._buffers, length - first, slice(first // group, first // group + 1)
            v_grouped = reference.v_grouped(self.precision)
            one = buf._replace(kq=buf.kq[:, :, first: first + group], ks=buf.ks[:, :, at],
                               vq=buf.vq[:, :, first: first + group] if v_grouped else buf.vq,
                               vs=buf.vs[:, :, at] if v_grouped else buf.vs)
            buf.k_recent[:, :, :kept] = reference.dequantize_k(one, self.head_dim, group)[:, :, :kept]
            if reference.v_grouped(self.precision):
                buf.v_recent[:, :, :kept] = reference.dequantize_v(one, self.head_dim, group)[:, :, :kept]
        self._length = length
        if self._device_length is not None:
            self._device_length.fill_(self._length)

    def _select(self, index: torch.Tensor) -> None:
        self._flush()
        if self._buffers is None:
            return
        index = index.to(self.device)
        picked = [t if t is None or isinstance(t, str) else t.index_select(0, index).contiguous() for t in self._buffers]
        self._buffers = reference.Buffers(*picked)
        self._launches = {}
        for name in ("_k_bar", "_v_bar"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index).contiguous())
        self.batch_size = self._buffers.kq.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._buffers is not None:
            self._select(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def offload(self):
        raise QAttnCacheError("QAttnCache does not support offloading")

    def prefetch(self):
        pass

    # -- reading ------------------------------------------------------------------------------------
    def storage(self) -> CacheStorage:
        """The storage as a :class:`CacheStorage` view, for the attention over the cache (and benchmarks)."""
        self._flush()
        return CacheStorage(*self._buffers, self._k_bar, self._v_bar, self._length, self._capacity,
                            self._device_length, self._launches)

    def launch_memo(self) -> dict:
        """The launches bound to the current storage and its step graph (``CacheStorage.launches``), without
        writing a deferred token (which :meth:`storage` does)."""
        return self._launches

    def nbytes(self, used: bool = False) -> int:
        """Bytes of the storage: quantized K and V, their scales, a grouped format's incomplete group, the centers —
        as allocated (the whole capacity: what the cache takes from the device), or with ``used`` only the cached
        tokens' share of what grows with the tokens."""
        if self._buffers is None:
            return 0
        buf = self._buffers
        slots = sum(t.numel() * t.element_size() for t in buf[1:5])  # kq, ks, vq, vs: in proportion to capacity
        fixed = sum(t.numel() * t.element_size() for t in (*buf[5:], self._k_bar, self._v_bar) if t is not None)
        return (slots * self._length) // self._capacity + fixed if used else slots + fixed

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) (B, Hk, L, D) in the model's dtype, rebuilt from the storage — for fallbacks only."""
        self._flush()
        n = self._length
        k = reference.dequantize_k(self._buffers, self.head_dim, n)
        v = reference.dequantize_v(self._buffers, self.head_dim, n)
        return (k + self._k_bar[:, :, None]).to(self.dtype), (v + self._v_bar[:, :, None]).to(self.dtype)



WINDOW_KINDS = ("sliding_attention", "chunked_attention")


class QAttnWindowLayer(QAttnLayer):
    """A sliding-window or chunked layer of :class:`QAttnCache`: quantized as :class:`QAttnLayer`, holding only
    the last ``span`` tokens, so its storage never exceeds the span (rounded up to whole blocks).

    ``span`` is the window W (``sliding_attention``: the query at p sees keys p − W < j ≤ p) or the chunk size C
    (``chunked_attention``: keys of p's chunk, j // C == p // C, j ≤ p; with left padding transformers counts
    chunks from each sequence's first real token). The token at position p lives in slot p mod span, a ring:
    the held positions are [seen − span, seen). For a window that is exactly what the next one-token query
    sees, and attention is the same for any order of its keys, so such a step reads every slot without a
    position mask; a chunk is a suffix of the held positions (which suffix depends on the sequence's padding:
    the chunk's start is read from the mask, so a chunked layer keeps the last C tokens rather than resetting
    at a boundary of its own), read as a slot range (:func:`~hf_qattn.kv_cache.attention.packed_attention`).

    Toward transformers it behaves as its ``DynamicSlidingWindowLayer`` (which it replaces for both kinds):
    ``get_seq_length`` counts every token seen, ``get_mask_sizes`` gives the window's key count and offset, and a
    step of several tokens over a filled layer gets full-precision K/V of the positions that mask covers — the
    held tokens dequantized and the new ones — since its queries see different windows, which one ring read
    cannot give them.
    """

    is_sliding = True

    def __init__(self, kind: str, span: int, precision: str = "int8", center_sample: int | None = CENTER_SAMPLE):
        if reference.k_grouped(precision):  # groups are runs of consecutive slots and tokens, which a ring breaks
            precision = "int8"
        if kind not in WINDOW_KINDS:
            raise ValueError(f"kind must be one of {WINDOW_KINDS}; got {kind!r}")
        if isinstance(span, bool) or not isinstance(span, int) or span < 1:
            raise ValueError(f"span (the {'sliding window' if kind == WINDOW_KINDS[0] else 'chunk size'}) must be "
                             f"an int ≥ 1; got {span!r}")
        super().__init__(precision, None, center_sample)
        self.kind, self.span = kind, span
        self._seen = 0  # every token appended (the position of the next one)
        self._device_slot = None  # static storage: the next token's slot, seen mod span, on the device

    def __repr__(self):
        return f"QAttnWindowLayer({self.kind}, span={self.span}, {self.precision}, seen={self._seen})"

    @property
    def sliding_window(self) -> int:  # transformers' name for the span of its sliding-window layers
        return self.span

    def _keep_from(self, seen: int) -> int:
        """The first position held after ``seen`` tokens."""
        return max(seen - self.span, 0)

    def _reserve(self, needed: int) -> None:
        super()._reserve(min(needed, self.span))

    def _allocate(self, capacity: int) -> None:
        super()._allocate(min(capacity, _whole_blocks(self.span)))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.max_len is not None:
            self._device_slot = torch.zeros(1, device=self.device, dtype=torch.int32)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = key_states.shape[-2]
        if self._device_slot is not None and n == 1 and self._seen > 0:
            # a decode step over static storage: the slot and the held count come from device memory and advance
            # there (a replayed CUDA graph writes the right slot); the host counts advance alike
            self._write(key_states, value_states, self._device_slot)
            self.advance_after_replay(1)  # the host counts, as after a replay of this step
            if self.kind == "sliding_attention":  # every held slot
                self._device_length.add_(1).clamp_(max=self.span)
            else:  # the new token's chunk: slots 0 to its own (chunks start at multiples of the span)
                torch.add(self._device_slot, 1, out=self._device_length)
            self._device_slot.add_(1).remainder_(self.span)
            return
        first = self._k_bar is None
        if first:
            self._k_bar, self._v_bar = reference.centers(key_states, value_states, self.center_sample)
        total = self._seen + n
        keep_from = self._keep_from(total)
        self._reserve(total - keep_from)
        if first:
            reference.set_equalizers(self._buffers, key_states, value_states, self._k_bar, self._v_bar)
        first = max(self._seen, keep_from)  # tokens before it are out of every later window
        slot = first % self.span
        run = min(total - first, self.span - slot)  # up to the ring's end, then the rest from slot 0
        self._write(key_states[:, :, first - self._seen: first - self._seen + run],
                    value_states[:, :, first - self._seen: first - self._seen + run], slot)
        if first + run < total:
            self._write(key_states[:, :, first - self._seen + run:], value_states[:, :, first - self._seen + run:], 0)
        self._seen, self._length = total, total - keep_from
        self._sync_device_counts()

    def device_count(self) -> int:
        """Static storage: the slots a one-token read takes from device memory, as the host counts them — every
        held slot (a window), or the newest token's chunk, slots 0 to (seen − 1) mod span (an unpadded sequence's
        chunks start at multiples of the span, in slot 0)."""
        if self.kind == "sliding_attention":
            return self._length
        return (self._seen - 1) % self.span + 1 if self._seen else 0

    def _sync_device_counts(self) -> None:
        """Static storage: the device's read count and next slot set from the host's (never inside a capture:
        only a decode step of one token is replayed, and it advances them on the device)."""
        if self._device_slot is not None:
            self._device_length.fill_(self.device_count())
            self._device_slot.fill_(self._seen % self.span)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self._seen == 0:  # the prefill: its own K/V, as for a full layer
            self._append(key_states, value_states)
            return key_states, value_states
        if n == 1:
            self._append(key_states, value_states)
            return PackedKV(self, "keys"), PackedKV(self, "values")
        cached = min(self._seen, self.span - 1)  # the held positions the mask of this step covers
        old_k, old_v = self._dequantized_last(cached)
        self._append(key_states, value_states)
        return (torch.cat([old_k, key_states.to(self.dtype)], dim=-2),
                torch.cat([old_v, value_states.to(self.dtype)], dim=-2))

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # as transformers' DynamicSlidingWindowLayer: the last span − 1 positions and the step's own (its
        # argument: the query length, or in some 5.x versions the step's cache_position tensor)
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[-1]
        return min(self._seen, self.span - 1) + query_length, max(self._seen - self.span + 1, 0)

    def get_seq_length(self) -> int:
        return self._seen

    def get_max_length(self) -> int:
        return self.span

    def packed_length(self) -> int:
        return min(self._seen, self.span)

    def reserve(self, tokens: int) -> None:
        """Static storage (a CUDA-graph decode step): the ring of ``span`` slots, whatever ``tokens``, with the
        count a one-token read takes (:meth:`device_count`) and the next slot in device memory. A chunked layer's
        device count is its newest chunk's, which holds for unpadded sequences (chunks from position 0); a padded
        step reads the slot range its mask gives, from the host's counts (not replayable)."""
        super().reserve(self.span)

    def advance_after_replay(self, tokens: int = 1) -> None:
        self._seen += tokens
        self._length = min(self._seen, self.span)

    def reset(self) -> None:
        super().reset()
        self._seen = 0
        if self._device_slot is not None:
            self._device_slot.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        seen = max(0, self._seen + tokens_to_remove)
        first = self._seen - self._length
        if first > max(seen - self.span + 1, 0):  # the next token's query could see positions from there on
            raise QAttnCacheError(f"cannot crop this {self.kind} cache layer back to {seen} tokens: positions its "
                                  f"next query sees were dropped already (it holds {first} on)")
        self._seen, self._length = seen, max(seen - max(first, self._keep_from(seen)), 0)
        if seen == 0:
            self.reset()
        self._sync_device_counts()

    def held_positions(self) -> tuple[int, int]:
        """[keep_from, seen): the positions the layer holds; the token at p is in slot p mod span."""
        return self._seen - self._length, self._seen

    def chronological_slots(self) -> torch.Tensor:
        """Slot indices of the held tokens, oldest first (for a read that needs positions in order)."""
        first, seen = self.held_positions()
        return torch.arange(first, seen, device=self.device) % self.span

    def _dequantized_last(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) (B, Hk, count, D) of the last ``count`` positions in order, zeros for any not held."""
        first, seen = self.held_positions()
        positions = torch.arange(seen - count, seen, device=self.device)
        held = positions >= first
        slots = torch.where(held, positions % self.span, 0)
        k = reference.dequantize_k(self._buffers, self.head_dim, count, slots=slots)
        v = reference.dequantize_v(self._buffers, self.head_dim, count, slots=slots)
        k = torch.where(held[:, None], k + self._k_bar[:, :, None], 0.0)
        v = torch.where(held[:, None], v + self._v_bar[:, :, None], 0.0)
        return k.to(self.dtype), v.to(self.dtype)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the positions a one-token step's mask covers (:meth:`packed_length`), oldest first."""
        return self._dequantized_last(self.packed_length())


def _layer_nbytes(layer, used: bool) -> int:
    if isinstance(layer, QAttnLayer):
        return layer.nbytes(used)
    total = 0
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _layer_specs(config) -> tuple[list[str], list[dict]]:
    """(layer type, constructor kwargs) of each decoder layer, whatever the transformers 5.x version.

    transformers <= 5.17 returns one kwargs dict shared by all layers, later versions a list with one
    dict per layer; zipping the layer types with a shared (often empty) dict gave no layers at all.
    A config whose layer types fall short of ``num_hidden_layers`` (and that shares no KV between
    layers) gets full-attention layers for the rest.
    """
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    layer_types = list(layer_types)
    shared_dict = isinstance(layer_kwargs, dict)
    if shared_dict:
        layer_kwargs = [dict(layer_kwargs) for _ in layer_types]
    layer_kwargs = list(layer_kwargs) + [{}] * (len(layer_types) - len(layer_kwargs))
    # a window / chunk the kwargs leave out, or one dict shared by sliding and chunked layers alike (older
    # versions): each layer kind's span from the config itself
    spans = {"sliding_attention": getattr(config, "sliding_window", None),
             "chunked_attention": getattr(config, "attention_chunk_size", None)}
    layer_kwargs = [dict(kwargs, sliding_window=spans[kind])
                    if kind in spans and spans[kind] is not None and (shared_dict or kwargs.get("sliding_window") is None)
                    else kwargs for kind, kwargs in zip(layer_types, layer_kwargs)]
    shared = getattr(config, "num_kv_shared_layers", None) or getattr(config, "kv_sharing_modes", None)
    num_layers = getattr(config, "num_hidden_layers", None)
    if not shared and isinstance(num_layers, int) and len(layer_types) < num_layers:
        missing = num_layers - len(layer_types)
        layer_types += ["full_attention"] * missing
        layer_kwargs += [{} for _ in range(missing)]
    return layer_types, layer_kwargs


class QAttnCache(Cache):
    """A transformers ``Cache`` whose layers are stored quantized — full-attention layers whole, sliding and
    chunked ones as a ring of their span (see the module docstring).

    Args:
        model_or_config: the model (or its config); the layer count, layer types and the plan come from it.
        plan: a :class:`QAttnPlan`, a plan dict, or one precision for every layer (``"int8"``, ``"int4"``,
            or the unquantized one, which keeps transformers' DynamicLayer). Default:
            ``config.qattn_plan`` when present, else ``"int8"`` everywhere.
        static_max_len: preallocate storage for this many tokens per layer (no reallocation; a sliding-window or
            chunked layer: its span, with its read count and next slot in device memory).
        center_sample: tokens sampled for the centers k̄, v̄ (None: all tokens of the first fill).
        int8_layout: how a full-attention layer the plan marks ``int8`` is stored: ``"tokens"`` (INT8 K and V, one
            scale a token, the channels equalized by the first fill) or ``"groups"`` (8-bit K and V per channel over
            64-token groups, the newest group in full precision: the ``int8g`` precision). SmolLM2, the prefill
            unquantized: 15 / 16 of 20 greedy continuations identical to the float32 cache's; the tokens layout
            decodes 1.4–1.5× faster (eval/results/cache-accuracy-*, decode-*). Sliding-window and chunked layers
            keep tokens.
    """

    INT8_LAYOUTS = {"tokens": "int8", "groups": "int8g"}

    def __init__(self, model_or_config, plan=None, static_max_len: int | None = None,
                 center_sample: int | None = CENTER_SAMPLE, int8_layout: str = "tokens"):
        if int8_layout not in self.INT8_LAYOUTS:
            raise ValueError(f"int8_layout must be one of {tuple(self.INT8_LAYOUTS)}; got {int8_layout!r}")
        check_count("static_max_len", static_max_len, none_ok=True, what="tokens a layer holds")
        check_count("center_sample", center_sample, none_ok=True, what="tokens the centers are sampled from")
        self._int8_precision = self.INT8_LAYOUTS[int8_layout]
        if get_layer_types_and_kwargs is None:
            raise ImportError("hf_qattn.QAttnCache needs transformers >= 5.0")
        config = getattr(model_or_config, "config", model_or_config)
        if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
            raise TypeError(f"model_or_config must be a transformers model or its config; got "
                            f"{type(model_or_config).__name__}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types, layer_kwargs = _layer_specs(text)
        if plan is None:
            self.plan = QAttnPlan.resolve(getattr(text, PLAN_CONFIG_KEY, None), num_layers=len(layer_types), stored=True)
        else:
            self.plan = QAttnPlan.resolve(plan, num_layers=len(layer_types))
        self._static_max_len, self._center_sample = static_max_len, center_sample
        super().__init__(layers=[self._make_layer(i, kind, kwargs)
                                 for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs))])

    def _make_layer(self, index: int, kind: str = "full_attention", kwargs: dict | None = None):
        precision = self.plan.precision(index) if self.plan is not None else "int8"
        quantized = precision in ("int8", "int4")
        if precision == "int8":
            precision = self._int8_precision
        if kind == "full_attention" and quantized:
            return QAttnLayer(precision, self._static_max_len, self._center_sample)
        if kind == "full_attention":
            return DynamicLayer()
        span = (kwargs or {}).get("sliding_window")
        if kind in WINDOW_KINDS and quantized and span is not None:
            layer = QAttnWindowLayer(kind, int(span), precision, self._center_sample)
            if self._static_max_len is not None:
                layer.reserve(self._static_max_len)
            return layer
        # unquantized by the plan, linear attention, ...: transformers' own layer
        return DYNAMIC_LAYER_TYPE_MAPPING[kind](**(kwargs or {}))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A layer index past the layers built from the config (a config that under-reports its layers):
        # create full-attention layers on demand rather than fail with an IndexError.
        while len(self.layers) <= layer_idx:
            self.layers.append(self._make_layer(len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reserve(self, tokens: int) -> None:
        """Static storage for ``tokens`` per layer (as ``static_max_len=tokens``; a sliding-window or chunked layer's
        ring of its span), before the first fill: what a CUDA-graph decode step needs. Every layer must be
        quantized."""
        check_count("tokens", tokens)
        others = sorted({type(layer).__name__ for layer in self.layers if not isinstance(layer, QAttnLayer)})
        if others:
            raise QAttnCacheError(f"static storage needs every cache layer quantized; this cache also has {others} "
                                  "layers")
        for layer in self.layers:
            layer.reserve(tokens)
        self._static_max_len = max(self._static_max_len or 0, tokens)

    def precisions(self) -> list[str]:
        """Storage of each layer: "int8", "int4", "int8g", or the name of the unquantized layer class."""
        return [layer.precision if isinstance(layer, QAttnLayer) else type(layer).__name__ for layer in self.layers]

    def nbytes(self, per_layer: bool = False, used: bool = False):
        """Bytes the cache has allocated (scales and centers included), or with ``used`` the cached
        tokens' share of them: the total, or a list per layer. Full-precision layers hold exactly
        their tokens."""
        sizes = [_layer_nbytes(layer, used) for layer in self.layers]
        return sizes if per_layer else sum(sizes)
