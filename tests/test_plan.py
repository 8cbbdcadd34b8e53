"""Plans in the model config: round trip through save_pretrained / from_pretrained, applied per
layer, and a malformed plan failing at load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel

import hf_qattn
from hf_qattn import PlanError, QAttnPlan
from hf_qattn.integrations import transformers as integration
from hf_qattn.plan import PLAN_CONFIG_KEY

pytestmark = pytest.mark.usefixtures("seed")


@pytest.fixture
def ran_precisions(monkeypatch):
    """The qk precision of every quantized attention call, in call order (layer order in a forward)."""
    calls: list[str] = []
    real = integration.api.qattn

    def spy(*args, **kwargs):
        calls.append(kwargs["qk"])
        return real(*args, **kwargs)

    monkeypatch.setattr(integration.api, "qattn", spy)
    return calls


def run(model, length: int = 8):
    with torch.no_grad():
        return model(input_ids=torch.randint(3, 128, (1, length)))


def test_plan_round_trips_and_is_applied(tiny_model, tmp_path, ran_precisions, fresh_stats):
    model = tiny_model("llama", num_hidden_layers=3)
    plan = QAttnPlan(default="int4", layers={0: "int4", 1: "fp16", 2: "int8"}, num_layers=3, meta={"note": "test"})
    setattr(model.config, PLAN_CONFIG_KEY, plan.to_dict())
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[PLAN_CONFIG_KEY] == plan.to_dict()

    loaded = AutoModel.from_pretrained(tmp_path, attn_implementation="qattn")
    assert QAttnPlan.from_dict(getattr(loaded.config, PLAN_CONFIG_KEY)) == plan
    run(loaded)
    assert ran_precisions == ["int4", "int8"]  # layer 1 is fp16: full-precision SDPA, not the kernel
    stats = fresh_stats()
    assert stats["calls"] == {"reference": 2, "unquantized-by-plan": 1}
    assert stats["fallbacks"] == {}  # fp16 is a plan choice, not a fallback


def test_fp16_layer_matches_sdpa(tiny_model, fresh_stats):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    setattr(model.config, PLAN_CONFIG_KEY, QAttnPlan(default="fp16").to_dict())
    model.set_attn_implementation("qattn")
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref)
    assert fresh_stats()["calls"] == {"unquantized-by-plan": 2}


def test_no_plan_runs_int8(tiny_model, ran_precisions):
    model = tiny_model("llama", attn="qattn")
    assert getattr(model.config, PLAN_CONFIG_KEY, None) is None
    run(model)
    assert ran_precisions == [integration.DEFAULT_PRECISION] * 2 == ["int8", "int8"]


def test_plan_change_at_run_time_takes_effect(tiny_model, ran_precisions):
    model = tiny_model("llama", attn="qattn")
    setattr(model.config, PLAN_CONFIG_KEY, QAttnPlan(default="int4").to_dict())
    run(model)
    getattr(model.config, PLAN_CONFIG_KEY)["layers"]["1"] = "int8"  # edited in place: not a stale cache
    run(model)
    assert ran_precisions == ["int4", "int4", "int4", "int8"]


def test_plan_applies_to_models_without_layer_idx(tiny_model, ran_precisions):
    model = tiny_model("vit", attn="qattn")  # ViT's attention modules carry no layer_idx
    setattr(model.config, PLAN_CONFIG_KEY, QAttnPlan(layers={0: "int8", 1: "int4"}).to_dict())
    with torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 32, 32))
    assert ran_precisions == ["int8", "int4"]


def test_plan_object_in_config_is_stored_as_dict(tmp_path, ran_precisions):
    from transformers import LlamaConfig

    plan = QAttnPlan(layers={1: "int4"}, default="int8")
    config = LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=128, qattn_plan=plan)
    model = AutoModel.from_config(config, attn_implementation="qattn")
    assert getattr(model.config, PLAN_CONFIG_KEY) == plan.to_dict()  # JSON-ready, so save_pretrained works
    model.save_pretrained(tmp_path)
    run(AutoModel.from_pretrained(tmp_path, attn_implementation="qattn"))
    assert ran_precisions == ["int8", "int4"]


BAD_PLANS = [
    ({"version": 1, "default": "int3"}, "precision must be one of"),
    ({"version": 1, "layers": {"5": "int8"}}, r"index 5 out of range \[0, 2\)"),
    ({"version": 2, "default": "int4"}, "version must be 1"),
    ({"version": 1, "default": "int4", "num_layers": 12}, "made for another model"),
    ({"version": 1, "layerz": {}}, "unknown keys"),
    ("int8", "must be a dict"),
]


@pytest.mark.parametrize("bad, message", BAD_PLANS)
def test_bad_plan_fails_at_load(bad, message, tiny_model, tmp_path, monkeypatch):
    from hf_qattn.integrations.transformers import registration

    monkeypatch.setattr(registration, "_warned", set())
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[PLAN_CONFIG_KEY] = bad
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=message):
        AutoModel.from_pretrained(tmp_path, attn_implementation="qattn")
    # a model that does not run qattn never reads the plan: it loads, with a warning (issue 15, item 7)
    with pytest.warns(RuntimeWarning, match="config.qattn_plan is invalid"):
        AutoModel.from_pretrained(tmp_path)


def test_bad_plan_fails_at_construction():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=16, qattn_plan={"version": 1, "layers": {"2": "int8"}})
    with pytest.raises(PlanError, match=r"LlamaModel: config.qattn_plan is invalid.*index 2 out of range"):
        AutoModel.from_config(config, attn_implementation="qattn")


def test_plan_error_is_a_value_error():
    assert issubclass(hf_qattn.PlanError, ValueError)
