"""Counts of where attention calls went, and warn-once reporting of fallbacks.

Every call of :func:`hf_qattn.qattn` (and of the integrations) is counted under the path that
served it, named as in :mod:`hf_qattn.support`: ``triton`` (the GPU kernels), ``reference`` (the
PyTorch simulation, used for CPU tensors), ``unquantized-by-plan`` (the plan asked for full
precision), or a fallback: ``sdpa`` (full-precision SDPA) or ``eager`` (the model's own attention).
A fallback is also counted under its reason and warned about once per reason, so nothing degrades
silently.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter

_lock = threading.Lock()
_calls: Counter = Counter()
_fallbacks: Counter = Counter()
_warned: set[str] = set()


def record_call(path: str) -> None:
    with _lock:
        _calls[path] += 1


_FALLBACK_NAMES = {"sdpa": "SDPA", "eager": "eager attention"}


def record_fallback(reason: str, path: str = "sdpa") -> None:
    """Count a call served in full precision by ``path`` (``"sdpa"`` or ``"eager"``) because of
    ``reason``; warn the first time."""
    with _lock:
        _calls[path] += 1
        _fallbacks[reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(
            f"hf_qattn: falling back to full-precision {_FALLBACK_NAMES.get(path, path)}: {reason} "
            "(warned once; see hf_qattn.fallback_stats() for counts)",
            RuntimeWarning,
            stacklevel=3,
        )


def record(path: str, reason: str | None = None) -> None:
    """Count a call served by ``path``: a fallback when there is a ``reason`` (warned once), else a
    call of that path. What every caller counts with (through :func:`hf_qattn.ops.record` where the
    call may be inside ``torch.compile``)."""
    if reason is None:
        record_call(path)
    else:
        record_fallback(reason, path)


def record_degraded(reason: str, path: str) -> None:
    """Count ``reason`` for a call that a slower quantized ``path`` serves than this GPU has (the sm90 kernel
    cannot be built with the installed triton, say); warned once. The call itself is counted by the caller."""
    with _lock:
        _fallbacks[reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"hf_qattn: running the {path} kernels instead: {reason} (warned once; see "
                      "hf_qattn.fallback_stats() for counts)", RuntimeWarning, stacklevel=3)


def fallback_stats() -> dict:
    """``{"calls": {path: n}, "fallbacks": {reason: n}}`` since start or the last reset."""
    with _lock:
        return {"calls": dict(_calls), "fallbacks": dict(_fallbacks)}


def reset_fallback_stats() -> None:
    """Zero the counters and re-arm the once-per-reason warnings."""
    with _lock:
        _calls.clear()
        _fallbacks.clear()
        _warned.clear()
