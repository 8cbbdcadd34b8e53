"""eval/kernel_variant.py: a kernel variant A/B'd on the device must be the kernel the timed process runs."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what a study script does first, then which decode module the launcher got
PROBE = """
import sys
sys.path.insert(0, {eval_dir!r})
import kernel_variant
kernel_variant.use_from_env()
from hf_qattn.kernels import decode_launch
import hf_qattn.kernels.decode as decode
print(decode.__file__)
print(decode_launch.decode_kernel.fn.__code__.co_filename)
print(getattr(decode, "VARIANT_MARK", None))
"""


def _probe(env_value):
    env = dict(os.environ)
    env.pop("KERNEL_VARIANT", None)
    if env_value is not None:
        env["KERNEL_VARIANT"] = env_value
    # from the checkout's root: where copying over "the installed decode.py" went wrong
    run = subprocess.run([sys.executable, "-c", PROBE.format(eval_dir=os.path.join(REPO, "eval"))], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    return run


def test_the_variant_is_what_the_launcher_runs(tmp_path):
    variant = tmp_path / "decode_variant.py"
    shutil.copy(os.path.join(REPO, "kernels", "decode.py"), variant)
    with open(variant, "a") as f:
        f.write("\nVARIANT_MARK = 'variant-7'\n")
    run = _probe(f"decode:{variant}")
    assert run.returncode == 0, run.stderr[-2000:]
    module_file, kernel_file, mark = run.stdout.split()[-3:]
    assert module_file == str(variant) and kernel_file == str(variant) and mark == "variant-7"

    plain = _probe(None)
    assert plain.returncode == 0, plain.stderr[-2000:]
    module_file, kernel_file, mark = plain.stdout.split()[-3:]
    assert os.path.basename(module_file) == "decode.py" and module_file != str(variant) and mark == "None"


def test_a_missing_variant_or_a_late_load_is_an_error(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "eval"))
    try:
        import kernel_variant
    finally:
        sys.path.pop(0)
    with pytest.raises(FileNotFoundError, match="no such file"):
        kernel_variant.use("nonexistent_module", str(tmp_path / "missing.py"))
    import hf_qattn.kernels.decode  # noqa: F401  (imported: too late for a variant)
    with pytest.raises(RuntimeError, match="already imported"):
        kernel_variant.use("decode", os.path.join(REPO, "kernels", "decode.py"))
