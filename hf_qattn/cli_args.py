"""What every ``hf-qattn`` subcommand shares: the user-error class and the argument types.

Kept apart from :mod:`hf_qattn.cli` so that subcommands defined elsewhere (the diffusers one)
can import it without an import cycle.
"""

from __future__ import annotations

import argparse

from .plan import check_ratio


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
