"""The package's layout: kernels/ depends on nothing above it, and a source checkout that is not
installed imports the same modules an install maps (``kernels/`` → ``hf_qattn.kernels``)."""

from __future__ import annotations

import ast
import pathlib
import site
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_import_nothing_from_hf_qattn_above_them():
    offenders = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_qattn"):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("hf_qattn") for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}: import hf_qattn")
    assert not offenders, offenders


def test_an_uninstalled_checkout_maps_kernels_and_configs(tmp_path):
    # -S: no site processing, so no editable-install finder; the checkout and the installed
    # dependencies (torch, triton) alone are on the path
    paths = [str(ROOT)] + site.getsitepackages()
    code = (f"import sys; sys.path[:0] = {paths!r}\n"
            "import hf_qattn\n"
            "from hf_qattn.kernels import formats, launch, tuning\n"
            "assert hf_qattn.kernels.__file__.startswith(sys.path[0]), hf_qattn.kernels.__file__\n"
            "assert tuning.hopper_config(128)['BLOCK_N'] == 128\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
