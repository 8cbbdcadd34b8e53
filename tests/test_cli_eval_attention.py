"""``hf-qattn eval-attention``: per-layer accuracy of qattn on the Q, K, V a tiny random causal LM sees."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hf_qattn import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "eval"))
import tiny_causal_lm  # noqa: E402


def test_per_layer_table_and_json(tmp_path, capsys):
    model_dir, text_file = tiny_causal_lm.build(str(tmp_path / "tiny"))
    out = tmp_path / "out"
    assert cli.main(["eval-attention", model_dir, "--text", text_file, "--out", str(out), "--windows", "2",
                     "--tokens", "16"]) == 0
    record = json.loads((out / "attention-accuracy.json").read_text())
    assert set(record["layers"]) == {"qattn-8b", "qattn-4b"} and record["windows"] == 2
    for per_layer in record["layers"].values():
        assert set(per_layer) == {"0", "1"}  # the tiny model's two layers
        for windows in per_layer.values():
            assert len(windows) == 2
            # measured 0.9996-0.9998 on this model
            assert all(0.99 < w["cos_sim"] <= 1.0 + 1e-9 and 0 < w["rel_l1"] < 0.1 for w in windows)
    table = (out / "attention-accuracy.md").read_text()
    assert "| **all** |" in table and "qattn-8b CosSim avg" in table


def test_missing_text_is_one_line_error(tmp_path, capsys):
    model_dir, _ = tiny_causal_lm.build(str(tmp_path / "tiny"))
    capsys.readouterr()  # what building the model printed (transformers 5.17 shows a progress bar when saving it)
    assert cli.main(["eval-attention", model_dir, "--text", str(tmp_path / "none.txt"), "--out",
                     str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hf-qattn: error: --text: no such file: {tmp_path / 'none.txt'}"]
