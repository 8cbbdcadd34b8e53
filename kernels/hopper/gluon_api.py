"""Gluon's names, imported in one place.

Gluon (``triton.experimental.gluon``) is experimental and has renamed its calls between triton
releases (``warp_specialize`` changed three times from 3.4 to 3.6; 3.9 renamed the TMA load, keeping
the old name as an alias, and renamed ``thread_barrier`` to ``barrier``). The kernels use only what is imported here, and the dispatcher
asks :func:`missing` before it picks them, so an installed triton without these names falls back
to the portable Triton kernel instead of failing at import.
"""

from __future__ import annotations

import functools

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # a class whose fields travel through jit calls and warp_specialize as one value: ``gluon.aggregate``
    # where Gluon exports it, else the same decorator from triton.language
    aggregate = getattr(gluon, "aggregate", None)
    if aggregate is None:
        from triton.language.core import _aggregate as aggregate

    # the TMA tile load: ``async_load`` from 3.9 on, ``async_copy_global_to_shared`` before
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a barrier across the calling partition's warps: ``thread_barrier`` up to 3.6, ``barrier`` from 3.9
    partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _IMPORT_ERROR = None
except (ImportError, AttributeError) as error:  # no triton, or a triton without this Gluon
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"

__all__ = ["gluon", "gl", "aggregate", "fence_async_shared", "mbarrier", "tma", "tma_load", "partition_barrier",
           "warpgroup_mma", "warpgroup_mma_wait", "TensorDescriptor", "missing"]


@functools.lru_cache(maxsize=None)
def missing() -> str | None:
    """Why the installed triton cannot build the Hopper kernels, or None when it can."""
    if _IMPORT_ERROR is not None:
        return f"Gluon unavailable ({_IMPORT_ERROR})"
    import inspect

    if len(inspect.signature(gl.warp_specialize).parameters) < 3:
        return "Gluon's warp_specialize has an unknown signature"
    return None
