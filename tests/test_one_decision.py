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

