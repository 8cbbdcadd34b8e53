"""Only what pyproject.toml cannot say: the wheel ships ``hf_qattn-startup.pth`` at the top of
site-packages (see ``_hf_qattn_startup.py``). Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_PTH = "hf_qattn-startup.pth"


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # editable installs do not install .pth files
            self.copy_file(STARTUP_PTH, os.path.join(self.build_lib, STARTUP_PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, STARTUP_PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithStartupHook})
