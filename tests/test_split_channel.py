"""One zero-mean outlier channel of K (issue 15, item 8): split out of K̂, its scores kept in float.

The kernels' side (the K/V pass's choice and kc, the rank-one term in the Triton kernel) is in
tests/test_kernels.py; the Hopper kernel's, in eval/check_device.py on the GPU.
"""

from __future__ import annotations

import warnings

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


def _llama_with_an_outlier_channel(size: float = 1e4):
    """A tiny Llama whose layer 0 keys have, after RoPE, channel 0 of kv head 0 at ±size on alternating tokens
    (the issue's zero-mean outlier, which smoothing cannot remove): k_proj's output gets, at position p, the
    pre-RoPE pair (channels 0 and 8) that RoPE's fastest rotation (one radian a token) turns into exactly that."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="qattn").eval()
    with torch.no_grad():  # scores of the other channels O(1), as in trained models (random init: ~0.1)
        model.model.layers[0].self_attn.q_proj.weight.mul_(8.0)
        model.model.layers[0].self_attn.k_proj.weight.mul_(8.0)

    def add_outlier(module, args, out):
        p = torch.arange(out.shape[1], dtype=torch.float64)
        sign = 1.0 - 2.0 * (p % 2)
        out = out.clone()
        out[:, :, 0] += (size * sign * torch.cos(p)).to(out.dtype)
        out[:, :, 8] -= (size * sign * torch.sin(p)).to(out.dtype)
        return out

    model.model.layers[0].self_attn.k_proj.register_forward_hook(add_outlier)
    return model


def _layer0_attention(model, ids, impl):
    """Layer 0's attention output under ``impl``."""
    captured = {}
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: captured.update(out=out[0]))
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
        model.set_attn_implementation("qattn")
    return captured["out"].float()


def test_calibration_marks_the_layer_with_an_outlier_channel_and_fixes_it(seed):
    """Issue 24: a zero-mean outlier K channel through a calibrated model, with no argument set by the user:
    the plan lists the layer (and only it), and the layer's output comes back to cosine ≥ 0.99 to SDPA."""
    model = _llama_with_an_outlier_channel()
    ids = torch.randint(1, 128, (2, 256))
    exact = _layer0_attention(model, ids, "sdpa")
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()  # noqa: E731
    before = cos(_layer0_attention(model, ids, "qattn"), exact)
    assert before < 0.99, before  # the premise: without the split the layer is off
    plan, _ = hf_qattn.calibrate(model, ids, ratio=0.5, objective="attention", progress=False)
    assert plan.split_channel == [0] and model.config.qattn_plan["split_channel"] == [0]
    after = cos(_layer0_attention(model, ids, "qattn"), exact)
    assert after >= 0.99, (before, after)
    # and the plan round-trips: a plan without split layers writes no key, so older plans stay as they were
    assert "split_channel" not in hf_qattn.QAttnPlan(default="int8").to_dict()
    assert hf_qattn.QAttnPlan.from_dict(model.config.qattn_plan).splits(0)


def test_an_uncalibrated_model_warns_once_naming_the_layer_with_an_outlier_channel(seed, monkeypatch):
    """Issue 24: without a plan that splits it, a layer whose K has a zero-mean outlier channel warns (once,
    naming the layer); a layer or model without one, or a user who turned the split on, hears nothing."""
    monkeypatch.delenv("HF_QATTN_SPLIT_CHANNEL", raising=False)
    model = _llama_with_an_outlier_channel()
    ids = torch.randint(1, 128, (2, 256))
    with pytest.warns(UserWarning, match=r"layer 0: a key channel of 1 of 2 kv heads") as caught:
        with torch.no_grad():
            model(ids)
    assert not any("layer 1" in str(w.message) for w in caught), "layer 1 has no outlier"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(torch.randint(1, 128, (2, 600)))  # longer, so looked at again: warned already, silent
    for switched_on in (False, True):
        clean = _llama_with_an_outlier_channel(size=0.0)
        if switched_on:
            clean = _llama_with_an_outlier_channel()
            monkeypatch.setenv("HF_QATTN_SPLIT_CHANNEL", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                clean(ids)
