"""One zero-mean outlier channel of K (issue 15, item 8): split out of K̂, its scores kept in float.

The kernels' side (the K/V pass's choice and kc, the rank-one term in the Triton kernel) is in
tests/test_kernels.py; the Hopper kernel's, in eval/check_device.py on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import hf_qattn
from hf_qattn import quant, reference
from hf_qattn.calibration.metrics import accuracy


def issue_input(seed: int, size: float = 6e4):
    """The issue's reproduction: B1 H2 N512 d64 fp16, K channel 5 = ±6e4 on alternating tokens."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 512, 64, generator=g) for _ in range(3))
    k[..., ::2, 5], k[..., 1::2, 5] = size, -size
    return tuple(t.half() for t in (q, k, v))


def test_split_channel_finds_only_zero_mean_outliers(seed):
    k = torch.randn(2, 8, 300, 64)
    assert (quant.split_channel(k, k.mean(2)) == -1).all()  # Gaussian channels: nothing to split
    k[:, 3, :, 7] += 50.0  # a channel offset: smoothing removes it, nothing to split either
    assert (quant.split_channel(k, k.mean(2)) == -1).all()
    k[1, 2, ::2, 9], k[1, 2, 1::2, 9] = 40.0, -40.0
    found = quant.split_channel(k, k.mean(2))
    assert found[1, 2] == 9 and (found.flatten()[torch.arange(16) != 10] == -1).all()


def test_issue_input_reaches_cosine_0_99(seed):
    q, k, v = issue_input(seed)
    exact = reference.exact_attention(q, k, v)
    out = hf_qattn.qattn(q, k, v, backend="reference", split_channel=True)
    assert accuracy(out, exact).cos_sim >= 0.99, accuracy(out, exact)
    # the default (no split): what the issue measured (cosine 0.666)
    assert accuracy(hf_qattn.qattn(q, k, v, backend="reference"), exact).cos_sim < 0.9


def test_the_switch_is_an_argument_or_the_environment(monkeypatch):
    q, k, v = issue_input(0)
    exact = reference.exact_attention(q, k, v)
    monkeypatch.setenv("HF_QATTN_SPLIT_CHANNEL", "1")
    assert accuracy(hf_qattn.qattn(q, k, v, backend="reference"), exact).cos_sim >= 0.99
    assert accuracy(hf_qattn.qattn(q, k, v, backend="reference", split_channel=False), exact).cos_sim < 0.9
    with pytest.raises(ValueError, match="split_channel"):
        hf_qattn.qattn(q, k, v, split_channel="yes")


def test_inputs_without_an_outlier_are_unchanged(seed):
    q, k, v = (torch.randn(2, 4, 100, 32) for _ in range(3))
    k = k + 5 * torch.randn(1, 4, 1, 32)  # channel offsets, as real K has
    for causal in (False, True):
        split = reference.quantized_attention(q, k, v, is_causal=causal, split_channel=True)
        plain = reference.quantized_attention(q, k, v, is_causal=causal)
        assert torch.equal(split, plain)
