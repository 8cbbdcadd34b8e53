"""Issue 24, part 4: the command line and the README as a new user meets them. Each test failed on the code
the issue was written against (the item it covers is named); errors are one ``hf-qattn: error:`` line, found
before any model loads, and nothing is silently wrong."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

from hf_qattn import QAttnPlan, cli
from hf_qattn.plan import PLAN_CONFIG_KEY

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
sys.path.insert(0, str(REPO / "eval"))
import tiny_causal_lm  # noqa: E402
from test_cli_errors import one_error_line  # noqa: E402  (the CLI error check, one place)

BAD_PLAN = {"version": 1, "default": "int5"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder with a tokenizer, a 2-document text in WikiText's layout)."""
    model_dir, text_file = tiny_causal_lm.build(str(tmp_path_factory.mktemp("tiny")))
    return Path(model_dir), Path(text_file)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load model weights fails the test: the error must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("model weights were loaded before the arguments were checked")

    for name in ("AutoModelForCausalLM", "AutoModel", "LlamaForCausalLM", "BertModel"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)


def with_config_plan(source: Path, target: Path, plan) -> Path:
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config[PLAN_CONFIG_KEY] = plan
    (target / "config.json").write_text(json.dumps(config))
    return target


# --- item 1: the README's eval-lm command on a fresh clone (no shared WikiText-2) ------------------------
def test_eval_lm_without_its_text_file_is_one_line_before_the_model_loads(tiny, tmp_path, monkeypatch, capsys,
                                                                          no_model_loading):
    """Was: a FileNotFoundError traceback from inside lm-eval, after the model had loaded."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_QATTN_WIKITEXT2", str(tmp_path / "no-wikitext"))
    status = cli.main(["eval-lm", str(tiny[0]), "--tasks", "wikitext2_local", "--include-path",
                       str(REPO / "eval" / "lm_eval_tasks"), "--modes", "sdpa", "--out", str(tmp_path / "out")])
    assert status == 1
    one_error_line(capsys, "--tasks wikitext2_local", str(tmp_path / "no-wikitext" / "test.txt"),
                   "--metadata '{\"text_file\": \"FILE\"}'")
    assert not (tmp_path / "out").exists()


def test_readme_eval_commands_name_their_text_file():
    for command in re.findall(r"hf-qattn eval-lm [^`]*--tasks wikitext2_local[^`]*", README):
        assert "--metadata" in command and "text_file" in command, command
    lm_eval = README[README.index("lm_eval --model hf"):]
    assert "text_file" in lm_eval[:lm_eval.index("```")]


# --- item 2: eval-attention on a text shorter than --windows × 2 × --tokens words ------------------------
def test_eval_attention_on_a_short_text_uses_equal_shorter_windows(tiny, tmp_path, capsys):
    """Was: RuntimeError 'cannot reshape tensor of 0 elements' (the second window was empty)."""
    words = (tiny[1].read_text().split() * 20)[:348]
    text = tmp_path / "short.txt"
    text.write_text(" ".join(words) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert cli.main(["eval-attention", str(tiny[0]), "--text", str(text), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "holds 348 words, so each of the 2 windows takes 174 of them" in printed  # said, not silent
    record = json.loads((out / "attention-accuracy.json").read_text())
    assert record["windows"] == 2
    assert all(len(windows) == 2 for per_layer in record["layers"].values() for windows in per_layer.values())

    text.write_text("one\n", encoding="utf-8")
    assert cli.main(["eval-attention", str(tiny[0]), "--text", str(text), "--out", str(out)]) == 1
    one_error_line(capsys, "--windows 2", "only 1 word(s)")


# --- item 3: tracebacks instead of one line ---------------------------------------------------------------
def test_eval_lm_unknown_task_is_one_line_before_the_model_loads(tiny, tmp_path, capsys, no_model_loading):
    """Was: a 24-line KeyError traceback, after the model had loaded."""
    pytest.importorskip("lm_eval")
    assert cli.main(["eval-lm", str(tiny[0]), "--tasks", "no_such_task", "--modes", "sdpa",
                     "--out", str(tmp_path / "out")]) == 1
    one_error_line(capsys, "--tasks no_such_task", "'no_such_task' is not a registered task", "--include-path")


def test_calibrate_replaces_a_malformed_plan_in_the_source_config(tiny, tmp_path, capsys):
    """Was: PlanError traceback (the model refused the plan that calibration was about to replace)."""
    model_dir = with_config_plan(tiny[0], tmp_path / "bad", BAD_PLAN)
    out = tmp_path / "out"
    assert cli.main(["calibrate", str(model_dir), "--text", str(tiny[1]), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"note: {model_dir / 'config.json'} held an invalid qattn_plan" in printed and "int5" in printed
    plan = QAttnPlan.from_dict(json.loads((out / "config.json").read_text())[PLAN_CONFIG_KEY], num_layers=2)
    assert plan.count()["int8"] == 1


def test_eval_lm_bad_plan_is_one_line_before_the_model_loads(tiny, tmp_path, capsys, no_model_loading):
    """Was: PlanError traceback (--modes plan with a malformed config plan); a --plan file for a model with
    fewer layers failed only at the switch to mode 'plan', after the other modes had run."""
    pytest.importorskip("lm_eval")
    model_dir = with_config_plan(tiny[0], tmp_path / "bad", BAD_PLAN)
    common = ["--tasks", "x", "--out", str(tmp_path / "out")]
    assert cli.main(["eval-lm", str(model_dir), "--modes", "sdpa,plan", *common]) == 1
    one_error_line(capsys, f"MODEL_DIR {model_dir}: config.json's qattn_plan is invalid", "int5",
                   "re-run hf-qattn calibrate, or pass --plan FILE")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"version": 1, "layers": {"5": "int8"}}))
    assert cli.main(["eval-lm", str(tiny[0]), "--modes", "sdpa,plan", "--plan", str(plan_file), *common]) == 1
    one_error_line(capsys, f"--plan {plan_file} is invalid", "5")
    assert cli.main(["eval-lm", str(tiny[0]), "--modes", "sdpa", "--plan", str(plan_file), *common]) == 1
    one_error_line(capsys, "--plan", "only mode 'plan' uses it")  # was: ignored without a word


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_calibrate_out_that_cannot_be_created_fails_first(tiny, capsys, no_model_loading):
    """Was: FileNotFoundError at mkdir, after the whole calibration (as root, os.access says /proc is writable)."""
    assert cli.main(["calibrate", str(tiny[0]), "--text", str(tiny[1]), "--out", "/proc/hf-qattn-test/x"]) == 1
    one_error_line(capsys, "--out: cannot create /proc/hf-qattn-test/x")


def test_out_check_writes_for_real_and_leaves_nothing_behind(tmp_path, monkeypatch):
    from hf_qattn.cli import args

    out = tmp_path / "a" / "b"
    args.check_out_dir(out)
    assert not (tmp_path / "a").exists()  # the folders made for the probe are gone again

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(args.tempfile, "TemporaryFile", read_only)
    with pytest.raises(cli.CLIError, match=r"--out: cannot write into .*b: Permission denied"):
        args.check_out_dir(out)
    assert not (tmp_path / "a").exists()


# --- item 5 (README half): the prefill snippet runs qattn ------------------------------------------------
def test_readme_prefill_runs_under_no_grad(tiny, fresh_stats):
    """Was: the snippet's prefill ran without torch.no_grad(): a freshly loaded model's weights require grad,
    so every call went to SDPA (counted as a fallback), with a warning about autograd."""
    import torch
    from transformers import AutoModelForCausalLM

    block = README[README.index("cache = hf_qattn.QAttnCache(model, static_max_len"):]
    prefill = block[:block.index("step = hf_qattn.CapturedDecodeStep")].splitlines()
    assert prefill[1].startswith("with torch.no_grad():") and prefill[2].startswith("    logits = model(ids")

    model = AutoModelForCausalLM.from_pretrained(tiny[0], attn_implementation="qattn")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids)
    assert fresh_stats()["fallbacks"]  # why the README needs it
    import hf_qattn

    hf_qattn.reset_fallback_stats()
    with torch.no_grad():
        model(ids)
    assert not fresh_stats()["fallbacks"] and fresh_stats()["calls"]


# --- item 6: end-to-end objectives' scores and the layer axis ------------------------------------------
def test_small_scores_are_printed_with_their_digits():
    """Was: 0.0000 for every layer of an end-to-end objective (their values are ~1e-6 on small models)."""
    table = cli.format_table(["layer", "mean", "worst"], [[0, 2.641e-06, 3.4e-06], [1, 1.341e-06, 2.364e-06]])
    assert "2.641e-06" in table and "1.341e-06" in table and "0.0000" not in table
    table = cli.format_table(["layer", "mean"], [[0, 0.99876], [1, 0.9]])
    assert "0.9988" in table and "0.9000" in table  # attention scores keep 4 decimals


def test_calibrate_logit_kl_prints_distinct_scores(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["calibrate", str(tiny[0]), "--text", str(tiny[1]), "--out", str(out), "--objective",
                     "logit-kl", "--no-progress"]) == 0
    rows = re.findall(r"^([01])\s+(\S+)\s+(\S+)\s+4\s+int[48]$", capsys.readouterr().out, re.M)
    scores = json.loads((out / "scores.json").read_text())["layers"]
    assert len(rows) == 2
    for layer, mean, worst in rows:
        assert float(mean) == pytest.approx(scores[layer]["mean"], rel=1e-3) and float(mean) > 0


def test_layer_axis_ticks_are_layers():
    """Was: 0.0 / 0.5 / 1.0 under a two-layer plot."""
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace

    from hf_qattn.calibration.plots import layer_scores_figure, layer_sensitivity_figure

    scores = {0: SimpleNamespace(mean=2.6e-6, worst=3.4e-6), 1: SimpleNamespace(mean=1.3e-6, worst=2.4e-6)}
    result = SimpleNamespace(scores=scores, plan=QAttnPlan(default="int4", layers={0: "int8"}))
    for figure in (layer_sensitivity_figure(result, "t", "label"), layer_scores_figure(result, "t")):
        ax = figure.axes[0]
        figure.canvas.draw()
        assert list(ax.get_xticks()) == [0, 1]
        assert [label.get_text() for label in ax.get_xticklabels()] == ["0", "1"]


# --- item 7: --out equal to the source folder --------------------------------------------------------------
def test_out_equal_to_the_source_folder_is_refused_first(tiny, tmp_path, capsys, no_model_loading):
    """Was: calibrate overwrote the model folder in place without a word."""
    before = (tiny[0] / "config.json").read_text()
    for out in (str(tiny[0]), str(tiny[0]) + "/", os.path.relpath(tiny[0])):
        assert cli.main(["calibrate", str(tiny[0]), "--text", str(tiny[1]), "--out", out]) == 1
        one_error_line(capsys, "--out", "is MODEL_DIR itself", "overwritten in place")
    assert (tiny[0] / "config.json").read_text() == before
    assert cli.main(["demo", "--model", str(tiny[0]), "--out", str(tiny[0])]) == 1
    one_error_line(capsys, "--out", "is the model folder itself")
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text("{}")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    assert cli.main(["calibrate-pipeline", str(pipe), "--prompts", str(prompts), "--out", str(pipe)]) == 1
    one_error_line(capsys, "--out", "is PIPELINE_DIR itself")


# --- item 8: the README against the behaviour -------------------------------------------------------------
def test_readme_says_what_calibrate_writes():
    """Was: 'a PNG per layer'; calibrate writes one scores.png."""
    assert "a PNG per layer" not in README and "`scores.png` (one plot" in README


def test_malformed_plan_warns_once_for_a_causal_lm(tiny, tmp_path, monkeypatch):
    """Was: twice, once for LlamaModel and once for the LlamaForCausalLM around it (same config)."""
    from transformers import AutoModelForCausalLM

    from hf_qattn.integrations.transformers import registration

    monkeypatch.setattr(registration, "_warned", set())
    model_dir = with_config_plan(tiny[0], tmp_path / "bad", BAD_PLAN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(model_dir)
    plan_warnings = [w for w in caught if "qattn_plan is invalid" in str(w.message)]
    assert len(plan_warnings) == 1, [str(w.message) for w in plan_warnings]
    assert "warn once" in README or "warns once" in README


def test_invalid_config_json_is_reported_as_such(tiny, tmp_path, capsys):
    """Was: 'has no loadable tokenizer' for a config.json that is not JSON."""
    import shutil

    model_dir = tmp_path / "broken"
    shutil.copytree(tiny[0], model_dir)
    (model_dir / "config.json").write_text("{not json")
    for command in (["calibrate", str(model_dir), "--text", str(tiny[1])],
                    ["eval-attention", str(model_dir), "--text", str(tiny[1])]):
        assert cli.main([*command, "--out", str(tmp_path / "out")]) == 1
        line = one_error_line(capsys, f"MODEL_DIR {model_dir}: config.json does not load")
        assert "tokenizer" not in line


# --- item 9: --help -------------------------------------------------------------------------------------------
def test_every_option_is_explained_in_plain_text():
    """Was: eval-lm's --batch-size and --seed had no help; eval-attention's description showed Sphinx markup."""
    import argparse

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        assert "``" not in text and not re.search(r":(mod|func|class|meth):", text), (name, text)
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"


# --- item 10: package metadata -----------------------------------------------------------------------------
def test_project_metadata_names_license_and_urls():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # PEP 639: License-Expression, which pip show prints since 25.0
    assert project["urls"] and all(url.startswith("https://") for url in project["urls"].values())


# --- "What to build" 3: the end-to-end objective by default for a causal LM ---------------------------------
def test_calibrate_command_defaults_to_ppl_gain_for_a_causal_lm(tiny, tmp_path, capsys):
    """Was: the default objective was attention for every model (a weaker plan for a causal LM)."""
    out = tmp_path / "out"
    assert cli.main(["calibrate", str(tiny[0]), "--text", str(tiny[1]), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "objective: ppl-gain (auto: LlamaForCausalLM is a causal LM" in printed
    assert "ppl-gain: per layer, how much the next-token NLL" in printed
    scores = json.loads((out / "scores.json").read_text())
    assert scores["objective"] == "ppl-gain" and scores["chosen_by"].startswith("auto: LlamaForCausalLM")
    assert scores["forwards"] == 2 + 2  # one batch of 4 lines: L + 2 forwards
    plan = json.loads((out / "config.json").read_text())[PLAN_CONFIG_KEY]
    assert plan["meta"]["objective"] == "ppl-gain" and plan["meta"]["chosen_by"].startswith("auto:")


def test_auto_objective_keeps_attention_for_other_models(tiny_model):
    import torch

    from hf_qattn import calibrate
    from hf_qattn.integrations.transformers.calibration import choose_objective

    ids = torch.randint(3, 128, (2, 8))
    for model in (tiny_model("bert"), tiny_model("llama")):  # an encoder; a decoder without its LM head
        result = calibrate(model, [{"input_ids": ids}], objective="auto", progress=False)
        assert result.objective == "attention" and "is not a causal LM" in result.chosen_by
    causal = tiny_model("llama", head="lm")
    assert choose_objective(causal, [{"input_ids": ids}])[0] == "ppl-gain"
    assert choose_objective(causal, [{"input_ids": ids[:, :1]}])[0] == "attention"  # no next token to predict
    with pytest.raises(ValueError, match=r"got 'nope' \(or 'auto'"):
        calibrate(causal, [{"input_ids": ids}], objective="nope", progress=False)
