"""The PASS/FAIL table that every device check prints last and saves under ``--out``."""

from __future__ import annotations

import datetime
import pathlib


def finish(title: str, versions: str, rows: list[tuple[str, bool, str]], out: pathlib.Path | None,
           stem: str, gpu: str) -> int:
    """Print ``rows`` (check, passed, what was measured) as markdown, write ``<stem>-<gpu>-<date>.md``
    under ``out`` when given; the process's exit code: 0 when every check passed."""
    today = datetime.date.today()
    lines = [f"# {title} — {gpu}, {today}", versions, "", "| check | result | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    text = "\n".join(lines)
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}-{gpu.replace(' ', '-')}-{today}.md").write_text(text + "\n")
    return 0 if all(ok for _, ok, _ in rows) else 1
