"""SageAttn-mix calibration: score the 4-bit kernel at every layer, mark the worst layers 8-bit.

The model runs with full-precision attention on a few real inputs (its outputs are the
full-precision ones). At every attention call the INT4 kernel is scored on the very Q, K, V the
layer sees — :func:`hf_qattn.scoring.attention_accuracy`, score = CosSim · (1 − RelL1) — one
sequence at a time, padding cut away, so every input counts once and padding adds no noise. Only
running sums are kept, never tensors. The lowest-scoring ``ratio`` share of layers (by mean score)
becomes ``"int8"``, the rest ``"int4"`` (:meth:`hf_qattn.QAttnPlan.from_scores`); the plan goes
into ``model.config.qattn_plan`` so that ``save_pretrained`` writes it.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ...plan import PLAN_CONFIG_KEY, QAttnPlan, check_ratio
from ...scoring import CALIBRATION_QK, CalibrationOutcome, Score, ScoreSums, attention_accuracy, describe
from .attention import layer_index


@dataclass
class CalibrationResult(CalibrationOutcome):
    """``plan, scores = calibrate(...)`` unpacks; ``skipped`` counts calls the kernel could not serve."""

    plan: QAttnPlan
    scores: dict[int, Score]
    skipped: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return self._json(plan=self.plan.to_dict(),
                          layers={str(layer): score.as_dict() for layer, score in sorted(self.scores.items())})


class _ScoreCollector:
    """Receives each attention call during calibration and keeps per-layer running sums only."""

    def __init__(self):
        self.sums: dict[int, ScoreSums] = {}
        self.skipped: Counter = Counter()

    def skip(self, module, reason: str) -> None:
        self.skipped[reason] += 1

    def observe(self, module, query, key, value, pattern, scaling) -> None:
        layer = layer_index(module)
        if layer is None:
            self.skipped["attention module without a layer index"] += 1
            return
        nq = query.shape[2]
        key, value = key[:, :, : pattern.kv_len], value[:, :, : pattern.kv_len]
        for b in range(query.shape[0]):
            start = int(pattern.kv_start[b]) if pattern.kv_start is not None else 0
            end = int(pattern.kv_end[b]) if pattern.kv_end is not None else pattern.kv_len
            if end <= start:
                continue
            q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
            ranges = {}
            if nq == pattern.kv_len:
                # self-attention: query t is token t, so the padding rows go with the padding keys
                q, k, v = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            else:
                device = query.device
                ranges = {"kv_start": torch.tensor([start], device=device), "kv_end": torch.tensor([end], device=device)}
            result = attention_accuracy(q, k, v, qk=CALIBRATION_QK, is_causal=pattern.causal, sm_scale=scaling,
                                        **ranges)
            if not math.isfinite(result.score):
                self.skipped["non-finite score"] += 1
                continue
            self.sums.setdefault(layer, ScoreSums()).add(result.score, result.cos_sim, result.rel_l1)

    def scores(self) -> dict[int, Score]:
        return {layer: sums.score() for layer, sums in sorted(self.sums.items())}


def _batches(inputs, tokenizer, batch_size: int, max_length: int | None) -> list:
    """The model-call keyword dicts for ``inputs`` (see :func:`calibrate`)."""
    if isinstance(inputs, str):
        raise ValueError("inputs must be a list of strings (with tokenizer=...), a tokenized batch (a dict of tensors) "
                         "or a list of them; got a single string — wrap it in a list")
    if isinstance(inputs, Mapping):
        return [dict(inputs)]
    if isinstance(inputs, torch.Tensor):
        if inputs.dtype not in (torch.int32, torch.int64) or inputs.dim() != 2:
            raise ValueError("a tensor given as inputs must hold input_ids: integer, shape (batch, tokens); "
                             "pass other inputs as dicts, e.g. {'pixel_values': x}")
        return [{"input_ids": chunk} for chunk in inputs.split(batch_size)]
    if not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise ValueError("inputs must be a non-empty list of strings (with tokenizer=...) or of tokenized batches "
                         f"(dicts of tensors); got {type(inputs).__name__}")
    if all(isinstance(item, str) for item in inputs):
        if tokenizer is None:
            raise ValueError("inputs are strings: pass tokenizer=... (e.g. AutoTokenizer.from_pretrained(path))")
        size = batch_size if getattr(tokenizer, "pad_token", None) is not None else 1  # no pad token: no batching
        options = {"return_tensors": "pt", "truncation": max_length is not None, "max_length": max_length}
        return [dict(tokenizer(list(inputs[i : i + size]), padding=size > 1, **options))
                for i in range(0, len(inputs), size)]
    if all(isinstance(item, Mapping) for item in inputs):
        return [dict(item) for item in inputs]
    raise ValueError("inputs must be all strings or all tokenized batches (dicts of tensors); got a mix or another type")


def _progress(items, enabled: bool, desc: str):
    if not enabled or len(items) < 2:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _simple_progress(items, desc)
    return tqdm(items, desc=desc)


def _simple_progress(items, desc: str):
    total = len(items)
    for done, item in enumerate(items, 1):
        yield item
        print(f"\r{desc}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def calibrate(
    model,
    inputs,
    ratio: float = 0.3,
    *,
    tokenizer=None,
    batch_size: int = 8,
    max_length: int | None = 512,
    progress: bool = True,
) -> CalibrationResult:
    """Score the INT4 kernel at every attention layer on ``inputs`` and write a mixing plan into the config.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention uses the attention interface.
        inputs: a list of strings (needs ``tokenizer``), a tokenized batch (a dict of tensors passed
            as ``model(**batch)``, e.g. ``{"pixel_values": x}``), a list of such dicts, or a tensor
            of input_ids (batch, tokens).
        ratio: share of layers (the lowest mean scores) that get ``"int8"``; the rest ``"int4"``.
        tokenizer: turns string inputs into batches (padding, truncation to ``max_length``).
        batch_size: strings (or input_ids rows) per forward pass; padding never enters a score.
        max_length: truncation length for string inputs (None: no truncation).
        progress: show a progress bar (tqdm when installed) over the batches.

    Returns a :class:`CalibrationResult` (``plan, scores = calibrate(...)``): ``scores[layer]`` has
    the mean and worst score over inputs. ``model.config.qattn_plan`` holds ``plan.to_dict()``.
    The model comes back in its previous attention implementation and train/eval mode.
    """
    check_ratio(ratio, "layers")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError("model must be a transformers PreTrainedModel (with .config and .set_attn_implementation)")
    from . import attention, registration

    registration.register()
    batches = _batches(inputs, tokenizer, batch_size, max_length)
    device = _model_device(model)
    accepts_use_cache = "use_cache" in inspect.signature(model.forward).parameters

    previous_impl = config._attn_implementation
    was_training = model.training
    collector = _ScoreCollector()
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    try:
        model.eval()
        with torch.no_grad(), attention.calibrating(collector):
            for batch in _progress(batches, progress, "hf_qattn calibrate"):
                call = {name: (value.to(device) if isinstance(value, torch.Tensor) else value)
                        for name, value in batch.items()}
                if accepts_use_cache:
                    call.setdefault("use_cache", False)
                model(**call)
    finally:
        model.set_attn_implementation(previous_impl)
        model.train(was_training)

    scores = collector.scores()
    if not scores:
        reasons = ", ".join(f"{reason} ({n})" for reason, n in collector.skipped.items()) or "no attention call seen"
        raise RuntimeError("calibration scored no layer: the model's attention never reached hf_qattn "
                           f"({reasons}); does this model use transformers' attention interface?")
    meta = describe(batches=len(batches),
                    scores={str(layer): [round(s.mean, 6), round(s.worst, 6)] for layer, s in scores.items()})
    plan = QAttnPlan.from_scores({layer: s.mean for layer, s in scores.items()}, ratio,
                                 num_layers=attention._num_layers(config), meta=meta)
    setattr(config, PLAN_CONFIG_KEY, plan.to_dict())
    return CalibrationResult(plan=plan, scores=scores, skipped=dict(collector.skipped))
