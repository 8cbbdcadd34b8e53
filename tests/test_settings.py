"""The HF_QATTN_* environment variables: named and read in one module (hf_qattn.kernels.settings), at call time."""

from __future__ import annotations

import ast
import pathlib
import re

from hf_qattn.kernels import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"HF_QATTN_[A-Z0-9_]+")


def _names_in_code(path: pathlib.Path) -> set[str]:
    """HF_QATTN_* names a module's code spells as a string of its own (docstrings and comments aside)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)}


def test_variables_are_named_only_in_the_settings_module():
    offenders = {}
    for path in [*(ROOT / "hf_qattn").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        if path != ROOT / "kernels" / "settings.py" and _names_in_code(path):
            offenders[str(path.relative_to(ROOT))] = sorted(_names_in_code(path))
    assert not offenders, offenders
    # the start-up hook reads its one variable itself (it runs before any package may be imported): the same name
    assert _names_in_code(ROOT / "_hf_qattn_startup.py") == {settings.NO_STARTUP_HOOK}
    listed = {settings.FAST_LAUNCH, settings.EXACT_INT4, settings.SPLIT_CHANNEL, settings.NO_STARTUP_HOOK}
    assert listed <= set(NAME.findall(settings.__doc__))


def test_read_at_call_time_with_their_defaults(monkeypatch):
    for name in (settings.FAST_LAUNCH, settings.EXACT_INT4, settings.SPLIT_CHANNEL):
        monkeypatch.delenv(name, raising=False)
    assert settings.fast_launch_mode() == "1" and not settings.exact_int4() and not settings.split_channel()
    monkeypatch.setenv(settings.FAST_LAUNCH, "check")
    monkeypatch.setenv(settings.EXACT_INT4, "1")
    monkeypatch.setenv(settings.SPLIT_CHANNEL, "1")
    assert settings.fast_launch_mode() == "check" and settings.exact_int4() and settings.split_channel()
