"""calibrate(objective=...): the registry, the end-to-end "logit-kl" and "ppl-gain" objectives and the CLI flag."""

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
    assert set(calibration.OBJECTIVES) == {"attention", "logit-kl", "logit-kl-gain", "ppl-gain"}
    assert calibration.DEFAULT_OBJECTIVE == "attention"
    for run, cost in calibration.OBJECTIVES.values():
        assert callable(run) and "forward" in cost


def test_unknown_objective_names_the_choices(tiny_model):
    model = tiny_model("llama", head="lm")
    with pytest.raises(ValueError, match=r"objective must be one of \['attention', 'logit-kl', 'logit-kl-gain', 'ppl-gain'\]; got 'nope'"):
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
    assert parse(base).objective == "auto"  # issue 24: ppl-gain for a causal LM, attention otherwise
    assert parse(base + ["--objective", "attention"]).objective == "attention"
    assert parse(base + ["--objective", "logit-kl"]).objective == "logit-kl"
    assert parse(base + ["--objective", "ppl-gain"]).objective == "ppl-gain"
    with pytest.raises(SystemExit) as exit_info:
        parse(base + ["--objective", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


# ---- ppl-gain


def fragile_llama(tiny_model, fragile: int = 2, layers: int = 4):
    """A tiny Llama whose layer ``fragile`` int4 really hurts, through its weights alone: channels 0 and 1 of
    every head have no part in the attention scores (their q_proj rows are zero) but are 100x outliers in K,
    so they set K's int4 quantization scales and the channels that do score are rounded away; sharp attention
    (q scaled up) and a larger o_proj carry that layer's error to the logits. A sharper lm_head makes the
    next-token distributions far from uniform."""
    model = tiny_model("llama", head="lm", num_hidden_layers=layers)
    head_dim = model.config.head_dim
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        attn = model.model.layers[fragile].self_attn
        attn.q_proj.weight.mul_(50.0)
        for channel in (0, 1):
            attn.q_proj.weight[channel::head_dim] = 0.0
            attn.k_proj.weight[channel::head_dim].mul_(100.0)
        attn.o_proj.weight.mul_(4.0)
    return model


def sampled_text(model, sequences: int = 24, length: int = 16, temperature: float = 0.5) -> torch.Tensor:
    """Token ids sampled from the full-precision model itself, the text it predicts well, so an int4 error shows
    up as a higher NLL (at temperature 1 a probe's expected NLL excess would be its KL from full precision; 0.5
    keeps to likelier tokens, whose NLL an error raises more reliably: less noise from so few tokens)."""
    start = torch.randint(3, model.config.vocab_size, (sequences, 1))
    with torch.no_grad():
        return model.generate(start, do_sample=True, top_k=0, temperature=temperature, max_new_tokens=length - 1,
                              min_new_tokens=length - 1, pad_token_id=0)


def test_ppl_gain_promotes_the_layer_whose_int4_hurts_through_its_weights(tiny_model):
    model = fragile_llama(tiny_model)
    ids = sampled_text(model)
    assert ids.shape == (24, 16)
    result = calibrate(model, {"input_ids": ids}, ratio=0.25, objective="ppl-gain", progress=False)
    plan, scores = result
    assert [layer for layer in range(4) if plan.precision(layer) == "int8"] == [2]
    gains = {layer: s.mean for layer, s in scores.items()}
    assert max(gains, key=gains.get) == 2 and gains[2] > 0.01  # nats per token; the others' gains are noise
    # the numbers the scores carry
    with torch.no_grad():
        full = float(model(input_ids=ids, labels=ids).loss)  # the model's own mean next-token NLL
    for layer, s in scores.items():
        assert isinstance(s, calibration.PerplexityGain) and isinstance(s, calibration.Sensitivity)
        assert s.tokens == 24 * 15 and s.count == 24
        assert s.nll_full == pytest.approx(full, abs=1e-4)
        assert s.nll_int4 == scores[0].nll_int4 > s.nll_full  # the same all-int4 baseline for every layer
        assert s.recovery == pytest.approx(s.mean / (s.nll_int4 - s.nll_full))
        assert s.worst >= s.mean - 1e-9
    assert scores[2].recovery > 0.5  # promoting it alone buys back most of what int4 cost
    assert result.objective == "ppl-gain" and result.forwards == 4 + 2 and result.seconds > 0
    body = result.to_dict()
    assert body["metric"] == calibration.PPL_GAIN_METRIC and body["layers"]["2"]["nll_full"] == pytest.approx(full, abs=1e-4)
    assert plan.meta["objective"] == "ppl-gain" and plan.meta["forwards"] == 6
    assert plan.meta["nll_int4"] == pytest.approx(scores[0].nll_int4, abs=1e-5)
    assert getattr(model.config, PLAN_CONFIG_KEY) == plan.to_dict()
    assert model.config._attn_implementation == "sdpa" and not model.training  # restored


def test_ppl_gain_labels_are_the_next_real_tokens(tiny_model):
    """Padding is excluded through the attention mask: a padded batch counts (real tokens - 1) positions per
    sequence, and its full-precision NLL is the model's own loss on the sequences unpadded."""
    model = tiny_model("llama", head="lm", num_hidden_layers=2)
    long, short = torch.randint(3, 128, (1, 14)), torch.randint(3, 128, (1, 9))
    padded = {"input_ids": torch.cat([long, torch.cat([short, torch.zeros(1, 5, dtype=torch.long)], 1)]),
              "attention_mask": torch.cat([torch.ones(1, 14, dtype=torch.long),
                                           torch.cat([torch.ones(1, 9), torch.zeros(1, 5)], 1).long()])}
    scores = calibrate(model, padded, objective="ppl-gain", progress=False).scores
    with torch.no_grad():
        nll = sum(float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1) for ids in (long, short))
    for s in scores.values():
        assert s.tokens == 13 + 8 and s.count == 2
        assert s.nll_full == pytest.approx(nll / 21, abs=1e-4)


def test_ppl_gain_needs_a_causal_lm_with_input_ids(tiny_model):
    with pytest.raises(ValueError, match="objective 'ppl-gain' needs a model whose output has logits"):
        calibrate(tiny_model("bert"), token_batches(1), objective="ppl-gain", progress=False)
    model = tiny_model("llama", head="lm")
    embeds = model.get_input_embeddings()(torch.randint(3, 128, (1, 8))).detach()
    with pytest.raises(ValueError, match="objective 'ppl-gain' needs input_ids"):
        calibrate(model, {"inputs_embeds": embeds}, objective="ppl-gain", progress=False)
    with pytest.raises(ValueError, match="objective 'ppl-gain' needs inputs of at least 2 tokens"):
        calibrate(model, {"input_ids": torch.tensor([[5]])}, objective="ppl-gain", progress=False)
