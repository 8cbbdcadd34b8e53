"""What every ``hf-qattn`` subcommand shares: the user-error class and the argument types."""

from __future__ import annotations

import argparse
import tempfile
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


def read_text(path, option: str) -> str:
    """The UTF-8 text of ``path``, or a CLIError naming ``option`` (missing file, folder, not UTF-8)."""
    path = Path(path)
    if not path.is_file():
        raise CLIError(f"{option}: no such file: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CLIError(f"{option}: {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                       f"{error.start}); convert it, e.g. iconv -t utf-8") from None
    except OSError as error:
        raise CLIError(f"{option}: cannot read {path}: {error.strerror or error}") from None


def scan_text_lines(path: Path, limit: int | None = None) -> tuple[list[str], dict[str, int]]:
    """(the lines :func:`read_text_lines` keeps, how many it skipped by reason)."""
    skipped = {"blank": 0, "'#' comment": 0, "'= heading ='": 0, "past --max-samples": 0}
    lines = []
    for raw in read_text(path, "--text").splitlines():
        line = raw.strip()
        if not line:
            skipped["blank"] += 1
        elif line.startswith("#"):
            skipped["'#' comment"] += 1
        elif line.startswith("=") and line.endswith("="):
            skipped["'= heading ='"] += 1
        elif limit is not None and len(lines) >= limit:
            skipped["past --max-samples"] += 1
        else:
            lines.append(line)
    if not lines:
        raise CLIError(f"--text: {path} holds no text lines")
    return lines, {reason: n for reason, n in skipped.items() if n}


def read_text_lines(path: Path, limit: int | None = None) -> list[str]:
    """Non-empty lines of a UTF-8 text file, without '#' comments and WikiText '= Heading =' lines."""
    return scan_text_lines(path, limit)[0]


def check_out_dir(path, option: str = "--out", *, source=None, source_name: str = "MODEL_DIR") -> None:
    """Fail now, before any model loads, if ``path`` cannot become an output folder: it is a file, a
    file is in its way, it cannot be created or written into (tried for real: the folders it needs are
    created and a probe file written, then both removed, so /proc, read-only mounts and permissions all
    show here, not after the long work), or it is ``source`` (the input folder, which the command would
    overwrite in place)."""
    path = Path(path)
    if source is not None and path.resolve() == Path(source).resolve():
        raise CLIError(f"{option}: {path} is {source_name} itself, which would be overwritten in place; "
                       "give a new or other folder")
    if path.exists() and not path.is_dir():
        raise CLIError(f"{option}: {path} exists and is not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CLIError(f"{option}: cannot create {path}: {parent} is not a folder")
    created = [folder for folder in (path, *path.parents) if not folder.exists()]
    action = "create"
    try:
        path.mkdir(parents=True, exist_ok=True)
        action = "write into"
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise CLIError(f"{option}: cannot {action} {path}: {error.strerror or error}") from None
    finally:
        for folder in created:  # innermost first; only the folders made here, and only while still empty
            try:
                folder.rmdir()
            except OSError:
                break
