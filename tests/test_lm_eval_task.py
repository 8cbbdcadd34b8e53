"""The local WikiText-style lm-eval task (eval/lm_eval_tasks) and lm-eval end to end through
``python -m hf_qattn.evaluation.lm_eval`` on a tiny random model. Skipped without lm-eval (pip install lm-eval);
CI also runs the plain ``lm_eval`` command against the installed wheel (.ci/run)."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(REPO, "eval", "lm_eval_tasks")
pytest.importorskip("lm_eval")
sys.path.insert(0, TASKS)
sys.path.insert(0, os.path.join(REPO, "eval"))
import textfile  # noqa: E402
import tiny_causal_lm  # noqa: E402


def test_documents_split_like_wikitext():
    text = (" \n = A = \n \n a b . \n = 1 x = \n formula line \n \n = = Section = = \n c d \n \n"
            " = B = \n \n e f . \n")
    docs = textfile.split_documents(text)
    assert len(docs) == 2  # a heading not between blank lines ("= 1 x =") or "= = Section = =" is no article
    assert docs[0].startswith(" \n = A =") and "formula line" in docs[0] and docs[1].startswith(" = B =")
    assert textfile.split_documents(text, "file") == [text]
    assert textfile.select(["aaa", "b", "cc"], 2) == ["b", "cc"]      # N shortest, in file order
    assert textfile.select(["aaa", "b", "cc"], "2,0") == ["cc", "aaa"]
    with pytest.raises(ValueError, match="split"):
        textfile.split_documents(text, "lines")


def test_metrics_are_lm_eval_wikitext():
    from lm_eval.tasks.wikitext import preprocess_wikitext

    assert textfile.process_results is preprocess_wikitext.process_results
    assert textfile.wikitext_detokenizer is preprocess_wikitext.wikitext_detokenizer
    data = textfile.load(text_file=os.path.join(REPO, "hf_qattn", "data", "sample.txt"), split="paragraph")
    assert list(data) == ["test"] and len(data["test"]) >= 1 and "page" in data["test"].column_names


def test_lm_eval_end_to_end_with_qattn(tmp_path):
    model_dir, text_file = tiny_causal_lm.build(str(tmp_path / "tiny"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_qattn.evaluation.lm_eval", "--model", "hf", "--model_args",
           f"pretrained={model_dir},attn_implementation=qattn,max_length=32", "--include_path", TASKS,
           "--tasks", "wikitext2_local", "--metadata", json.dumps({"text_file": text_file}),
           "--batch_size", "1", "--output_path", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    data = json.load(open(path))
    assert data["config"]["model_args"]["attn_implementation"] == "qattn"
    metrics = data["results"]["wikitext2_local"]
    for name in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(metrics[name]) and metrics[name] > 0, (name, metrics)
    assert data["n-samples"]["wikitext2_local"]["effective"] == 2  # the 2 documents of the text
