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

