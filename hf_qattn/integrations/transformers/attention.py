"""The ``"qattn"`` attention function for transformers' attention interface.

Per call, :func:`qattn_attention_forward`

1. reads the layer's precision from the plan in ``module.config.qattn_plan`` by the layer index
   (``module.layer_idx``; models without one get indices in module order at construction). With
   no plan every layer runs ``"int8"`` (:data:`hf_qattn.plan.DEFAULT_PRECISION`): the safe choice, as
   accurate as the method gets. A plan precision ``"unquantized"`` runs the model's full-precision
   attention, counted as call path ``"unquantized-by-plan"`` (a choice, not a fallback).
2. reads the attention variant the model hands the call (:func:`model_variants`): a sliding window
   (the ``sliding_window`` keyword), a chunk (Llama 4's ``chunked_attention`` layers, from the config:
   no keyword carries it), attention sinks (``s_aux`` / ``sinks``) and soft-capping (``softcap``).
3. turns the mask (boolean or additive) into what the kernel understands — causal (aligned
   bottom-right), a per-sequence key range [kv_start, kv_end) and, where the mask needs it, the
   layer's window or chunk — with the analysis both integrations share
   (:func:`hf_qattn.masks.cached_analysis`: once per mask tensor, exact or refused). The variant
   comes from the model; the mask only confirms it. Keys that no query sees (the empty tail of a
   static cache) are sliced off first.
4. calls :func:`hf_qattn.qattn` in HND layout, with fewer K/V heads for GQA (no repeat), and the
   window, chunk, sinks and soft-cap as its keywords.

Anything the kernel cannot serve runs in full precision instead, counted under its reason and
warned once (:func:`hf_qattn.fallback_stats`); the reasons are the ``REASON_*`` constants (those
that do not depend on the call's keywords or mask come from :mod:`hf_qattn.support`).
A fallback of a call with soft-capping, attention sinks, sparse indices or ``output_attentions``
runs the model's own eager attention (SDPA cannot express them), counted as path ``"eager"``; every
other fallback runs transformers' SDPA path with the model's own mask, counted as ``"sdpa"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import numbers
import sys
import threading
import warnings

import torch

from ... import api, masks, ops, quant, reference, support
from ...kernels import settings, tuning
from ...kv_cache import attention as kv_attention
from ...masks import MaskPattern
from ...plan import DEFAULT_PRECISION, PLAN_CONFIG_KEY, UNQUANTIZED, PlanError, QAttnPlan  # noqa: F401 (re-exported)
from ...support import (REASON_BATCH, REASON_DROPOUT, REASON_DTYPE, REASON_GRAD,  # noqa: F401  (re-exported)
                       REASON_HEAD_DIM, REASON_HEADS, REASON_VALUE_DIM)

ATTN_IMPLEMENTATION = "qattn"

REASON_SOFTCAP = "attention logit soft-capping by a value other than a finite number > 0 (softcap)"
REASON_SINKS = "attention sinks other than one logit per query head (s_aux / sinks of shape (heads,))"
REASON_WINDOW = "sliding_window or attention_chunk_size other than an int >= 1"
REASON_SPARSE = "sparse attention indices"
REASON_OUTPUT_ATTENTIONS = "output_attentions=True (attention weights requested)"
REASON_POSITION_BIAS = "additive position bias (position_bias)"
REASON_PAGED_CACHE = "paged KV cache (continuous batching)"
REASON_MASK_SHAPE = "attention mask of unexpected shape or type"
REASON_SLIDING_WINDOW = ("sliding-window or chunked layer whose mask is not causal ∧ window/chunk ∧ key range (a "
                         "bidirectional window, or a window / chunk other than the model's)")
REASON_MASK_PATTERN = masks.REASON_PATTERN
REASON_CAUSAL_SHAPE = "causal attention with more queries than keys"
# calibration scores each call with its variant (hf_qattn.calibration's attention_accuracy) on each sequence's own
# tokens; a several-query step whose chunks padding shifts has no such cut, so it is skipped, not scored wrongly
REASON_CALIBRATION_VARIANT = "calibration does not score chunks shifted by padding outside a prompt (a step over a cache)"

# Keyword arguments whose math SDPA cannot express: a full-precision fallback runs the model's eager attention.
_EAGER_ONLY = ("softcap", "s_aux", "sinks", "indices", "block_indices")
# Every keyword argument the decisions read (_unsupported, model_variants): a call with none of them set has the
# replay key of replay_key (a test holds the decisions to this list).
_DECIDING_KEYWORDS = ("indices", "block_indices", "output_attentions", "position_bias", "cache", "sliding_window",
                      "s_aux", "sinks", "softcap")
# Llama 4's chunked layers: the config names them (no keyword of the call carries the chunk size).
_CHUNKED_LAYER = "chunked_attention"


# ------------------------------------------------------------------------------------------------
# layer index and precision


def layer_index(module) -> int | None:
    """The plan index of an attention module: ``layer_idx``, else the one stamped at construction."""
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    return getattr(module, "_qattn_layer_idx", None)


def _num_layers(config) -> int | None:
    count = getattr(config, "num_hidden_layers", None)
    if count is None and hasattr(config, "get_text_config"):
        count = getattr(config.get_text_config(), "num_hidden_layers", None)
    return count if isinstance(count, int) else None


def plan_from_config(config) -> QAttnPlan | None:
    """The config's plan (checked against its layer count: :meth:`QAttnPlan.resolve`), or None when it
    carries none."""
    return QAttnPlan.resolve(getattr(config, PLAN_CONFIG_KEY, None), num_layers=_num_layers(config), stored=True)


_plan_cache: dict[int, tuple] = {}
_plan_cache_lock = threading.Lock()


def _cached_plan(config) -> QAttnPlan | None:
    # Resolving a plan on every call would cost more than a small attention; reuse it while the config's
    # plan (a dict, or a QAttnPlan) is the same object with the same content.
    data = getattr(config, PLAN_CONFIG_KEY, None)
    if data is None:
        return None
    entry = _plan_cache.get(id(data))
    if entry is not None and entry[0] is data and entry[1] == data:
        return entry[2]
    plan = plan_from_config(config)  # a QAttnPlan is validated in place: snapshot it afterwards
    with _plan_cache_lock:
        if len(_plan_cache) > 256:
            _plan_cache.clear()
        _plan_cache[id(data)] = (data, _snapshot(data), plan)
    return plan


def _snapshot(data):
    if isinstance(data, dict):
        return {key: _snapshot(value) for key, value in data.items()}
    if isinstance(data, QAttnPlan):
        return copy.deepcopy(data)
    return data


def _module_config(module):
    """The model config an attention module reads its plan from (stamped at construction when it has none)."""
    return getattr(module, "config", None) or getattr(module, "_qattn_config", None)


def _module_plan(module) -> QAttnPlan | None:
    config = _module_config(module)
    return _cached_plan(config) if config is not None else None


def layer_settings(module) -> tuple[str, bool | None]:
    """(precision, split_channel) of this attention module, from the plan by layer index: the precision
    (else :data:`DEFAULT_PRECISION`), and True where calibration found a K outlier channel in the layer
    (qattn then computes it apart), else None: qattn's default (``HF_QATTN_SPLIT_CHANNEL``)."""
    plan = _module_plan(module)
    if plan is None:
        return DEFAULT_PRECISION, None
    layer = layer_index(module)
    return plan.precision(layer), (True if plan.splits(layer) else None)


# ------------------------------------------------------------------------------------------------
# attention variants


def _span(value) -> int | None | str:
    """A window / chunk size as qattn takes it (an int ≥ 1, or None), else the reason it is not one."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        return REASON_WINDOW
    return int(value)


def _layer_chunk(module) -> int | None | str:
    """The chunk size of a ``chunked_attention`` layer (Llama 4: ``config.layer_types[layer]`` and
    ``config.attention_chunk_size``), else None."""
    config = _module_config(module)
    layer_types = getattr(config, "layer_types", None) if config is not None else None
    layer = layer_index(module)
    if not isinstance(layer_types, (list, tuple)) or layer is None or not 0 <= layer < len(layer_types):
        return None
    if layer_types[layer] != _CHUNKED_LAYER:
        return None
    return _span(getattr(config, "attention_chunk_size", None))


def model_variants(module, query, kwargs) -> tuple[dict, str | None]:
    """({window, chunk, sinks, softcap}, None): the attention variant the model hands this call, as
    :func:`hf_qattn.qattn`'s keywords (None where unused), or ({}, reason) when the kernel cannot take it.

    The one place that reads them:

    - ``window``: the call's ``sliding_window`` keyword (Mistral, Gemma 2/3, Cohere2, gpt-oss, ...). Its
      meaning is the mask's (``sliding_window_overlay``: key j seen from position p when j > p − W),
      which is qattn's, in transformers 5.17 and 5.24 alike;
    - ``chunk``: ``config.attention_chunk_size`` on the layers ``config.layer_types`` calls
      ``"chunked_attention"`` (Llama 4; the call carries no keyword for it);
    - ``sinks``: ``s_aux`` (gpt-oss) or ``sinks``, one logit per query head;
    - ``softcap``: the ``softcap`` keyword (Gemma 2).

    ``window`` and ``chunk`` are candidates: :func:`resolve_pattern` checks them against the mask and
    keeps them where the mask needs them (chunks that start elsewhere than at key 0 — a left-padded
    sequence's, a step's over a cache — are read off the mask too: ``MaskPattern.chunk_shift``). ``sinks`` and ``softcap`` change scores, not which keys are
    seen, and pass as they are. Reads shapes and plain values only (the same under torch.compile).
    """
    window = _span(kwargs.get("sliding_window"))
    chunk = _layer_chunk(module)
    for span in (window, chunk):
        if isinstance(span, str):
            return {}, span
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        heads = query.shape[1]
        if (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.numel() != heads
                or sum(size != 1 for size in sinks.shape) > 1):  # (H,), (1, H, 1, 1), ...: one logit per head
            return {}, REASON_SINKS
        sinks = sinks.reshape(heads).to(query.device)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap)
                or softcap <= 0):
            return {}, REASON_SOFTCAP
        softcap = float(softcap)
    return dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap), None


def _score_options(variants: dict) -> dict:
    """The variants that change scores (sinks, soft-cap), as qattn's keywords."""
    return dict(sinks=variants["sinks"], softcap=variants["softcap"])


# ------------------------------------------------------------------------------------------------
# masks


def causal_call(module, is_causal: bool | None, num_queries: int) -> bool:
    """Whether an attention call masks causally by its flags (without a mask, SDPA's ``is_causal``): the
    call's ``is_causal`` when given, else the module's, else True — with several queries only (one
    query row sees every key either way).

    This is transformers' own rule (``sdpa_attention_forward``): its attention modules set ``is_causal``,
    True in decoders and False in encoders, and a module that sets none is taken as causal. Everything
    that reads a transformers call's causality (the mask rules here, eager and compiled, and
    :mod:`hf_qattn.evaluation.layer_accuracy`) asks this function, so none can read it otherwise.
    """
    flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(flag) and num_queries > 1


def _biting(causal: bool, kv_len: int, window: int | None, chunk: int | None) -> tuple[dict, str | None]:
    """(the window / chunk a mask-free call must apply, None), or ({}, reason): a span narrows a causal call
    only when keys reach past it; over a non-causal call (a bidirectional window) the kernel has no rule."""
    spans = {name: span for name, span in (("window", window), ("chunk", chunk)) if span is not None and kv_len > span}
    if spans and not causal:
        return {}, REASON_SLIDING_WINDOW
    return spans, None


def resolve_pattern(module, query, key, attention_mask, is_causal,
                    variants: dict) -> tuple[MaskPattern | None, str | None]:
    """(pattern, None) when the kernel reproduces the call's masking exactly, else (None, reason).

    ``variants``: :func:`model_variants`' answer; its ``window`` / ``chunk`` join the pattern where the
    mask needs them. Without a mask the flags decide, and the model's window or chunk applies as it
    does under FlashAttention (transformers builds a mask whenever the keys reach past them)."""
    batch, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    window, chunk = variants.get("window"), variants.get("chunk")
    if attention_mask is None:
        # SDPA's rule without a mask: causal only for several queries, aligned top-left; keys past
        # the queries then only occur as the empty slots of a static cache at prefill: drop them.
        causal = causal_call(module, is_causal, nq)
        if causal and nq > nk:
            return None, REASON_CAUSAL_SHAPE
        kv_len = nq if causal else nk
        spans, reason = _biting(causal, kv_len, window, chunk)
        return (None, reason) if reason is not None else (MaskPattern(causal, kv_len, **spans), None)
    if not isinstance(attention_mask, torch.Tensor):
        return None, REASON_MASK_SHAPE
    found = masks.cached_analysis(attention_mask, batch, query.shape[1], nq, nk, window, chunk)
    if isinstance(found, str):
        spanned = window is not None or chunk is not None
        return None, (REASON_SLIDING_WINDOW if spanned and found == REASON_MASK_PATTERN else found)
    return found.for_batch(batch), None


def _unsupported(query, key, value, dropout, kwargs) -> str | None:
    """Why the kernel cannot serve this call whatever its mask, or None."""
    if kwargs.get("indices") is not None or kwargs.get("block_indices") is not None:
        return REASON_SPARSE
    if kwargs.get("output_attentions"):
        return REASON_OUTPUT_ATTENTIONS
    if kwargs.get("position_bias") is not None:
        return REASON_POSITION_BIAS
    if kwargs.get("cache") is not None:
        return REASON_PAGED_CACHE
    return support.call_gap(query, key, value, dropout=dropout)


def call_variants(module, query, key, value, dropout, kwargs) -> tuple[dict, str | None]:
    """(variants, None) when only the mask can still keep the kernel from this call — ``variants`` as
    :func:`model_variants` reads them — else ({}, the reason it cannot serve the call)."""
    reason = _unsupported(query, key, value, dropout, kwargs)
    if reason is not None:
        return {}, reason
    variants, reason = model_variants(module, query, kwargs)
    if reason is not None:
        return {}, reason
    if support.needs_grad(query, key, value, variants["sinks"]):  # learned sinks still training
        return {}, support.REASON_GRAD
    return variants, None


def kernel_call(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
    """(pattern, variants, None) when the kernel can serve this call exactly, else (None, {}, the reason it
    cannot): the pattern carries the window / chunk the mask needs, ``variants`` the sinks and soft-cap."""
    variants, reason = call_variants(module, query, key, value, dropout, kwargs)
    if reason is None:
        pattern, reason = resolve_pattern(module, query, key, attention_mask, is_causal, variants)
        if reason is None:
            return pattern, variants, None
    return None, {}, reason


def short_call(query, pattern: MaskPattern, variants: dict) -> bool:
    """Whether a call the kernel could serve is too short for it to beat SDPA on this GPU
    (:func:`hf_qattn.support.below_break_even`): plain causal or full attention only."""
    variant = (pattern.window is not None or pattern.chunk is not None or variants["sinks"] is not None
               or variants["softcap"] is not None)
    return support.below_break_even(query, pattern.kv_len, causal=pattern.causal, variant=variant)


# ------------------------------------------------------------------------------------------------
# full-precision paths


def _additive_mask(attention_mask, query, key, is_causal, module):
    """The mask as eager attention wants it: float, 0 where seen and the dtype's minimum elsewhere."""
    nq, nk = query.shape[2], key.shape[2]
    if attention_mask is None:
        if not causal_call(module, is_causal, nq):
            return None
        rows = torch.arange(nq, device=query.device)[:, None]
        attention_mask = (torch.arange(nk, device=query.device)[None, :] <= rows)[None, None]  # SDPA: top-left
    if attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return attention_mask


def _plain_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                 s_aux=None, sinks=None, **_):
    """Softmax attention with soft-capping and sinks, for modules whose model has no eager function."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    sink = s_aux if s_aux is not None else sinks
    if sink is not None:  # one extra logit per head (or per head and query row) that takes mass and no value
        sink = sink.to(scores.dtype)
        sink_col = (sink.view(1, -1, 1, 1) if sink.dim() == 1 else sink).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nn.functional.dropout(probs.to(query.dtype), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _model_eager(module):
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def full_precision_path(kwargs) -> str:
    """Which full-precision path a call takes: ``"eager"`` where SDPA cannot express it (sinks, soft-capping,
    sparse indices, returned weights), else ``"sdpa"``."""
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _EAGER_ONLY):
        return support.EAGER
    return support.SDPA


def full_precision_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             is_causal=None, **kwargs):
    """What the model computes without qattn: eager where SDPA cannot express it, else SDPA."""
    if full_precision_path(kwargs) == support.EAGER:
        eager = _model_eager(module) or _plain_eager
        mask = _additive_mask(attention_mask, query, key, is_causal, module)
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# ------------------------------------------------------------------------------------------------
# the attention function

_calibrator: contextvars.ContextVar = contextvars.ContextVar("hf_qattn_calibrator", default=None)


@contextlib.contextmanager
def calibrating(observer):
    """Within the block every qattn call returns full-precision attention and hands its Q, K, V to
    ``observer.observe(module, query, key, value, pattern, scaling, sinks=..., softcap=...)`` (the pattern
    carries the window / chunk; or ``observer.skip(module, reason)`` when the kernel could not serve the call)."""
    global _active_calibrations
    token = _calibrator.set(observer)
    _active_calibrations += 1
    try:
        yield observer
    finally:
        _active_calibrations -= 1
        _calibrator.reset(token)


def qattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: q, k, v (B, H, N, D) in, ((B, N, H, D) output, None) out."""
    if torch.compiler.is_compiling():
        return _compiled_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
    if kv_attention.is_packed(key):  # a QAttnCache layer: attend to its quantized storage directly
        call = replay_key(module, query, attention_mask, dropout, scaling, is_causal, kwargs)
        out = kv_attention.replay_recorded(query, key, scaling, call) if call is not None else None
        if out is not None:  # the layer's step graph, recorded by a call with this key: decided then
            return out, None
        variants, reason = call_variants(module, query, key, value, dropout, kwargs)
        if reason is None:
            pattern, reason = kv_attention.step_pattern(query, key, lambda: resolve_pattern(
                module, query, key, attention_mask, is_causal, variants))
        # chunks that need realigning (several queries over a full layer's storage) are read dequantized below
        if reason is None and pattern.chunk_shift is None:
            return kv_attention.packed_attention(query, key, pattern, scaling, window=pattern.window,
                                                 chunk=pattern.chunk, call=call, **_score_options(variants)), None
        key, value = kv_attention.dequantize(key), kv_attention.dequantize(value)  # the paths below serve the rest
    observer = _calibrator.get()
    if observer is not None:
        out = full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       is_causal=is_causal, **kwargs)
        pattern, variants, reason = kernel_call(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
        if reason is None and pattern.chunk_shift is not None and query.shape[2] != pattern.kv_len:
            reason = REASON_CALIBRATION_VARIANT
        if reason is None:
            observer.observe(module, query, key, value, pattern, scaling, **_score_options(variants))
        else:
            observer.skip(module, reason)
        return out

    precision, split = layer_settings(module)
    if precision == UNQUANTIZED:
        ops.record(support.UNQUANTIZED_BY_PLAN)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    pattern, variants, reason = kernel_call(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
    if reason is not None:
        ops.record(full_precision_path(kwargs), reason)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    if short_call(query, pattern, variants):
        ops.record(support.BELOW_BREAK_EVEN)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    if split is None:
        _watch_outlier_channel(module, key)
    out = _quantized(query, key, value, pattern, precision, scaling, split, _score_options(variants))
    return out.transpose(1, 2).contiguous(), None


def replay_key(module, query, attention_mask, dropout, scaling, is_causal, kwargs) -> tuple | None:
    """What a call over a QAttnCache layer hands the decisions above (:func:`call_variants`, :func:`resolve_pattern`)
    when it has no mask and none of their keywords set — the module (its config: the chunk, the layer), the query's
    shape, dtype, device and gradient, dropout, scaling, ``is_causal`` — or None for any other call. A step graph
    recorded by a call keeps its key: a later call with an equal key is decided alike, and replays at once
    (:func:`hf_qattn.kv_cache.attention.replay_recorded`), which saves a decode step's host time. The key leaves out
    the key count, which the decisions read only against a window or chunk: graphs are recorded on full-attention
    layers only (QAttnCache builds sliding and chunked layers from the same config as rings, which append eagerly)."""
    if attention_mask is not None:
        return None
    for name in _DECIDING_KEYWORDS:
        value = kwargs.get(name)
        if value is not None and value is not False:
            return None
    grad = torch.is_grad_enabled() and query.requires_grad
    return module, query.shape, query.dtype, query.device, grad, dropout, scaling, is_causal


def _watch_outlier_channel(module, key: torch.Tensor) -> None:
    """Warn once per layer when its K holds a channel that needs the split (``quant.split_channel``: a zero-mean
    outlier, which smoothing cannot remove and which crushes K's other channels to a few INT8 levels) and nothing
    turns the split on: a model no calibration marked (``calibrate`` records such layers in the plan), without
    ``HF_QATTN_SPLIT_CHANNEL=1``. Looked at on the layer's first call and whenever its key count has doubled
    since (RoPE can raise an outlier only over a long context): a read of K and one host sync each, so a few per
    layer in a model's life; never while compiling or capturing a CUDA graph, where a sync cannot run."""
    seen = getattr(module, "_qattn_outlier_seen", 0)
    if getattr(module, "_qattn_outlier_warned", False) or key.shape[-2] < 2 * seen:
        return  # the common case: two attribute reads a call
    if settings.split_channel() or torch.compiler.is_compiling() or (
            key.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    module._qattn_outlier_seen = key.shape[-2]
    found = quant.split_channel(key, quant.smoothing_center(key, tuning.center_sample())) >= 0  # (B, Hk)
    if bool(found.any()):
        module._qattn_outlier_warned = True
        index = layer_index(module)
        where = f"layer {index}" if index is not None else type(module).__name__
        warnings.warn(f"hf_qattn: {where}: a key channel of {int(found.any(0).sum())} of {found.shape[1]} kv heads is "
                      f"a zero-mean outlier (range ≥ {quant.SPLIT_RATIO:g}× the head's mean channel), which INT8 Q·Kᵀ "
                      "cannot hold: this layer's attention may be far off. Calibrate the model (hf_qattn.calibrate or "
                      "`hf-qattn calibrate`: the plan then splits the channel out in such layers only) or set "
                      "HF_QATTN_SPLIT_CHANNEL=1.", stacklevel=2)


def _quantized(query, key, value, pattern: MaskPattern, precision: str, scaling, split_channel: bool | None,
               scores: dict):
    """qattn on (B, H, N, D) tensors under a mask pattern (keys [0, kv_len), causal, per-sequence range,
    window, chunk), with the score variants ``scores`` (sinks, softcap)."""
    key, value = pattern.keys(key, value)
    undo = None
    if pattern.chunk_shift is not None:  # chunks starting elsewhere than key 0 (left padding, a cache offset)
        query, key, value, pattern, undo = pattern.realigned(query, key, value)
    out = api.qattn(query, key, value, layout="HND", qk=precision, sm_scale=scaling, split_channel=split_channel,
                    **pattern.qattn_options(), **scores)
    return out if undo is None else undo(out)


# ------------------------------------------------------------------------------------------------
# inside torch.compile

REASON_COMPILE_OFFSET = "under torch.compile: mask with more keys than queries and several queries (static-cache prefill)"
REASON_COMPILE_HEADS = "under torch.compile: attention mask that differs per head"
REASON_COMPILE_FLOAT_MASK = "under torch.compile: float (additive) attention mask"

_active_calibrations = 0  # a plain global, so a compiled graph is guarded on it (the contextvar is not)


def _compiled_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, **kwargs):
    """The attention function as ``torch.compile`` traces it: no graph break, no host synchronisation.

    Decisions that depend only on shapes, keywords and the plan are taken while tracing (the plan is
    read once per compilation; counts and warnings happen once per traced call site). The mask is
    turned into causal + key range with tensor ops: the range stays a tensor, and the exactness check
    eager mode does with a fallback becomes a tensor too — a sequence whose mask is not causal ∧ key
    range (∧ the model's window / chunk) comes out NaN rather than wrong (a fallback would need the host
    to read the check): e.g. Llama 4's chunks shifted by left padding.
    QAttnCache layers and calibration leave the graph (one break per layer), as before.
    """
    if kv_attention.is_packed(key) or _active_calibrations:
        return _eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, is_causal=is_causal, **kwargs)
    precision, split = _traced_layer(module)
    if precision == UNQUANTIZED:
        ops.record(support.UNQUANTIZED_BY_PLAN)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    variants, reason = call_variants(module, query, key, value, dropout, kwargs)
    pattern, exact = None, None
    if reason is None:
        pattern, exact, reason = _traced_pattern(module, query, key, attention_mask, is_causal, variants)
    if reason is not None:
        ops.record(full_precision_path(kwargs), reason)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    if short_call(query, pattern, variants):  # shapes only: decided while tracing
        ops.record(support.BELOW_BREAK_EVEN)
        return full_precision_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    out = _quantized(query, key, value, pattern, precision, scaling, split, _score_options(variants))
    if exact is not None:
        out = torch.where(exact.view(-1, 1, 1, 1), out, float("nan"))
    return out.transpose(1, 2).contiguous(), None


def _traced_pattern(module, query, key, attention_mask, is_causal, variants: dict):
    """(pattern, exact, None) with ``exact`` a (batch,) bool tensor or None, else (None, None, reason).

    :func:`resolve_pattern` under ``torch.compile``. What they share is one function each: no mask goes
    to :func:`resolve_pattern` itself, causality by the flags is :func:`causal_call`. What differs must:
    eager mode reads a mask by value (:func:`hf_qattn.masks.cached_analysis` finds causal, the key range
    and whether they reproduce the mask, on the host), which inside a graph would be a break and a
    device sync. Here causality comes from the flags, the key range stays a tensor, and exactness is a
    tensor the caller turns into NaN rows; shapes the kernel cannot take without a value read fall back.
    The model's window / chunk join the pattern by shape, where keys reach past them (:func:`_biting`):
    several queries only — one query's window or chunk is a key range, which the range already reads.
    """
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype != torch.bool:
        # eager mode analyses additive masks (hf_qattn.masks), which reads values: not inside a graph
        return None, None, REASON_COMPILE_FLOAT_MASK
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        pattern, reason = resolve_pattern(module, query, key, attention_mask, is_causal, variants)
        return pattern, None, reason
    batch, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    mb, mh, mq, mk = attention_mask.shape
    if mq != nq or mk != nk or mb not in (1, batch):
        return None, None, REASON_MASK_SHAPE
    if mh != 1:
        return None, None, REASON_COMPILE_HEADS
    if nq > 1 and nq != nk:
        return None, None, REASON_COMPILE_OFFSET
    causal = causal_call(module, is_causal, nq)
    spans = {}
    if nq > 1:
        spans, reason = _biting(causal, nk, variants.get("window"), variants.get("chunk"))
        if reason is not None:
            return None, None, reason
    grid = attention_mask[:, 0]
    seen = grid.any(dim=1)  # (B, Nk): keys some query sees
    cols = torch.arange(nk, device=attention_mask.device)
    kv_end = torch.where(seen, cols + 1, 0).amax(dim=-1)
    kv_start = torch.where(kv_end > 0, torch.where(seen, cols, nk).amin(dim=-1), 0)
    rebuilt = reference.visible_keys(mb, nq, nk, is_causal=causal, kv_start=kv_start, kv_end=kv_end,
                                     device=attention_mask.device, **spans)
    exact = (rebuilt == attention_mask).flatten(1).all(dim=-1)
    pattern = MaskPattern(causal, nk, kv_start.to(torch.int32), kv_end.to(torch.int32), **spans).for_batch(batch)
    return pattern, exact.expand(batch), None


def _traced_layer(module) -> tuple[str, bool | None]:
    """:func:`layer_settings` under ``torch.compile``: the plan is read
    by the same resolver, while tracing, and its answer is a constant of the compiled graph (change
    ``config.qattn_plan`` after compiling and call ``torch._dynamo.reset()``). Only plain values cross
    into the constant function: torch 2.11's dynamo cannot hold an nn.Module as a constant."""
    config = _module_config(module)
    data = getattr(config, PLAN_CONFIG_KEY, None) if config is not None else None
    if data is None:
        return DEFAULT_PRECISION, None
    data = data.to_dict() if isinstance(data, QAttnPlan) else data
    precision, split = _layer_once(data, _num_layers(config), layer_index(module))
    return precision, (True if split else None)


@torch._dynamo.assume_constant_result
def _layer_once(plan_data, num_layers, index) -> tuple[str, bool]:
    plan = QAttnPlan.resolve(plan_data, num_layers=num_layers, stored=True)
    return plan.precision(index), plan.splits(index)


_eager_attention_forward = torch.compiler.disable(qattn_attention_forward)
