"""Shipped data files: kernel tile tables (kernels.json). Installed as ``hf_qattn.configs``."""
