"""Per-(step, layer) calibration of a diffusers pipeline: where may attention run 4-bit?

The pipeline runs its normal denoising loop in full precision (its outputs are the unpatched
ones). At every attention call of the denoiser, the INT4 kernel is scored on the very Q, K, V it
sees (:func:`hf_qattn.calibration.scoring.attention_accuracy`, score = CosSim · (1 − RelL1)), filed under the
current denoising step (see :mod:`hf_qattn.integrations.diffusers.steps`) and the module's layer
index. Several calls at one (step, layer) within a prompt — separate cond / uncond passes — are
averaged; each prompt then counts once in the mean, and the worst single call is kept too. The
lowest-scoring ``ratio`` share of (step, layer) entries by mean becomes ``"int8"``, the rest
``"int4"`` (:meth:`hf_qattn.QAttnPlan.from_scores`), written into each denoiser's config so that
``pipe.save_pretrained`` stores it in ``transformer/config.json`` and :func:`hf_qattn.patch` finds it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ...plan import QAttnPlan, check_ratio
from ...support import check_count
from ...calibration.scoring import CALIBRATION_QK, CalibrationOutcome, Score, ScoreSums, attention_accuracy, describe
from .patching import _start_patch, store_plan

StepLayer = tuple[int, int]


@dataclass
class PipelineCalibration(CalibrationOutcome):
    """What :func:`calibrate_pipeline` found: ``plan, scores = calibrate_pipeline(...)`` unpacks
    the first denoiser's; ``plans`` / ``all_scores`` hold every denoiser's (Wan 2.2 has two)."""

    plans: dict[str, QAttnPlan]
    all_scores: dict[str, dict[StepLayer, Score]]
    num_steps: int
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def plan(self) -> QAttnPlan:
        return next(iter(self.plans.values()))

    @property
    def scores(self) -> dict[StepLayer, Score]:
        return next(iter(self.all_scores.values()))

    def to_dict(self) -> dict:
        return self._json(num_steps=self.num_steps,
                          plans={name: plan.to_dict() for name, plan in self.plans.items()},
                          scores={name: [{"step": s, "layer": l, **score.as_dict()}
                                         for (s, l), score in sorted(table.items())]
                                  for name, table in self.all_scores.items()})


class _ScoreRecorder:
    """Receives every denoiser attention call during calibration; keeps numbers, never tensors."""

    def __init__(self):
        self.skipped: Counter = Counter()
        # (denoiser, step, layer) -> this prompt's calls, and the per-prompt means (with the worst call)
        self._prompt: dict[tuple[str, int, int], ScoreSums] = defaultdict(ScoreSums)
        self._per_prompt: dict[tuple[str, int, int], ScoreSums] = defaultdict(ScoreSums)

    def record(self, denoiser: str, step: int, layer: int, named: dict, pattern, gap: str | None) -> None:
        if gap is not None:
            self.skipped[gap] += 1
            return
        key, value = pattern.keys(named["key"], named["value"])
        result = attention_accuracy(named["query"], key, value, qk=CALIBRATION_QK, sm_scale=named["scale"],
                                    layout="HND", **pattern.qattn_options())
        if not math.isfinite(result.score):
            self.skipped["non-finite score"] += 1
            return
        self._prompt[(denoiser, step, layer)].add(result.score, result.cos_sim, result.rel_l1)

    def end_prompt(self) -> None:
        for key, calls in self._prompt.items():
            prompt = calls.score()
            self._per_prompt[key].add(prompt.mean, prompt.cos_sim, prompt.rel_l1, worst=prompt.worst)
        self._prompt.clear()

    def scores(self) -> dict[str, dict[StepLayer, Score]]:
        tables: dict[str, dict[StepLayer, Score]] = defaultdict(dict)
        for (denoiser, step, layer), sums in sorted(self._per_prompt.items()):
            tables[denoiser][(step, layer)] = sums.score()
        return dict(tables)


def _prompt_calls(prompts) -> list[dict]:
    """Each prompt as the keyword arguments of one pipeline call."""
    if isinstance(prompts, (str, Mapping)):
        raise ValueError("prompts must be a list (of strings, or of dicts of pipeline arguments such as "
                         "{'prompt_embeds': ...}); got a single one — wrap it in a list")
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of strings or of dicts; got {type(prompts).__name__}")
    calls = []
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            calls.append({"prompt": item})
        elif isinstance(item, Mapping):
            calls.append(dict(item))
        else:
            raise ValueError(f"prompts[{index}] must be a string or a dict of pipeline arguments; "
                             f"got {type(item).__name__}")
    return calls


def calibrate_pipeline(
    pipe,
    prompts,
    num_inference_steps: int = 50,
    ratio: float = 0.3,
    *,
    seed: int | None = 0,
    write_config: bool = True,
    **pipeline_kwargs,
) -> PipelineCalibration:
    """Score the INT4 kernel at every (step, layer) of ``pipe``'s denoiser and build a 4/8-bit plan.

    Args:
        pipe: a diffusers pipeline (not patched; its ``transformer`` / ``transformer_2`` / ``unet``
            are calibrated, each with its own plan).
        prompts: a list of prompt strings, or of dicts of pipeline arguments (e.g.
            ``{"prompt_embeds": ..., "negative_prompt_embeds": ...}``), one pipeline call each.
        num_inference_steps: denoising steps per call; the plan records it as ``num_steps`` and maps
            runs with other step counts by relative position.
        ratio: share of (step, layer) entries, lowest mean score first, that get ``"int8"``.
        seed: each call gets ``generator=torch.Generator().manual_seed(seed + i)`` unless
            ``pipeline_kwargs`` has a generator; None leaves the pipeline's default randomness.
        write_config: store each plan in its denoiser's config (``config.qattn_plan``).
        **pipeline_kwargs: passed to every call (height, width, guidance_scale, ...);
            ``output_type`` defaults to ``"latent"`` (no decoding needed to calibrate).

    Returns a :class:`PipelineCalibration`; see :func:`hf_qattn.calibration.plots.plot_scores` for the
    step × layer heatmap.
    """
    check_ratio(ratio, "(step, layer) entries")
    check_count("num_inference_steps", num_inference_steps)
    if not callable(pipe) or not isinstance(getattr(pipe, "components", None), Mapping):
        raise TypeError(f"pipe must be a diffusers pipeline; got {type(pipe).__name__}")
    calls = _prompt_calls(prompts)
    recorder = _ScoreRecorder()
    handle = _start_patch(pipe, None, None, recorder)
    models = {name: denoiser.model for name, denoiser in handle.denoisers.items()}
    num_layers = {name: len(denoiser.layer_names) for name, denoiser in handle.denoisers.items()}
    totals = set()
    try:
        for index, call in enumerate(calls):
            arguments = {**pipeline_kwargs, **call, "num_inference_steps": num_inference_steps}
            arguments.setdefault("output_type", "latent")
            if seed is not None and "generator" not in arguments:
                arguments["generator"] = torch.Generator().manual_seed(seed + index)
            pipe(**arguments)
            recorder.end_prompt()
            totals.add(handle.total_steps)
    finally:
        handle.unpatch()

    all_scores = recorder.scores()
    if not all_scores:
        reasons = ", ".join(f"{reason} ({n})" for reason, n in recorder.skipped.items()) or "no attention call seen"
        raise RuntimeError(f"calibration scored no attention call of {sorted(models)}: {reasons}")
    seen_steps = 1 + max(step for table in all_scores.values() for step, _ in table)
    num_steps = max([seen_steps] + [t for t in totals if t])
    plans = {}
    for name, table in all_scores.items():
        means = {key: score.mean for key, score in table.items()}
        # scores: [mean, worst] by step, then layer: what plot_scores draws from a saved plan
        meta = describe(prompts=len(calls), num_inference_steps=num_inference_steps,
                        scores={str(s): {str(l): [round(score.mean, 6), round(score.worst, 6)]
                                         for (s2, l), score in sorted(table.items()) if s2 == s}
                                for s in sorted({s for s, _ in table})})
        plans[name] = QAttnPlan.from_scores(means, ratio, num_layers=num_layers[name], num_steps=num_steps, meta=meta)
        if write_config:
            store_plan(models[name], plans[name])
    return PipelineCalibration(plans=plans, all_scores=all_scores, num_steps=num_steps, skipped=dict(recorder.skipped))


