"""Helpers the ``calibrate`` and ``demo`` subcommands share: tables, the score plot, model loading."""

from __future__ import annotations

import sys
from pathlib import Path


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in row]
                                           for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def score_rows(result) -> list[list]:
    return [[layer, score.mean, score.worst, score.count, result.plan.precision(layer)]
            for layer, score in sorted(result.scores.items())]


def save_plot(result, path: Path, title: str, label: str | None = None) -> Path | None:
    """:func:`hf_qattn.calibration.plots.plot_layer_scores` (attention scores), or with ``label`` (an
    end-to-end objective's metric) :func:`~hf_qattn.calibration.plots.plot_layer_sensitivity`; a note and
    None without matplotlib."""
    from ..calibration.plots import plot_layer_scores, plot_layer_sensitivity

    try:
        if label is not None:
            return plot_layer_sensitivity(result, path, title, label)
        return plot_layer_scores(result, path, title)
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib, or pip install 'hf-qattn[plot]')", file=sys.stderr)
        return None


def quiet_transformers() -> None:
    # the CLI prints its own summary; transformers' per-file loading bars would bury it
    from transformers.utils import logging

    logging.disable_progress_bar()


def default_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_class(model_dir: Path):
    """The class named by config.architectures (so saving keeps heads), else AutoModel."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel
