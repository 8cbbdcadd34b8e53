"""The calibration plots, in one style: matplotlib's object API on an Agg canvas (pyplot's state is left
alone), the same score label, the int8 entries of the plan marked.

- :func:`plot_layer_scores`: a point per layer (mean INT4 score, worst input as a tick, joined by a
  line), for :func:`hf_qattn.calibrate`'s result. Points, not bars: the scores sit near 1, so the axis
  is zoomed, and a bar on a zoomed axis would show its length, not its value, as the difference;
- :func:`plot_layer_sensitivity`: a bar per layer from zero (the mean of an end-to-end objective's
  metric: KL or NLL change, worst input as a tick), for the other objectives of :func:`hf_qattn.calibrate`;
- :func:`plot_scores`: a step × layer heatmap (mean and worst), for
  :func:`hf_qattn.calibrate_pipeline`'s result or a plan it saved (its meta keeps the scores).

Both raise ``ImportError`` naming the extra to install when matplotlib is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..plan import QAttnPlan
from .scoring import METRIC

SCORE_LABEL = f"INT4 score ({METRIC})"
LAYER_SCORE_LABEL = f"{SCORE_LABEL}\n1 = exact, higher is better (axis zoomed)"


def _figure(figsize, **options):
    """A Figure on an Agg canvas, or ImportError when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install 'hf-qattn[plot]'") from error
    figure = Figure(figsize=figsize, **options)
    FigureCanvasAgg(figure)
    return figure


def _layer_figure(result, title: str, ylabel: str, draw, marker: str, legend_loc: str):
    """A per-layer figure: ``draw(ax, layers, means, worst, colors)`` draws the means, then the worst input
    as a black tick, int8 layers of the plan in orange, and a legend whose plan entries use ``marker``."""
    from matplotlib.lines import Line2D

    layers = sorted(result.scores)
    figure = _figure((max(4.0, 0.45 * len(layers) + 2), 3.8), layout="tight")
    means = [result.scores[layer].mean for layer in layers]
    worst = [result.scores[layer].worst for layer in layers]
    colors = ["tab:orange" if result.plan.precision(layer) == "int8" else "tab:blue" for layer in layers]
    ax = figure.subplots()
    draw(ax, layers, means, worst, colors)
    ax.scatter(layers, worst, marker="_", s=160, color="black", zorder=3)
    if len(layers) <= 32:  # layers are integers: a tick on each (matplotlib's default put 0.5 between two)
        ax.set_xticks(layers)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=10)
    handles = [Line2D([], [], color=color, marker=marker, linestyle="", markersize=8, label=label)
               for color, label in (("tab:orange", "int8 (plan)"), ("tab:blue", "int4 (plan)"))]
    handles.append(Line2D([], [], color="black", marker="_", linestyle="", markersize=12, label="worst input"))
    ax.legend(handles=handles, loc=legend_loc, fontsize=8)
    return figure


def layer_scores_figure(result, title: str):
    """The figure :func:`plot_layer_scores` saves: per layer, the mean INT4 score as a point and the worst
    input as a tick joined to it, int8 layers in orange; the y axis zoomed onto the scores (labelled so)."""
    def draw(ax, layers, means, worst, colors):
        ax.vlines(layers, worst, means, colors=colors, linewidth=1.5)
        ax.scatter(layers, means, c=colors, s=40, zorder=3)
        low = min(worst + means)
        ax.set_ylim(max(0.0, low - 0.3 * (1.0 - low) - 1e-4), 1.0)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    return _layer_figure(result, title, LAYER_SCORE_LABEL, draw, "o", "lower right")


def plot_layer_scores(result, path, title: str):
    """Save :func:`layer_scores_figure` as a PNG. Returns the path."""
    layer_scores_figure(result, title).savefig(path, dpi=120)
    return path


def layer_sensitivity_figure(result, title: str, label: str):
    """Per layer, the objective's mean as a bar from zero (an unzoomed axis: lengths compare), the worst
    input as a tick, int8 layers in orange; ``label`` says what the value is and which way is better."""
    def draw(ax, layers, means, worst, colors):
        ax.bar(layers, means, color=colors, width=0.7)
        ax.axhline(0.0, color="gray", linewidth=0.8)
    return _layer_figure(result, title, label, draw, "s", "upper right")


def plot_layer_sensitivity(result, path, title: str, label: str):
    """Save :func:`layer_sensitivity_figure` as a PNG. Returns the path."""
    layer_sensitivity_figure(result, title, label).savefig(path, dpi=120)
    return path


def _score_grid(source, denoiser: str | None):
    """(mean grid, worst grid, int8 mask) as steps × layers lists from a calibration or a plan."""
    if hasattr(source, "all_scores") and hasattr(source, "plans"):  # a PipelineCalibration
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

    ``source`` is a :class:`~hf_qattn.integrations.diffusers.calibration.PipelineCalibration` or a
    plan saved by calibration (its meta keeps the scores). Returns the path.
    """
    mean, worst, int8 = _score_grid(source, denoiser)
    steps, layers = len(mean), len(mean[0])
    figure = _figure((min(4 + 0.25 * layers, 24) * 2, min(2.5 + 0.18 * steps, 16)), constrained_layout=True)
    from matplotlib.ticker import MaxNLocator

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
        axis.set_title(f"{SCORE_LABEL}, {name}")
        figure.colorbar(image, ax=axis)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return str(path)
