"""What every ``hf-qattn`` subcommand shares: the user-error class and the argument types."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..plan import check_ratio


class CLIError(Exception):
    """A problem the user can fix: printed as ``hf-qattn: error: ...`` with exit status 1."""


def ratio(text: str) -> float:
    """Share of entries (layers, or (step, layer) pairs) marked int8: a number in [0, 1]."""
    try:
        return check_ratio(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] (the share marked int8); got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def read_text_lines(path: Path, limit: int | None = None) -> list[str]:
    """Non-empty lines of a text file, without '#' comments and WikiText '= Heading =' lines."""
    if not path.is_file():
        raise CLIError(f"--text: no such file: {path}")
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or (line.startswith("=") and line.endswith("=")):
            continue
        lines.append(line)
        if limit is not None and len(lines) >= limit:
            break
    if not lines:
        raise CLIError(f"--text: {path} holds no text lines")
    return lines
