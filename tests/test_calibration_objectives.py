"""calibrate(objective=...): the registry, the end-to-end "logit-kl" objective and the CLI flag."""

from __future__ import annotations

import pytest
import torch

from hf_qattn import QAttnPlan, calibrate, cli
from hf_qattn.integrations.transformers import attention
from hf_qattn.integrations.transformers import calibration
from hf_qattn.plan import PLAN_CONFIG_KEY

pytestmark = pytest.mark.usefixtures("seed")


def token_batches(count: int, batch: int = 2, length: int = 12):
    return [{"input_ids": torch.randint(3, 128, (batch, length))} for _ in range(count)]


def test_objective_registry():
    assert set(calibration.OBJECTIVES) == {"attention", "logit-kl", "logit-kl-gain"}
    assert calibration.DEFAULT_OBJECTIVE == "attention"
    for run, cost in calibration.OBJECTIVES.values():
        assert callable(run) and "forward" in cost


def test_unknown_objective_names_the_choices(tiny_model):
    model = tiny_model("llama", head="lm")
    with pytest.raises(ValueError, match=r"objective must be one of \['attention', 'logit-kl', 'logit-kl-gain'\]; got 'nope'"):
        calibrate(model, token_batches(1), objective="nope", progress=False)


def test_logit_kl_costs_layers_plus_one_forwards_and_ranks_by_kl(tiny_model):
    model = tiny_model("llama", head="lm", num_hidden_layers=4)
    result = calibrate(model, token_batches(2), ratio=0.5, objective="logit-kl", progress=False)
    plan, scores = result
    assert result.objective == "logit-kl" and result.forwards == 2 * (4 + 1)
    assert sorted(scores) == [0, 1, 2, 3]
    for s in scores.values():
        assert isinstance(s, calibration.Sensitivity)
        assert s.mean >= 0.0 and s.worst >= s.mean - 1e-9 and s.count == 4 and s.tokens == 4 * 12
    largest = sorted(scores, key=lambda layer: -scores[layer].mean)[:2]
    assert {layer for layer in scores if plan.precision(layer) == "int8"} == set(largest)
    assert getattr(model.config, PLAN_CONFIG_KEY) == plan.to_dict()
    assert plan.meta["objective"] == "logit-kl" and plan.meta["forwards"] == 10
    assert model.config._attn_implementation == "sdpa" and not model.training  # restored
    assert result.to_dict()["metric"] == calibration.KL_METRIC


@pytest.mark.parametrize("objective", ["logit-kl", "logit-kl-gain"])
def test_logit_kl_promotes_the_layer_whose_int4_is_harmful(objective, tiny_model, monkeypatch):
    model = tiny_model("llama", head="lm", num_hidden_layers=4)
    real = attention.api.qattn
    fragile = 2

    def harmful_at_fragile_layer(q, k, v, **kwargs):
        out = real(q, k, v, **kwargs)
        plan = getattr(model.config, PLAN_CONFIG_KEY)  # the probe's plan
        if plan.precision(fragile) == "int4":
            out = out + 5.0 * torch.randn_like(out)
        return out

    monkeypatch.setattr(attention.api, "qattn", harmful_at_fragile_layer)
    plan, scores = calibrate(model, token_batches(2), ratio=0.25, objective=objective, progress=False)
    assert max(scores, key=lambda layer: scores[layer].mean) == fragile
    assert [layer for layer in range(4) if plan.precision(layer) == "int8"] == [fragile]


def test_logit_kl_counts_real_tokens_only_and_ignores_an_existing_plan(tiny_model):
    model = tiny_model("llama", head="lm", num_hidden_layers=2)
    ids = torch.randint(3, 128, (1, 10))
    alone = calibrate(model, {"input_ids": ids}, objective="logit-kl", progress=False).scores
    setattr(model.config, PLAN_CONFIG_KEY, QAttnPlan(default="int8").to_dict())  # replaced, never used by a probe
    again = calibrate(model, {"input_ids": ids}, objective="logit-kl", progress=False).scores
    assert {layer: s.mean for layer, s in again.items()} == pytest.approx({layer: s.mean for layer, s in alone.items()})
    # padded tokens are not counted (their values are not compared: the 4-bit kernel's per-block
    # quantization sees the padded rows of the batch, so a padded sequence's KL differs slightly)
    padded = {"input_ids": torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1),
              "attention_mask": torch.cat([torch.ones(1, 10, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], 1)}
    for s in calibrate(model, padded, objective="logit-kl", progress=False).scores.values():
        assert s.tokens == 10 and s.count == 1 and s.mean >= 0.0


def test_logit_kl_gain_costs_layers_plus_two_forwards(tiny_model):
    model = tiny_model("llama", head="lm", num_hidden_layers=3)
    result = calibrate(model, token_batches(1), ratio=0.34, objective="logit-kl-gain", progress=False)
    assert result.forwards == 3 + 2 and result.plan.count()["int8"] == 1
    assert result.to_dict()["metric"] == calibration.KL_GAIN_METRIC
    assert model.config._attn_implementation == "sdpa"


def test_logit_kl_needs_logits(tiny_model):
    with pytest.raises(ValueError, match="needs a model whose output has logits"):
        calibrate(tiny_model("bert"), token_batches(1), objective="logit-kl", progress=False)


def test_logit_kl_progress_line(tiny_model, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)  # no tqdm: the plain stderr line
    calibrate(tiny_model("llama", head="lm", num_hidden_layers=2), token_batches(2), objective="logit-kl")
    assert "logit-kl: L+1 forwards per batch): 6/6" in capsys.readouterr().err


def test_cli_objective_flag(tmp_path, capsys):
    parse = cli.build_parser().parse_args
    base = ["calibrate", str(tmp_path), "--text", "t", "--out", "o"]
    assert parse(base).objective == "attention"
    assert parse(base + ["--objective", "logit-kl"]).objective == "logit-kl"
    with pytest.raises(SystemExit) as exit_info:
        parse(base + ["--objective", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
