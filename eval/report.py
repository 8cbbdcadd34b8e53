"""The one report writer of eval/: where a result goes, what its header says, and the PASS/FAIL table.

Every maintained script writes one markdown file per run, ``eval/results/<stem>-<device>-<date>.md``
(the device's name with dashes for spaces, ``cpu`` without a GPU), headed by the device, the date and
the versions that shaped the numbers. ``eval/results/README.md`` indexes the current file of each;
older runs live in git history.
"""

from __future__ import annotations

import datetime
import importlib
import pathlib
import platform

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def device_name() -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def today() -> str:
    return datetime.date.today().isoformat()


def versions(*packages: str) -> str:
    """``torch …, triton …, <packages> …, hf_qattn …, python …``: the ones installed (a missing optional
    package is named as such, so a table never hides which build produced it)."""
    parts = [f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    for name in ("triton", *packages, "hf_qattn"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            parts.append(f"{name} not installed")
            continue
        parts.append(f"{name} {getattr(module, '__version__', 'from source')}")
    parts.append(f"python {platform.python_version()}")
    return ", ".join(parts)


def result_path(stem: str, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Where a run's markdown goes: ``out`` when it names a ``.md`` file, else ``<stem>-<device>-<date>.md``
    in ``out`` (a folder) or in eval/results/."""
    if out is not None and str(out).endswith(".md"):
        return pathlib.Path(out)
    folder = pathlib.Path(out) if out is not None else RESULTS
    return folder / f"{stem}-{device_name().replace(' ', '-')}-{today()}.md"


def write(path: pathlib.Path, text: str) -> pathlib.Path:
    """Write ``text`` (a final newline added), creating the folder; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
    return path


def finish(title: str, versions_line: str, rows: list[tuple[str, bool, str]], out: pathlib.Path | None,
           stem: str, gpu: str | None = None) -> int:
    """Print ``rows`` (check, passed, what was measured) as markdown — the table every device check prints
    last — and write it to ``<stem>-<device>-<date>.md`` under ``out`` when given. Returns the process's exit
    code: 0 when every check passed."""
    gpu = gpu or device_name()
    lines = [f"# {title} — {gpu}, {today()}", versions_line, "", "| check | result | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    text = "\n".join(lines)
    print(text)
    if out:
        write(pathlib.Path(out) / f"{stem}-{gpu.replace(' ', '-')}-{today()}.md", text)
    return 0 if all(ok for _, ok, _ in rows) else 1
