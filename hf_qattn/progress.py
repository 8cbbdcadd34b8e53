"""Progress bars, one kind everywhere: tqdm when it is installed, else a line on stderr.

``Progress(desc)`` counts steps toward a total that may be known only after the first one
(``start(total)``); :func:`track` wraps a sized iterable. Disabled bars (``enabled=False``) print nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sized


class Progress:
    def __init__(self, desc: str, enabled: bool = True, leave: bool = True):
        self.desc, self.enabled, self.leave = desc, enabled, leave
        self.done, self.total, self._bar = 0, 0, None

    def start(self, total: int) -> "Progress":
        self.total = total
        if self.enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm is optional: a stderr line instead
                return self
            self._bar = tqdm(total=total, desc=self.desc, leave=self.leave)
        return self

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        else:
            print(f"\r{self.desc}: {self.done}/{self.total}", end="\n" if self.done == self.total else "",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def track(items: Iterable, desc: str, enabled: bool = True, leave: bool = True):
    """Yield ``items`` with a bar over them (none for fewer than two items, or when disabled)."""
    total = len(items) if isinstance(items, Sized) else None
    if not enabled or total is None or total < 2:
        yield from items
        return
    bar = Progress(desc, enabled, leave).start(total)
    try:
        for item in items:
            yield item
            bar.step()
    finally:
        bar.close()
