"""What every ``hf-qattn`` subcommand shares: the user-error class and the argument types.

Kept apart from :mod:`hf_qattn.cli` so that subcommands defined elsewhere (the diffusers one)
can import it without an import cycle.
"""

from __future__ import annotations

import argparse


class CLIError(Exception):
    """A problem the user can fix: printed as ``hf-qattn: error: ...`` with exit status 1."""


def ratio(text: str) -> float:
    """Share of entries (layers, or (step, layer) pairs) marked int8: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1]; got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] (the share marked int8); got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value
