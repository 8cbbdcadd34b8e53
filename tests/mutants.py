"""Mutants: a copy of a kernels module with one edit, imported fresh, so a test can show that it fails when the
kernel is wrong (a test that cannot fail is not a test). Tests import this by its plain name (pytest puts tests/
on sys.path)."""

from __future__ import annotations

import importlib.util
import inspect
import sys


def mutant_module(tmp_path, module, old: str, new: str):
    """``module``'s source with the one occurrence of ``old`` replaced by ``new``, written under ``tmp_path`` and
    imported as a new module (relative imports of kernels/common.py made absolute)."""
    source = inspect.getsource(module)
    assert source.count(old) == 1, old
    source = source.replace(old, new).replace("from .common import", "from hf_qattn.kernels.common import")
    path = tmp_path / f"mutant_{module.__name__.rsplit('.', 1)[-1]}_{abs(hash(new))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mutant = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mutant
    spec.loader.exec_module(mutant)
    return mutant
