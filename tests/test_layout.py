"""The package's layout: kernels/ depends on nothing above it, hf_qattn's sub-packages depend on each
other in one direction only, and a source checkout that is not installed imports the same modules an
install maps (``kernels/`` → ``hf_qattn.kernels``)."""

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


# What each part of hf_qattn may import from the others (lazy imports inside functions included).
# "top": the modules directly in hf_qattn/ (api, plan, support, reference, quant, masks, ops, stats);
# "facade": hf_qattn/__init__.py, the public API, which imports the integrations and the cache.
ALLOWED_IMPORTS = {
    "top": {"kernels"},
    "kv_cache": {"top", "kernels"},
    "calibration": {"top", "kernels"},
    "integrations": {"top", "kernels", "kv_cache", "calibration"},
    "evaluation": {"top", "kernels", "calibration", "integrations", "facade"},
    "cli": {"top", "kernels", "kv_cache", "calibration", "integrations", "evaluation", "facade"},
    "facade": {"top", "kernels", "kv_cache", "integrations"},
}


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"
    if parts[1] in ("kernels", "configs"):
        return "kernels"
    if (ROOT / "hf_qattn" / parts[1]).is_dir():
        return parts[1]
    return "top"


def _is_module(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: pathlib.Path):
    """The hf_qattn modules ``path`` imports (relative imports resolved; ``from X import name`` is X.name
    when that is a module)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "hf_qattn")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hf_qattn":
                continue
            names = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            yield from names or [target]


def test_subpackages_depend_on_each_other_in_one_direction():
    """kv_cache and calibration sit on the top-level modules only, evaluation on the library, and
    nothing but the command line imports evaluation: no import cycles between the sub-packages."""
    offenders = []
    for path in sorted((ROOT / "hf_qattn").rglob("*.py")):
        source = "facade" if path == ROOT / "hf_qattn" / "__init__.py" else _part(
            ".".join(path.relative_to(ROOT).with_suffix("").parts))
        for target in _imports(path):
            part = _part(target)
            if part != source and part not in ALLOWED_IMPORTS[source]:
                offenders.append(f"{path.relative_to(ROOT)} ({source}) imports {target} ({part})")
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
