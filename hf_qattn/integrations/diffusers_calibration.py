"""Per-(step, layer) calibration of a diffusers pipeline: where may attention run 4-bit?

The pipeline runs its normal denoising loop in full precision (its outputs are the unpatched
ones). At every attention call of the denoiser, the INT4 kernel is scored on the very Q, K, V it
sees (:func:`hf_qattn.scoring.attention_accuracy`, score = CosSim · (1 − RelL1)), filed under the
current denoising step (see :mod:`hf_qattn.integrations.diffusers_steps`) and the module's layer
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

from ..plan import QAttnPlan, check_ratio
from ..scoring import Score, attention_accuracy
from .diffusers import _start_patch, store_plan

CALIBRATION_QK = "int4"
METRIC = "cos_sim*(1-rel_l1)"

StepLayer = tuple[int, int]


@dataclass
class PipelineCalibration:
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

    def __iter__(self):
        yield self.plan
        yield self.scores

    def to_dict(self) -> dict:
        return {
            "metric": METRIC,
            "qk": CALIBRATION_QK,
            "num_steps": self.num_steps,
            "plans": {name: plan.to_dict() for name, plan in self.plans.items()},
            "scores": {name: [{"step": s, "layer": l, **score.as_dict()} for (s, l), score in sorted(table.items())]
                       for name, table in self.all_scores.items()},
            "skipped": dict(self.skipped),
        }


class _ScoreRecorder:
    """Receives every denoiser attention call during calibration; keeps numbers, never tensors."""

    def __init__(self):
        self.skipped: Counter = Counter()
        self._prompt: dict[tuple[str, int, int], list] = defaultdict(list)  # this prompt's calls
        # (denoiser, step, layer) -> per-prompt [score, cos, rel_l1] means, and the worst call
        self._per_prompt: dict[tuple[str, int, int], list[tuple[float, float, float]]] = defaultdict(list)
        self._worst: dict[tuple[str, int, int], float] = {}

    def record(self, denoiser: str, step: int, layer: int, named: dict, keys, gap: str | None) -> None:
        if gap is not None:
            self.skipped[gap] += 1
            return
        result = attention_accuracy(named["query"], named["key"], named["value"], qk=CALIBRATION_QK,
                                    is_causal=bool(named["is_causal"]), sm_scale=named["scale"], layout="HND",
                                    kv_start=keys.start, kv_end=keys.end)
        if not math.isfinite(result.score):
            self.skipped["non-finite score"] += 1
            return
        key = (denoiser, step, layer)
        self._prompt[key].append((result.score, result.cos_sim, result.rel_l1))
        self._worst[key] = min(self._worst.get(key, math.inf), result.score)

    def end_prompt(self) -> None:
        for key, calls in self._prompt.items():
            self._per_prompt[key].append(tuple(sum(column) / len(calls) for column in zip(*calls)))
        self._prompt.clear()

    def scores(self) -> dict[str, dict[StepLayer, Score]]:
        tables: dict[str, dict[StepLayer, Score]] = defaultdict(dict)
        for (denoiser, step, layer), rows in sorted(self._per_prompt.items()):
            mean, cos, rel = (sum(column) / len(rows) for column in zip(*rows))
            tables[denoiser][(step, layer)] = Score(mean, self._worst[(denoiser, step, layer)], len(rows),
                                                             cos, rel)
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

    Returns a :class:`PipelineCalibration`; see :func:`plot_scores` for the step × layer heatmap.
    """
    check_ratio(ratio, "(step, layer) entries")
    if not isinstance(num_inference_steps, int) or isinstance(num_inference_steps, bool) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be a positive integer; got {num_inference_steps!r}")
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
        meta = {
            "method": "sageattn-mix",
            "metric": METRIC,
            "qk_scored": CALIBRATION_QK,
            "prompts": len(calls),
            "num_inference_steps": num_inference_steps,
            # [mean, worst] by step, then layer: what plot_scores draws from a saved plan
            "scores": {str(s): {str(l): [round(score.mean, 6), round(score.worst, 6)]
                                for (s2, l), score in sorted(table.items()) if s2 == s}
                       for s in sorted({s for s, _ in table})},
        }
        plans[name] = QAttnPlan.from_scores(means, ratio, num_layers=num_layers[name], num_steps=num_steps, meta=meta)
        if write_config:
            store_plan(models[name], plans[name])
    return PipelineCalibration(plans=plans, all_scores=all_scores, num_steps=num_steps, skipped=dict(recorder.skipped))


def _score_grid(source, denoiser: str | None):
    """(mean grid, worst grid, int8 mask) as steps × layers lists from a calibration or a plan."""
    if isinstance(source, PipelineCalibration):
        name = denoiser or next(iter(source.plans))
        if name not in source.plans:
            raise KeyError(f"denoiser must be one of {sorted(source.plans)}; got {denoiser!r}")
        plan = source.plans[name]
        table = {key: (score.mean, score.worst) for key, score in source.all_scores[name].items()}
    elif isinstance(source, QAttnPlan):
        plan = source
        saved = source.meta.get("scores")
        if not isinstance(saved, Mapping):
            raise ValueError("this plan carries no scores (plan.meta['scores']); pass the calibration result")
        table = {(int(s), int(l)): tuple(pair) for s, row in saved.items() for l, pair in row.items()}
    else:
        raise TypeError(f"source must be a PipelineCalibration or a calibrated QAttnPlan; got {type(source).__name__}")
    steps = max(plan.num_steps or 0, 1 + max(s for s, _ in table))
    layers = max(plan.num_layers or 0, 1 + max(l for _, l in table))
    mean = [[math.nan] * layers for _ in range(steps)]
    worst = [[math.nan] * layers for _ in range(steps)]
    int8 = [[plan.precision(l, s) == "int8" for l in range(layers)] for s in range(steps)]
    for (s, l), (m, w) in table.items():
        mean[s][l], worst[s][l] = m, w
    return mean, worst, int8


def plot_scores(source, path, *, denoiser: str | None = None, title: str | None = None) -> str:
    """Write a step × layer heatmap PNG of the INT4 scores (mean and worst), int8 entries marked.

    ``source`` is a :class:`PipelineCalibration` or a plan saved by calibration (its meta keeps
    the scores). Uses matplotlib's Agg canvas, leaving pyplot's state alone. Returns the path.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError("plot_scores needs matplotlib: pip install 'hf-qattn[plot]'") from error
    mean, worst, int8 = _score_grid(source, denoiser)
    steps, layers = len(mean), len(mean[0])
    figure = Figure(figsize=(min(4 + 0.25 * layers, 24) * 2, min(2.5 + 0.18 * steps, 16)), constrained_layout=True)
    FigureCanvasAgg(figure)
    marked = [(l, s) for s in range(steps) for l in range(layers) if int8[s][l]]
    for axis, grid, name in zip(figure.subplots(1, 2), (mean, worst), ("mean", "worst")):
        image = axis.imshow(grid, aspect="auto", origin="upper", cmap="viridis", interpolation="nearest")
        if marked:
            axis.scatter([l for l, _ in marked], [s for _, s in marked], marker="s", s=12, facecolors="none",
                         edgecolors="red", linewidths=0.8, label="int8")
            axis.legend(loc="upper right", fontsize="small")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("attention layer")
        axis.set_ylabel("denoising step")
        axis.set_title(f"INT4 score ({METRIC}), {name}")
        figure.colorbar(image, ax=axis)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return str(path)
