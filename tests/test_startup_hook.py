"""The startup hook (_hf_qattn_startup, imported by the wheel's hf_qattn-startup.pth) and
``python -m hf_qattn.evaluation.lm_eval``. Each case runs a fresh interpreter: the hook acts at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def site_dir(tmp_path):
    """A site directory holding the two files the wheel puts at the top of site-packages."""
    for name in ("_hf_qattn_startup.py", "hf_qattn-startup.pth"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    return str(tmp_path)


def run(code: str, site_dir: str, **env) -> subprocess.CompletedProcess:
    # site.addsitedir processes the .pth exactly as interpreter start-up does for site-packages.
    prelude = f"import site, sys\nsite.addsitedir({site_dir!r})\n"
    environment = {k: v for k, v in os.environ.items() if k != "HF_QATTN_NO_STARTUP_HOOK"} | env
    result = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=120, env=environment, cwd=site_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_wheel_files_are_in_the_repository():
    with open(os.path.join(REPO, "hf_qattn-startup.pth")) as f:
        assert f.read().strip() == "import _hf_qattn_startup"
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        assert '"_hf_qattn_startup"' in f.read()  # py-modules: the hook module ships in the wheel


def test_hook_is_lazy_then_registers_qattn(site_dir):
    out = run("""
        import _hf_qattn_startup as hook
        heavy = [m for m in ("torch", "transformers", "hf_qattn") if m in sys.modules]
        assert not heavy, heavy                          # start-up imports nothing heavy
        assert hook._finder in sys.meta_path
        import transformers
        assert "hf_qattn" not in sys.modules             # a bare `import transformers` stays as it was
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        assert "qattn" in AttentionInterface._global_mapping
        assert "qattn" in AttentionMaskInterface._global_mapping
        assert "hf_qattn" in sys.modules and hook._finder not in sys.meta_path
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64)
        model = LlamaForCausalLM._from_config(config, attn_implementation="qattn")
        assert model.config._attn_implementation == "qattn"
        print("ok")
    """, site_dir)
    assert out.stdout.strip().endswith("ok")


def test_hook_can_be_turned_off(site_dir):
    run("""
        import _hf_qattn_startup as hook
        assert hook._finder not in sys.meta_path and not hook.install()
    """, site_dir, HF_QATTN_NO_STARTUP_HOOK="1")


def test_hook_when_transformers_is_loaded_first(site_dir):
    code = """
        import transformers.modeling_utils, _hf_qattn_startup as hook
        assert not hook.install()     # too late for the finder: imports hf_qattn at once instead
        from transformers import AttentionInterface
        assert "qattn" in AttentionInterface._global_mapping
    """
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {site_dir!r})\n" + textwrap.dedent(code)],
                   check=True, timeout=120)


def test_module_runner_without_lm_eval():
    code = "import sys; sys.modules['lm_eval'] = None\nfrom hf_qattn.evaluation.lm_eval import main\nmain(['--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "pip install" in result.stderr and "lm-eval" in result.stderr and "Traceback" not in result.stderr
