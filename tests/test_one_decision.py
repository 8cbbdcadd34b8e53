"""Issue 21: one decision in one place. Each test pins a pair of copies that disagreed (and failed on the
code before they became one): argument checks, the causal default, plan resolution, eager and compiled
plan reading."""

from __future__ import annotations

import pytest
import torch

import hf_qattn
from hf_qattn import support

# (q shape, k/v shape, dtype of v) in HND; head dims ≤ 256, so only the arguments decide
ARGUMENTS = [
    ((1, 0, 4, 8), (1, 0, 4, 8), torch.float32),  # zero heads on both sides: an empty call (call_gap refused it)
    ((1, 2, 4, 8), (1, 0, 4, 8), torch.float32),  # query heads without K/V heads
    ((1, 3, 4, 8), (1, 2, 4, 8), torch.float32),  # heads not a multiple
    ((1, 4, 4, 8), (1, 2, 4, 8), torch.float32),  # GQA
    ((2, 2, 4, 8), (1, 2, 4, 8), torch.float32),  # batch sizes differ
    ((1, 2, 4, 8), (1, 2, 4, 16), torch.float32),  # head dims differ
    ((1, 2, 4, 8), (1, 2, 4, 8), torch.float16),  # dtypes differ
    ((1, 2, 4, 8), (1, 2, 4, 8), torch.float32),
]


@pytest.mark.parametrize("q_shape, kv_shape, v_dtype", ARGUMENTS)
def test_qattn_accepts_exactly_the_arguments_the_integrations_do_not_fall_back_on(q_shape, kv_shape, v_dtype):
    q, k = torch.randn(q_shape), torch.randn(kv_shape)
    v = torch.randn(kv_shape).to(v_dtype)
    try:
        hf_qattn.qattn(q, k, v)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == (support.call_gap(q, k, v) is None)


def test_layer_accuracy_reads_causality_as_transformers_does(tiny_model):
    """A module without ``is_causal`` runs causal in transformers' SDPA path; the per-layer accuracy capture
    took it as not causal (its own default, False), so it scored attention the model never ran."""
    from hf_qattn.evaluation.layer_accuracy import capture_attention_inputs

    model = tiny_model("llama")
    modules = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "q_proj")]
    assert modules
    for module in modules:
        del module.is_causal
    records = capture_attention_inputs(model, [{"input_ids": torch.randint(0, 128, (1, 6))}])
    assert len(records) == len(modules) and all(record["causal"] for record in records)

    from hf_qattn.integrations.transformers.attention import causal_call, resolve_pattern

    q = torch.randn(1, 4, 6, 16)
    assert causal_call(modules[0], None, 6) and resolve_pattern(modules[0], q, q, None, None, {})[0].causal
    assert not causal_call(modules[0], False, 6) and not causal_call(modules[0], None, 1)


# -- plan resolution: one resolver (QAttnPlan.resolve) for the cache, both integrations, eager and compiled

def _llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                       vocab_size=16, **overrides)


def test_the_cache_refuses_a_plan_made_for_another_model_as_the_integrations_do():
    """QAttnCache checked a plan's indices but not its layer count; the integrations refused the plan."""
    from hf_qattn.integrations.transformers.attention import plan_from_config

    other = hf_qattn.QAttnPlan(default="int4", num_layers=12)
    for plan in (other, other.to_dict()):
        with pytest.raises(hf_qattn.PlanError, match="made for another model"):
            hf_qattn.QAttnCache(_llama_config(), plan=plan)
    stored = _llama_config(qattn_plan=other.to_dict())
    for read in (plan_from_config, hf_qattn.QAttnCache):
        with pytest.raises(hf_qattn.PlanError, match="made for another model"):
            read(stored)
    with pytest.raises(TypeError, match="plan must be"):  # was a PlanError ("must be a dict"); patch: TypeError
        hf_qattn.QAttnCache(_llama_config(), plan=0.5)
    assert hf_qattn.QAttnCache(_llama_config(), plan="fp16").precisions() == ["DynamicLayer"] * 3


def test_compiled_attention_refuses_the_plan_eager_attention_refuses(tiny_model):
    """The compiled attention read config.qattn_plan without the model's layer count: a plan made for another
    model ran under torch.compile and raised eagerly."""
    model = tiny_model("llama", attn="qattn")
    model.config.qattn_plan = hf_qattn.QAttnPlan(default="int4", num_layers=12).to_dict()
    ids = torch.randint(0, 128, (1, 6))

    def forward(ids):
        return model(input_ids=ids, use_cache=False).last_hidden_state

    with torch.no_grad():
        with pytest.raises(hf_qattn.PlanError, match="made for another model"):
            forward(ids)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="made for another model"):
            torch.compile(forward, backend="eager", fullgraph=True)(ids)
    torch._dynamo.reset()
