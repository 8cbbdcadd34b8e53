"""A/B of kernel variants, one process each: a variant file imported in place of one of the package's kernel modules.

    KERNEL_VARIANT=decode:/path/to/decode_x.py python3 eval/studies/decode_warps.py TAG

:func:`use_from_env` must run before anything imports ``hf_qattn`` (the study scripts call it first). The variant
stands in for ``hf_qattn.kernels.<module>`` in this process only; no file is overwritten. (Copying a variant over
the path that ``python3 -c 'import hf_qattn.kernels.decode as m; print(m.__file__)'`` prints is no A/B when run
from a checkout's root: there the import finds the checkout's ``hf_qattn``, which maps the checkout's ``kernels/``,
and the copy lands on that source, which the installed package never reads.)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


class _VariantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, path: str):
        self.name, self.path = name, path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def use(module: str, path: str) -> None:
    """Import ``path`` as ``hf_qattn.kernels.<module>`` (its relative imports resolve in ``hf_qattn.kernels``)."""
    name = f"hf_qattn.kernels.{module}"
    if name in sys.modules:
        raise RuntimeError(f"{name} is already imported: load the variant before hf_qattn")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"kernel variant {path!r} for {name}: no such file")
    sys.meta_path.insert(0, _VariantFinder(name, os.path.abspath(path)))


def use_from_env() -> str | None:
    """``KERNEL_VARIANT=module:path`` (e.g. ``decode:tmp/decode_x.py``): :func:`use` it; returns the path."""
    spec = os.environ.get("KERNEL_VARIANT")
    if not spec:
        return None
    module, _, path = spec.partition(":")
    use(module, path)
    return path


def loaded_from(module: str) -> str:
    """The file ``hf_qattn.kernels.<module>`` was imported from (a study prints it: the A/B ran that kernel)."""
    return sys.modules[f"hf_qattn.kernels.{module}"].__file__
