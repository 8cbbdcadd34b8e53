"""Calibration: rank the layers by how much their 4-bit attention hurts, mark the worst ``ratio`` 8-bit.

The objectives (:data:`OBJECTIVES`, ``calibrate(..., objective=...)``), one plan format:

- ``"attention"`` (default; SageAttn-mix, the paper's score), described below: one forward per input.
- ``"auto"`` (the CLI's default) runs ``"ppl-gain"`` for a causal LM and ``"attention"`` for any other model
  (:func:`choose_objective`).
- ``"logit-kl"`` (end to end): per layer, the KL divergence of the model's final next-token
  distribution with only that layer's attention at int4 (all others full precision) from the one
  with every layer full precision, averaged over the calibration tokens; the largest ``ratio`` share
  of layers becomes ``"int8"``. Cost: (L + 1) forwards per input batch (one full precision, one per
  layer), for a model whose output has ``logits``.
- ``"logit-kl-gain"`` (end to end, in the setting a plan runs in): per layer, how much that KL (now of
  the all-int4 model) drops when that layer alone is promoted to int8; the largest gains become
  ``"int8"``. Cost: (L + 2) forwards per input batch, most layers int4 in each (slow on a CPU).
- ``"ppl-gain"`` (end to end, what a plan is judged by): per layer, how much the mean next-token negative
  log-likelihood of the calibration tokens (labels: the input ids shifted by one, padding excluded) drops
  when that layer alone is int8 in an otherwise all-int4 model; the largest drops become ``"int8"``.
  Cost: (L + 2) forwards per input batch (one full precision, which finds the layers the kernel serves
  and gives the NLL int4 adds; the rest mostly int4), causal LMs with ``input_ids`` only.

The three end-to-end objectives share one runner (:func:`_probe_runner`), parametrised by what it
measures per token (:class:`_KL`, :class:`_NLL`) and by the precisions it probes.

Attention objective: the model runs with full-precision attention on a few real inputs (its outputs are the
full-precision ones). At every attention call the INT4 kernel is scored on the very Q, K, V the
layer sees — :func:`hf_qattn.calibration.scoring.attention_accuracy`, score = CosSim · (1 − RelL1) — one
sequence at a time, padding cut away, so every input counts once and padding adds no noise. Only
running sums are kept, never tensors. The lowest-scoring ``ratio`` share of layers (by mean score)
becomes ``"int8"``, the rest ``"int4"`` (:meth:`hf_qattn.QAttnPlan.from_scores`); the plan goes
into ``model.config.qattn_plan`` so that ``save_pretrained`` writes it.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ... import quant
from ...plan import PLAN_CONFIG_KEY, UNQUANTIZED, QAttnPlan, check_ratio
from ...progress import Progress, track
from ...support import check_count
from ...calibration.scoring import CALIBRATION_QK, CalibrationOutcome, Score, ScoreSums, attention_accuracy, describe
from .attention import layer_index


KL_METRIC = "mean KL(p_full || p_int4 layer) per token, nats"
KL_GAIN_METRIC = "mean KL(p_full || p_all int4) - KL(p_full || p_all int4 but this layer int8) per token, nats"
PPL_GAIN_METRIC = "mean next-token NLL(all int4) - NLL(all int4 but this layer int8) per token, nats"


@dataclass
class Sensitivity:
    """A layer's end-to-end sensitivity (objective ``"logit-kl"``): the KL divergence (nats) of the final
    next-token distribution with that layer alone at int4 from full precision, ``mean`` over all calibration
    tokens and ``worst`` (largest) over input sequences, ``count`` input sequences and ``tokens`` tokens."""

    mean: float
    worst: float
    count: int
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PerplexityGain(Sensitivity):
    """A layer's score under objective ``"ppl-gain"``: ``mean`` is how much the mean next-token NLL (nats per
    token) of the calibration tokens drops when that layer alone is int8 and all others int4 (higher: promote
    it first); ``worst`` the largest such drop of one input sequence. ``nll_int4`` and ``nll_full`` are the
    mean NLL of the all-int4 and the full-precision model on the same tokens (the same for every layer), and
    ``recovery`` = mean / (nll_int4 − nll_full), the share of int4's NLL increase this layer alone buys back
    (None when int4 adds nothing)."""

    nll_int4: float
    nll_full: float
    recovery: float | None


@dataclass
class CalibrationResult(CalibrationOutcome):
    """``plan, scores = calibrate(...)`` unpacks; ``skipped`` counts calls the kernel could not serve.

    ``scores`` holds a :class:`~hf_qattn.calibration.scoring.Score` per layer (objective ``"attention"``: higher is
    better) or a :class:`Sensitivity` (``"logit-kl"``, ``"logit-kl-gain"``: higher → int8 first; objective
    ``"ppl-gain"``: its subclass :class:`PerplexityGain`)."""

    plan: QAttnPlan
    scores: dict[int, Score | Sensitivity]
    skipped: dict[str, int] = field(default_factory=dict)
    objective: str = "attention"
    forwards: int = 0
    seconds: float = 0.0
    chosen_by: str | None = None  # objective="auto": why it ran ``objective``

    def to_dict(self) -> dict:
        body = self._json(plan=self.plan.to_dict(), objective=self.objective, forwards=self.forwards,
                          seconds=round(self.seconds, 3),
                          layers={str(layer): score.as_dict() for layer, score in sorted(self.scores.items())})
        if self.objective in METRICS:
            body["metric"] = METRICS[self.objective]
        if self.chosen_by is not None:
            body["chosen_by"] = f"auto: {self.chosen_by}"
        return body


class _Observer:
    """What every calibration observer does with calls the kernel cannot serve, or that have no layer, and
    with every layer's keys: each objective's full-precision pass sees them, and notes the layers where some
    kv head's K has a channel that smoothing cannot tame (:func:`hf_qattn.quant.split_channel`, over each
    sequence's own keys). The plan sends only those layers down the split path (qattn's split_channel)."""

    def __init__(self):
        self.skipped: Counter = Counter()
        self.split_layers: set[int] = set()

    def note_keys(self, layer: int, key: torch.Tensor, pattern) -> None:
        if layer in self.split_layers:
            return
        key = key[:, :, : pattern.kv_len].float()
        for b in range(key.shape[0]):
            start = int(pattern.kv_start[b]) if pattern.kv_start is not None else 0
            end = int(pattern.kv_end[b]) if pattern.kv_end is not None else pattern.kv_len
            k = key[b : b + 1, :, start:end]
            if k.shape[2] and bool((quant.split_channel(k, k.mean(2)) >= 0).any()):
                self.split_layers.add(layer)
                return

    def skip(self, module, reason: str) -> None:
        self.skipped[reason] += 1

    def _layer(self, module) -> int | None:
        layer = layer_index(module)
        if layer is None:
            self.skipped["attention module without a layer index"] += 1
        return layer


class _ScoreCollector(_Observer):
    """Receives each attention call during calibration and keeps per-layer running sums only."""

    def __init__(self):
        super().__init__()
        self.sums: dict[int, ScoreSums] = {}

    def observe(self, module, query, key, value, pattern, scaling, sinks=None, softcap=None) -> None:
        layer = self._layer(module)
        if layer is None:
            return
        self.note_keys(layer, key, pattern)
        variants = dict(window=pattern.window, chunk=pattern.chunk, sinks=sinks, softcap=softcap)
        shift = pattern.chunk_shift
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
                # self-attention: query t is token t, so the padding rows go with the padding keys (and chunks
                # counted from a sequence's first token, as transformers counts them, start at the cut's key 0:
                # key j's chunk starts where j + shift is a multiple of the chunk, masks.MaskPattern)
                if shift is not None and (start + int(shift[b])) % pattern.chunk:
                    self.skipped["chunks not aligned with the sequence's first token"] += 1
                    continue
                q, k, v = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            else:
                device = query.device
                ranges = {"kv_start": torch.tensor([start], device=device), "kv_end": torch.tensor([end], device=device)}
            result = attention_accuracy(q, k, v, qk=CALIBRATION_QK, is_causal=pattern.causal, sm_scale=scaling,
                                        **ranges, **variants)
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


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


class _LayerRecorder(_Observer):
    """Observer of the full-precision pass of ``"logit-kl"``: which layers the kernel can serve."""

    def __init__(self):
        super().__init__()
        self.layers: set[int] = set()

    def observe(self, module, query, key, value, pattern, scaling, sinks=None, softcap=None) -> None:
        layer = self._layer(module)
        if layer is not None:
            self.layers.add(layer)
            self.note_keys(layer, key, pattern)


def _logits(output, objective: str) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"objective {objective!r} needs a model whose output has logits (batch, tokens, vocab), "
                         "e.g. a *ForCausalLM; use objective='attention' for other models")
    return logits


def _token_mask(call: dict, logits: torch.Tensor) -> torch.Tensor:
    mask = call.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == tuple(logits.shape[:2]):
        return mask.to(device=logits.device, dtype=torch.bool)
    return torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)


def _run_attention(model, calls, progress: bool):
    """Objective ``"attention"``: one full-precision forward per batch, the INT4 kernel scored on each layer's Q, K, V."""
    from . import attention

    collector = _ScoreCollector()
    with attention.calibrating(collector):
        for call in track(calls, "hf_qattn calibrate", progress):
            model(**call)
    scores = collector.scores()
    if not scores:
        _nothing_scored(collector.skipped)
    ranking = {layer: s.mean for layer, s in scores.items()}  # lowest first → int8
    meta = {"scores": {str(layer): [round(s.mean, 6), round(s.worst, 6)] for layer, s in scores.items()},
            "split_channel": sorted(collector.split_layers)}
    return scores, ranking, meta, collector.skipped, len(calls)


class _KL:
    """Per token: KL(p_full || p_probe) of the next-token distribution. The full-precision pass is the reference."""

    def reference(self, call: dict, logits: torch.Tensor, objective: str):
        """(tokens that count (batch, positions) bool, the reference's own per-token value or None)."""
        self.logp = torch.log_softmax(logits.float(), dim=-1)
        self.probs = self.logp.exp()
        return _token_mask(call, logits), None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return (self.probs * (self.logp - torch.log_softmax(logits.float(), dim=-1))).sum(dim=-1)


class _NLL:
    """Per position t: the negative log-likelihood of input token t + 1 (labels: the input ids shifted by one).
    A position counts when both tokens are real (attention mask 1); the full-precision pass only adds its own NLL."""

    def reference(self, call: dict, logits: torch.Tensor, objective: str):
        ids = call.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or tuple(ids.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"objective {objective!r} needs input_ids (batch, tokens) matching the logits: its labels "
                             "are the next input ids; use objective='attention' or 'logit-kl' for other inputs")
        if ids.shape[1] < 2:
            raise ValueError(f"objective {objective!r} needs inputs of at least 2 tokens (a next token to predict)")
        mask = _token_mask(call, logits)
        self.labels = ids[:, 1:].to(logits.device)
        return mask[:, :-1] & mask[:, 1:], self(logits)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), self.labels.reshape(-1),
                                                reduction="none")
        return nll.view(self.labels.shape)


def _probe_runner(objective: str, measure: type, base: str, probe: str, metric: str):
    """An end-to-end runner: per batch one full-precision forward (the reference; it also notes which layers the
    kernel serves), then — with every layer at ``base`` — one forward per layer with that layer alone at
    ``probe``. ``measure`` gives a value per token of each forward (:class:`_KL`: divergence from the
    reference; :class:`_NLL`: next-token NLL). With ``base`` unquantized a layer's score is its probe's value
    (a divergence); otherwise one more forward (all at ``base``) is run and a layer's score is how much the
    value drops when it alone runs ``probe`` (the gain of promoting it). Highest score → int8."""
    gain = base != UNQUANTIZED
    if not gain and measure is not _KL:
        raise ValueError("a runner without a base forward needs a divergence from the reference (_KL)")

    def run(model, calls, progress: bool):
        from . import attention

        config = model.config
        had_plan = hasattr(config, PLAN_CONFIG_KEY)
        previous_plan = getattr(config, PLAN_CONFIG_KEY, None)
        totals: dict[int, float] = {}
        worst: dict[int, float] = {}
        base_total, reference_total = 0.0, 0.0
        sequences, tokens, forwards = 0, 0, 0
        recorder = _LayerRecorder()
        layers: list[int] | None = None
        extra = 2 if gain else 1
        bar = Progress(f"hf_qattn calibrate ({objective}: L+{extra} forwards per batch)", progress)

        try:
            for call in calls:
                with attention.calibrating(recorder):  # full precision everywhere; notes the layers the kernel serves
                    logits = _logits(model(**call), objective)
                forwards += 1
                if layers is None:
                    layers = sorted(recorder.layers)
                    if not layers:
                        _nothing_scored(recorder.skipped)
                    bar.start(len(calls) * (len(layers) + extra))
                bar.step()
                values = measure()
                mask, own = values.reference(call, logits, objective)
                del logits
                counts = mask.sum(dim=1)

                def value(plan):
                    setattr(config, PLAN_CONFIG_KEY, plan)
                    return values(_logits(model(**call), objective)).masked_fill(~mask, 0.0)  # (batch, positions)

                if own is not None:
                    reference_total += float(own.masked_fill(~mask, 0.0).sum())
                baseline = None
                if gain:
                    baseline = value(QAttnPlan(default=base))
                    base_total += float(baseline.sum())
                    forwards += 1
                    bar.step()
                for layer in layers:
                    score = value(QAttnPlan(default=base, layers={layer: probe}))
                    forwards += 1
                    if baseline is not None:
                        score = baseline - score
                    totals[layer] = totals.get(layer, 0.0) + float(score.sum())
                    if bool((counts > 0).any()):
                        per_sequence = score.sum(dim=1) / counts.clamp(min=1)
                        worst[layer] = max(worst.get(layer, -math.inf), float(per_sequence[counts > 0].max()))
                    bar.step()
                sequences += int((counts > 0).sum())
                tokens += int(counts.sum())
        finally:
            bar.close()
            if had_plan:
                setattr(config, PLAN_CONFIG_KEY, previous_plan)
            elif hasattr(config, PLAN_CONFIG_KEY):
                delattr(config, PLAN_CONFIG_KEY)
        if tokens == 0:
            raise ValueError(f"objective {objective!r} saw no tokens (every attention_mask entry is 0"
                             + (", or no input has two real tokens in a row)" if measure is _NLL else ")"))
        if measure is _NLL:
            nll_int4, nll_full = base_total / tokens, reference_total / tokens
            increase = nll_int4 - nll_full
            scores = {layer: PerplexityGain(mean=totals[layer] / tokens, worst=worst[layer], count=sequences,
                                            tokens=tokens, nll_int4=nll_int4, nll_full=nll_full,
                                            recovery=totals[layer] / tokens / increase if increase else None)
                      for layer in layers}
        else:
            scores = {layer: Sensitivity(mean=totals[layer] / tokens, worst=worst[layer], count=sequences,
                                         tokens=tokens) for layer in layers}
        ranking = {layer: -s.mean for layer, s in scores.items()}  # largest first → int8
        meta = {"metric": metric, "tokens": tokens,
                "scores": {str(layer): [round(s.mean, 8), round(s.worst, 8)] for layer, s in scores.items()},
                "split_channel": sorted(recorder.split_layers)}
        if measure is _NLL:
            meta.update(nll_int4=round(nll_int4, 6), nll_full=round(nll_full, 6))
        return scores, ranking, meta, recorder.skipped, forwards

    return run


_run_logit_kl = _probe_runner("logit-kl", _KL, UNQUANTIZED, "int4", KL_METRIC)
_run_logit_kl_gain = _probe_runner("logit-kl-gain", _KL, "int4", "int8", KL_GAIN_METRIC)
_run_ppl_gain = _probe_runner("ppl-gain", _NLL, "int4", "int8", PPL_GAIN_METRIC)
METRICS = {"logit-kl": KL_METRIC, "logit-kl-gain": KL_GAIN_METRIC, "ppl-gain": PPL_GAIN_METRIC}


def _nothing_scored(skipped) -> None:
    reasons = ", ".join(f"{reason} ({n})" for reason, n in skipped.items()) or "no attention call seen"
    raise RuntimeError("calibration scored no layer: the model's attention never reached hf_qattn "
                       f"({reasons}); does this model use transformers' attention interface?")


# The calibration objectives: name → (how it runs, what it costs). The one place to add an objective:
# a runner takes (model, calls, progress) and returns (scores, ranking, meta, skipped, forwards), where the
# lowest ``ranking`` values are marked int8 and meta["split_channel"] lists the layers its observer's
# full-precision pass found a K outlier channel in (_Observer.note_keys).
OBJECTIVES = {
    "attention": (_run_attention, "1 forward per input batch: CosSim·(1 − RelL1) of each layer's INT4 attention "
                                  "output on its own Q, K, V (lowest → int8)"),
    "logit-kl": (_run_logit_kl, "L+1 forwards per input batch: KL of the final next-token distribution with that "
                                "layer alone at int4 vs full precision (largest → int8)"),
    "logit-kl-gain": (_run_logit_kl_gain, "L+2 forwards per input batch (most layers int4: slow on CPU): how much "
                                          "the KL of the final next-token distribution from full precision drops "
                                          "when that layer alone is int8 and all others int4 (largest → int8)"),
    "ppl-gain": (_run_ppl_gain, "L+2 forwards per input batch (most layers int4: slow on CPU; causal LMs): how "
                                "much the next-token NLL of the calibration text drops when that layer alone is "
                                "int8 and all others int4 (largest → int8)"),
}
DEFAULT_OBJECTIVE = "attention"
# objective="auto" (the CLI's default) picks one of OBJECTIVES per model: ppl-gain for a causal LM, whose
# plan is judged by perplexity (on SmolLM2 its plan recovered 51 % of int4's perplexity increase on held-out
# text, attention's 30 %: eval/results/calibration-ppl-gain-cpu-2026-11-23.md), attention for the rest
AUTO = "auto"


def check_objective(objective) -> str:
    if objective != AUTO and objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}; got {objective!r} (or {AUTO!r}: "
                         "ppl-gain for a causal LM, attention for other models)")
    return objective


def _is_causal_lm(model) -> bool:
    name = type(model).__name__
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers moved it
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}
    names = {n for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for n in ([value] if isinstance(value, str) else value)}
    return name in names or name.endswith("ForCausalLM")


def choose_objective(model, batches=None) -> tuple[str, str]:
    """(objective, why) that ``objective="auto"`` runs: ``"ppl-gain"`` for a causal LM (a class of
    transformers' causal-LM mapping, or ``*ForCausalLM``) whose inputs are ``input_ids`` of at least
    2 tokens (a next token to predict), else ``"attention"``. ``batches``: the tokenized inputs (dicts),
    or None to judge by the model alone."""
    name = type(model).__name__
    if not _is_causal_lm(model):
        return "attention", f"{name} is not a causal LM (no next-token perplexity to rank layers by)"
    for batch in batches or []:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
            return "attention", f"{name} is a causal LM, but its inputs are not input_ids of 2 tokens or more"
    return "ppl-gain", (f"{name} is a causal LM: layers are ranked by what int8 saves of the text's next-token "
                        "NLL, the measure a plan is judged by (L + 2 forwards per batch)")


def calibrate(
    model,
    inputs,
    ratio: float = 0.3,
    *,
    tokenizer=None,
    batch_size: int = 8,
    max_length: int | None = 512,
    progress: bool = True,
    objective: str = DEFAULT_OBJECTIVE,
) -> CalibrationResult:
    """Rank every attention layer on ``inputs`` by ``objective`` and write a mixing plan into the config.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention uses the attention interface.
        inputs: a list of strings (needs ``tokenizer``), a tokenized batch (a dict of tensors passed
            as ``model(**batch)``, e.g. ``{"pixel_values": x}``), a list of such dicts, or a tensor
            of input_ids (batch, tokens).
        ratio: share of layers (the most harmed by int4) that get ``"int8"``; the rest ``"int4"``.
        tokenizer: turns string inputs into batches (padding, truncation to ``max_length``).
        batch_size: strings (or input_ids rows) per forward pass; padding never enters a score.
        max_length: truncation length for string inputs (None: no truncation).
        progress: show a progress bar (tqdm when installed).
        objective: ``"auto"`` (:func:`choose_objective`: ``"ppl-gain"`` for a causal LM, else
            ``"attention"``; the CLI's default) or one of :data:`OBJECTIVES`: ``"attention"`` (default,
            the INT4 attention-output score CosSim·(1 − RelL1), one forward per batch) or ``"logit-kl"``
            (end to end: KL of the final next-token distribution with one layer at int4, L + 1 forwards per
            batch; needs logits) or
            ``"logit-kl-gain"`` (the KL drop when one layer of an all-int4 model is int8; L + 2 forwards) or
            ``"ppl-gain"`` (the drop of the next-token NLL of ``inputs`` when one layer of an all-int4 model is
            int8; L + 2 forwards; needs logits and input_ids).

    Returns a :class:`CalibrationResult` (``plan, scores = calibrate(...)``): ``scores[layer]`` has the
    mean and worst over inputs (a :class:`~hf_qattn.calibration.scoring.Score` or a :class:`Sensitivity`), plus the
    number of forwards and seconds spent. ``model.config.qattn_plan`` holds ``plan.to_dict()``; its
    ``split_channel`` lists the layers whose K has a channel smoothing cannot tame (seen in the objective's
    full-precision pass): those layers compute it apart, the others pay nothing for it.
    The model comes back in its previous attention implementation and train/eval mode.
    """
    check_ratio(ratio, "layers")
    check_objective(objective)
    check_count("batch_size", batch_size)
    check_count("max_length", max_length, none_ok=True, what="tokens a string input is truncated to")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError("model must be a transformers PreTrainedModel (with .config and .set_attn_implementation)")
    from . import attention, registration

    registration.register()
    batches = _batches(inputs, tokenizer, batch_size, max_length)
    device = _model_device(model)
    accepts_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    calls = []
    for batch in batches:
        call = {name: (value.to(device) if isinstance(value, torch.Tensor) else value) for name, value in batch.items()}
        if accepts_use_cache:
            call.setdefault("use_cache", False)
        calls.append(call)

    chosen_by = None
    if objective == AUTO:
        objective, chosen_by = choose_objective(model, batches)
    previous_impl = config._attn_implementation
    was_training = model.training
    run, _cost = OBJECTIVES[objective]
    started = time.perf_counter()
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    try:
        model.eval()
        with torch.no_grad():
            scores, ranking, extra, skipped, forwards = run(model, calls, progress)
    finally:
        model.set_attn_implementation(previous_impl)
        model.train(was_training)
    seconds = time.perf_counter() - started

    split_layers = extra.pop("split_channel")  # the plan's own field, not provenance
    if chosen_by is not None:
        extra = {**extra, "chosen_by": f"auto: {chosen_by}"}
    meta = describe(batches=len(batches), objective=objective, forwards=forwards, **extra)
    plan = QAttnPlan.from_scores(ranking, ratio, num_layers=attention._num_layers(config), meta=meta)
    plan.split_channel = split_layers
    setattr(config, PLAN_CONFIG_KEY, plan.to_dict())
    return CalibrationResult(plan=plan, scores=scores, skipped=dict(skipped), objective=objective,
                             forwards=forwards, seconds=seconds, chosen_by=chosen_by)
