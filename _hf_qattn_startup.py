"""hf_qattn's startup hook: makes ``attn_implementation="qattn"`` known to transformers in every Python
process of an environment where hf-qattn is installed, without an ``import hf_qattn``.

The wheel installs ``hf_qattn-startup.pth`` at the top of site-packages; its one line imports this
module at interpreter start. That is what lets tools that never import hf_qattn themselves accept the
name, e.g. ``lm_eval --model hf --model_args pretrained=DIR,attn_implementation=qattn``.

At start-up this module only puts a meta-path finder on ``sys.meta_path`` (it imports nothing: no
torch, no transformers, no hf_qattn). The first time a process imports ``transformers.modeling_utils``
or ``transformers.masking_utils`` (what ``from_pretrained`` and ``AttentionInterface`` need; both import
torch anyway), the finder imports hf_qattn, whose own registration then completes as those modules
load, and removes itself. A process that never uses transformers' models never imports hf_qattn.

``HF_QATTN_NO_STARTUP_HOOK=1`` turns the hook off. Editable installs (``pip install -e``) do not install
``.pth`` files from the wheel: there, ``import hf_qattn`` or ``python -m hf_qattn.evaluation.lm_eval``.
A failure inside the hook is reported as a warning and never breaks transformers' own import.
"""

import os
import sys

TRIGGERS = frozenset({"transformers.modeling_utils", "transformers.masking_utils"})
DISABLE_ENV = "HF_QATTN_NO_STARTUP_HOOK"  # listed in hf_qattn.kernels.settings; read here, which imports nothing


class ImportHfQattnWithTransformers:
    """Meta-path finder: on the first import of a trigger module, import hf_qattn, then step aside."""

    busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRIGGERS or self.busy:
            return None
        self.busy = True
        try:
            uninstall()
            try:
                import hf_qattn  # noqa: F401  (registers "qattn" as transformers' modules load)
            except Exception as error:  # never break transformers' import
                import warnings

                warnings.warn(f"hf_qattn startup hook: import hf_qattn failed: {error!r}", RuntimeWarning,
                              stacklevel=2)
                return None
            # hf_qattn put its own finder on the meta path; let the meta path, as it is now, find the
            # module, so that finder sees this very import.
            for finder in list(sys.meta_path):
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None or finder is self:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    return spec
            return None
        finally:
            self.busy = False


_finder = ImportHfQattnWithTransformers()


def install() -> bool:
    """Put the finder on the meta path (what the .pth does). False when disabled or already done."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if "hf_qattn" in sys.modules or any(name in sys.modules for name in TRIGGERS):
        if "hf_qattn" not in sys.modules:  # transformers' models are already loaded: register now
            try:
                import hf_qattn  # noqa: F401
            except Exception:
                pass
        return False
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True


def uninstall() -> None:
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


install()
