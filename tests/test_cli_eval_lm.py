"""``hf-qattn eval-lm``: lm-eval once per attention mode on a tiny random causal LM and a 2-document
local task (eval/lm_eval_tasks). Skipped without lm-eval."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from hf_qattn import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("lm_eval")
sys.path.insert(0, os.path.join(REPO, "eval"))
import tiny_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_causal_lm.build(str(tmp_path_factory.mktemp("tiny")))


def _run(model_dir, text_file, out, modes, *extra):
    return cli.main(["eval-lm", model_dir, "--tasks", "wikitext2_local", "--include-path",
                     os.path.join(REPO, "eval", "lm_eval_tasks"), "--metadata", json.dumps({"text_file": text_file}),
                     "--modes", modes, "--max-length", "32", "--out", str(out), *extra])


def test_modes_side_by_side(tiny, tmp_path, capsys):
    model_dir, text_file = tiny
    assert _run(model_dir, text_file, tmp_path / "out", "sdpa,sdpa,int8") == 0
    record = json.loads((tmp_path / "out" / "eval-lm.json").read_text())
    assert record["modes"] == ["sdpa", "sdpa#2", "int8"] and record["versions"]["lm_eval"]
    rows = {row["metric"]: row for row in record["rows"]}
    assert set(rows) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    for row in rows.values():
        assert row["sdpa#2 Δ%"] == 0.0  # the same mode twice: exactly the same numbers
        assert math.isfinite(row["int8"]) and row["int8"] > 0 and math.isfinite(row["int8 Δ%"])
    # the int8 run went through qattn (reference path on the CPU), the sdpa runs did not
    assert record["calls"]["int8"]["calls"] and not record["calls"]["int8"]["fallbacks"]
    assert record["calls"]["sdpa"]["calls"] == {}
    table = (tmp_path / "out" / "eval-lm.md").read_text()
    assert "| task | metric | sdpa | sdpa#2 | int8 | sdpa#2 Δ% | int8 Δ% |" in table


def test_plan_mode_without_a_plan_is_one_line_error(tiny, tmp_path, capsys):
    model_dir, text_file = tiny
    assert _run(model_dir, text_file, tmp_path / "out", "sdpa,plan") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-qattn: error: mode 'plan' needs a plan")
    assert not (tmp_path / "out" / "eval-lm.json").exists()


def test_bad_modes_are_an_argument_error(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval-lm", tiny[0], "--tasks", "x", "--modes", "sdpa,fp8", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "modes must be a comma-separated list of sdpa, int8, int4, plan" in capsys.readouterr().err
