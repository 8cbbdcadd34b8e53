"""QAttnPlan rejects what it cannot hold faithfully (issue 15, item 6): aliased or non-integer index keys,
badly typed counts, NaN scores. Each case was accepted before and answered wrongly later."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hf_qattn import PlanError, QAttnPlan


def test_aliased_layer_keys_are_rejected():
    """Was: {"1": int8, "01": int4} accepted, and layer 1 ran the second."""
    data = {"version": 1, "layers": {"1": "int8", "01": "int4"}}
    with pytest.raises(PlanError, match=r"qattn_plan.layers.*'01'"):
        QAttnPlan.from_dict(data)
    with pytest.raises(PlanError, match=r"index 1 is given twice \(keys 1 and '1'\)"):
        QAttnPlan(layers={1: "int8", "1": "int4"})
    with pytest.raises(PlanError, match=r"qattn_plan.steps\[0\]: index 2 is given twice"):
        QAttnPlan(steps={0: {"2": "int8", 2: "int4"}})
    with pytest.raises(PlanError, match=r"qattn_plan.steps: index 0 is given twice"):
        QAttnPlan(steps={"0": {}, 0: {}})


@pytest.mark.parametrize("key", [1.7, 1.0, "1.0", " 1", "+1", "0x1", True, None])
def test_non_integer_keys_are_rejected(key):
    """Was: a float key 1.7 validated (as layer 1) but did not round-trip through to_dict/from_dict."""
    with pytest.raises(PlanError, match="index must be an integer"):
        QAttnPlan(layers={key: "int8"})
    with pytest.raises(PlanError, match="index must be an integer"):
        QAttnPlan(steps={0: {key: "int8"}})


def test_canonical_keys_become_ints_and_round_trip():
    plan = QAttnPlan(layers={"3": "int4", np.int64(4): "int8"}, steps={"1": {"0": "fp16"}}, num_layers=6,
                     num_steps=np.int32(2))
    assert plan.layers == {3: "int4", 4: "int8"} and plan.steps == {1: {0: "unquantized"}}
    assert plan.precision(3) == "int4" and plan.precision(0, step=1) == "unquantized"  # string keys are looked up
    again = QAttnPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and type(again.num_steps) is int


@pytest.mark.parametrize("field", ["num_layers", "num_steps"])
@pytest.mark.parametrize("value", [-3, 0, "6", True, 6.0, [6]])
def test_counts_are_checked_in_the_constructor(field, value):
    """Was: num_layers of -3, "6" or true accepted by the constructor, failing later."""
    with pytest.raises(PlanError, match=f"qattn_plan.{field} must be a positive integer or null"):
        QAttnPlan(**{field: value})
    with pytest.raises(PlanError, match=f"qattn_plan.{field} must be a positive integer or null"):
        QAttnPlan.from_dict({"version": 1, field: value})


def test_container_types_are_checked_in_the_constructor():
    with pytest.raises(PlanError, match="qattn_plan.layers must be a dict"):
        QAttnPlan(layers=["int8"])
    with pytest.raises(PlanError, match=r"qattn_plan.steps\[0\] must be a dict"):
        QAttnPlan(steps={0: "int8"})
    with pytest.raises(PlanError, match="qattn_plan.meta must be a dict"):
        QAttnPlan(meta="x")
    with pytest.raises(PlanError, match=r"out of range \[0, 2\)"):
        QAttnPlan(layers={2: "int8"}, num_layers=2)


def test_nan_scores_are_rejected_naming_the_entry():
    """Was: NaN scores ranked by dict order in from_scores."""
    with pytest.raises(ValueError, match="score of layer 2 must be a number, not NaN"):
        QAttnPlan.from_scores({0: 0.9, 1: 0.95, 2: math.nan}, 0.5)
    with pytest.raises(ValueError, match=r"score of \(step, layer\) \(1, 0\)"):
        QAttnPlan.from_scores({(0, 0): 0.9, (1, 0): float("nan")}, 0.5)
    with pytest.raises(ValueError, match="score of layer 0"):
        QAttnPlan.from_scores({0: "0.9"}, 0.5)
    with pytest.raises(PlanError, match="index must be an integer"):
        QAttnPlan.from_scores({1.5: 0.9}, 0.5)
    plan = QAttnPlan.from_scores({0: 0.9, 1: -math.inf, 2: np.float32(0.99)}, 1 / 3)
    assert plan.layers == {0: "int4", 1: "int8", 2: "int4"}


# --- item 7: only a model that runs qattn fails on its plan ----------------------------------------------
@pytest.fixture
def saved_with_bad_plan(tiny_model, tmp_path, monkeypatch):
    from hf_qattn.integrations.transformers import registration

    monkeypatch.setattr(registration, "_warned", set())  # warnings are once per message and process
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["qattn_plan"] = {"version": 1, "layers": {"1": "int8", "01": "int4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bad_plan_only_warns_for_models_not_running_qattn(saved_with_bad_plan, attn):
    """Was: after ``import hf_qattn``, a malformed plan broke loading even with sdpa or eager attention."""
    import warnings

    import torch
    from transformers import AutoModel

    with pytest.warns(RuntimeWarning, match=r"LlamaModel: config.qattn_plan is invalid.*'01'.*does not run qattn"):
        model = AutoModel.from_pretrained(saved_with_bad_plan, attn_implementation=attn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per message
        AutoModel.from_pretrained(saved_with_bad_plan, attn_implementation=attn)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(3, 100, (1, 6))).last_hidden_state).all()
    with pytest.raises(PlanError, match="config.qattn_plan is invalid"):  # switching to qattn reads the plan
        model.set_attn_implementation("qattn")


def test_bad_plan_fails_at_load_with_qattn(saved_with_bad_plan):
    from transformers import AutoModel

    with pytest.raises(PlanError, match=r"LlamaModel: config.qattn_plan is invalid.*'01'"):
        AutoModel.from_pretrained(saved_with_bad_plan, attn_implementation="qattn")
