"""WikiText-2 token windows for the CPU quality scripts (cache_accuracy.py and the calibration studies).

``DATA`` is the folder of the WikiText-2 raw splits (``valid.txt``, ``test.txt``); ``DEFAULT_MODEL`` the
SmolLM2-135M-Instruct folder that eval/smollm2_to_hf.py writes.
"""

from __future__ import annotations

import os

DEFAULT_MODEL = os.path.expanduser("~/.cache/hf_qattn/models/SmolLM2-135M-Instruct")
DATA = "/work/shared/data/wikitext2"


def windows(tokenizer, path: str, count: int, length: int, chars: int = 400_000):
    """``count`` windows of ``length`` tokens, spread evenly over the start of the file's token stream."""
    import torch

    with open(path, encoding="utf-8") as f:
        text = f.read(chars)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    need = count * length
    if ids.numel() < need:
        raise SystemExit(f"{path}: only {ids.numel()} tokens in the first {chars} characters; need {need}")
    stride = (ids.numel() - length) // max(count - 1, 1) if count > 1 else 0
    return torch.stack([ids[i * stride : i * stride + length] for i in range(count)])
