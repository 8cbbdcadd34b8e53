"""Helpers the ``calibrate`` and ``demo`` subcommands share: tables, the score plot, model loading."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path


def _float_format(values) -> str:
    """4 decimals, or 4 significant digits in scientific notation for a column whose largest value is below
    1e-3 (end-to-end objectives' KL and NLL changes are ~1e-6 on small models: 4 decimals showed 0.0000)."""
    finite = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v)]
    largest = max(finite, default=0.0)
    return ".3e" if 0.0 < largest < 1e-3 else ".4f"


def plain_text(docstring: str) -> str:
    """A docstring paragraph as --help prose: Sphinx roles and ``literals`` reduced to their text, one line."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", docstring)
    return " ".join(text.replace("``", "").split())


def format_table(headers: list[str], rows: list[list]) -> str:
    formats = [_float_format([row[i] for row in rows if i < len(row)]) for i in range(len(headers))]
    cells = [[str(h) for h in headers]] + [[format(c, formats[i]) if isinstance(c, float) else str(c)
                                            for i, c in enumerate(row)] for row in rows]
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


def model_class(model_dir: Path, config=None):
    """The class named by config.architectures (so saving keeps heads), else AutoModel."""
    import transformers

    if config is None:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def first_line(error: BaseException) -> str:
    """An exception's first line (the rest is often a traceback-sized explanation), for a one-line error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_config(model_dir: Path):
    """``MODEL_DIR``'s transformers config, or a :class:`CLIError` saying why it does not load (a folder
    without config.json, invalid JSON, an unknown model type)."""
    from transformers import AutoConfig

    from .args import CLIError

    if not (model_dir / "config.json").is_file():
        raise CLIError(f"MODEL_DIR {model_dir} is not a transformers model folder (no config.json)")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as error:  # noqa: BLE001 - JSON, key and value errors all mean the same here
        raise CLIError(f"MODEL_DIR {model_dir}: config.json does not load: {first_line(error)}") from None


def load_tokenizer(model_dir: Path, needed_for: str):
    """``MODEL_DIR``'s tokenizer, or a :class:`CLIError` naming what needs it. Load the config first
    (:func:`load_config`): a broken config.json also breaks the tokenizer, and is reported as itself."""
    from transformers import AutoTokenizer

    from .args import CLIError

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as error:  # noqa: BLE001 - any loading failure means the same thing here
        raise CLIError(f"MODEL_DIR {model_dir} has no loadable tokenizer, which {needed_for} needs "
                       f"({first_line(error)})") from None


def load_model(cls, model_dir: Path, **options):
    """``cls.from_pretrained(model_dir, **options)``, or a :class:`CLIError` (missing or mismatched weights)."""
    from .args import CLIError

    try:
        return cls.from_pretrained(model_dir, **options)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CLIError(f"MODEL_DIR {model_dir}: the model does not load: {first_line(error)}") from None
