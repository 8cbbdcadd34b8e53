"""Calls too short for the quantized kernels to beat SDPA (``break_even`` in configs/kernels.json): the
transformers integration hands them to SDPA, counted as ``sdpa-below-break-even``, and runs quantized from
the floor on; ``HF_QATTN_BREAK_EVEN=0``, float32, variants and ``hf_qattn.qattn`` itself are never routed.

On the CPU the table lists no floor, so the tests give one (``tuning.break_even`` patched); on an sm90 GPU one
test reads the shipped floors."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_qattn
from hf_qattn import support
from hf_qattn.kernels import tuning
from hf_qattn.kv_cache.captured import cache_argument

pytestmark = pytest.mark.usefixtures("seed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = 24  # queries and keys, in these tests


@pytest.fixture
def floor(monkeypatch):
    """A floor of FLOOR for every head dim and causality, on every arch, and the switch on."""
    monkeypatch.setenv("HF_QATTN_BREAK_EVEN", "1")
    monkeypatch.setattr(tuning, "break_even", lambda arch, head_dim, causal: FLOOR)


def _pair(tiny_model, kind="llama", dtype=torch.bfloat16, **config):
    qattn = tiny_model(kind, head="lm", attn="qattn", **config).to(DEVICE, dtype)
    sdpa = tiny_model(kind, head="lm", attn="sdpa", **config).to(DEVICE, dtype)
    sdpa.load_state_dict(qattn.state_dict())
    return qattn, sdpa


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_short_prefill_is_sdpa_and_long_one_quantized(tiny_model, floor, fresh_stats):
    qattn, sdpa = _pair(tiny_model)
    layers = qattn.config.num_hidden_layers
    short = torch.randint(1, 128, (2, FLOOR - 1), device=DEVICE)
    assert torch.equal(_logits(qattn, short), _logits(sdpa, short))  # SDPA itself: the very same logits
    assert fresh_stats() == {"calls": {support.BELOW_BREAK_EVEN: layers}, "fallbacks": {}}

    hf_qattn.reset_fallback_stats()
    long = torch.randint(1, 128, (2, FLOOR), device=DEVICE)
    got, want = _logits(qattn, long), _logits(sdpa, long)
    calls = fresh_stats()["calls"]
    assert support.BELOW_BREAK_EVEN not in calls and sum(calls.values()) == layers, calls
    assert not torch.equal(got, want)  # quantized: close, not equal
    assert torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0) > 0.99


def test_one_token_steps_over_a_full_precision_cache_are_sdpa(tiny_model, floor, fresh_stats):
    """A decode step over DynamicCache has one query: re-quantizing every cached key for it never pays."""
    qattn, _ = _pair(tiny_model)
    ids = torch.randint(1, 128, (1, FLOOR + 8), device=DEVICE)
    cache = transformers.DynamicCache(config=qattn.config)
    keyword = cache_argument(qattn)  # cache= where transformers takes it, else past_key_values=
    with torch.no_grad():
        out = qattn(ids, use_cache=True, **{keyword: cache})
        hf_qattn.reset_fallback_stats()
        qattn(out.logits[:, -1:].argmax(-1), use_cache=True, **{keyword: cache})
    assert fresh_stats()["calls"] == {support.BELOW_BREAK_EVEN: qattn.config.num_hidden_layers}


def test_switched_off_or_float32_runs_quantized(tiny_model, floor, fresh_stats, monkeypatch):
    qattn, _ = _pair(tiny_model, dtype=torch.float32)  # the floors compare half-precision kernels
    short = torch.randint(1, 128, (1, 8), device=DEVICE)
    _logits(qattn, short)
    assert support.BELOW_BREAK_EVEN not in fresh_stats()["calls"]
    monkeypatch.setenv("HF_QATTN_BREAK_EVEN", "0")
    qattn = qattn.to(torch.bfloat16)
    hf_qattn.reset_fallback_stats()
    _logits(qattn, short)
    assert support.BELOW_BREAK_EVEN not in fresh_stats()["calls"]


def test_a_biting_window_is_never_routed(tiny_model, floor, fresh_stats):
    """transformers' SDPA path for a sliding window computes every masked score: the kernel stays, however short."""
    qattn, _ = _pair(tiny_model, "mistral", sliding_window=8)
    _logits(qattn, torch.randint(1, 128, (1, 16), device=DEVICE))
    calls = fresh_stats()["calls"]
    assert support.BELOW_BREAK_EVEN not in calls and not fresh_stats()["fallbacks"], fresh_stats()
    # a window the keys do not reach past is plain causal attention: routed like it
    hf_qattn.reset_fallback_stats()
    _logits(qattn, torch.randint(1, 128, (1, 6), device=DEVICE))
    assert fresh_stats()["calls"] == {support.BELOW_BREAK_EVEN: qattn.config.num_hidden_layers}


def test_the_kernel_api_is_never_routed(floor, fresh_stats):
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    hf_qattn.qattn(q, k, v, is_causal=True)
    assert support.BELOW_BREAK_EVEN not in fresh_stats()["calls"]


def test_under_torch_compile_the_floor_is_decided_while_tracing(tiny_model, floor, fresh_stats):
    qattn, sdpa = _pair(tiny_model)
    short = torch.randint(1, 128, (1, FLOOR - 4), device=DEVICE)

    def forward(ids):
        return qattn(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        got = torch.compile(forward, backend="aot_eager", fullgraph=True)(short)
        want = _logits(sdpa, short, use_cache=False)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=0)  # SDPA, traced: bf16 rounding only
    assert fresh_stats()["calls"] == {support.BELOW_BREAK_EVEN: qattn.config.num_hidden_layers}


def test_shipped_floors():
    """The table's floors: positive counts, by padded head dim (96 reads 128's), none where none was measured."""
    assert tuning.break_even("sm90", 128, True) == tuning.break_even("sm90", 96, True) > 0
    assert tuning.break_even("sm90", 64, True) >= tuning.break_even("sm90", 64, False) > 0
    assert tuning.break_even("sm90", 256, True) == 0 and tuning.break_even("interpreter", 128, True) == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the shipped floors are for sm90")
def test_sm90_short_llm_prefill_is_sdpa_by_default(tiny_model, fresh_stats, monkeypatch):
    monkeypatch.setenv("HF_QATTN_BREAK_EVEN", "1")
    qattn, sdpa = _pair(tiny_model, head_dim=64)
    ids = torch.randint(1, 128, (1, 512), device=DEVICE)
    assert torch.equal(_logits(qattn, ids), _logits(sdpa, ids))
    assert fresh_stats()["calls"] == {support.BELOW_BREAK_EVEN: qattn.config.num_hidden_layers}
    monkeypatch.setenv("HF_QATTN_BREAK_EVEN", "0")
    hf_qattn.reset_fallback_stats()
    _logits(qattn, ids)
    assert fresh_stats()["calls"] == {support.HOPPER: qattn.config.num_hidden_layers}


def _tiny_wan():
    diffusers = pytest.importorskip("diffusers")
    tr = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                         in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                         num_layers=2, rope_max_seq_len=32).to(DEVICE, torch.bfloat16).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 8, 8, device=DEVICE, dtype=torch.bfloat16),  # 3 × 16 tokens
                  timestep=torch.tensor([500], device=DEVICE),
                  encoder_hidden_states=torch.randn(1, 8, 32, device=DEVICE, dtype=torch.bfloat16))  # 8 text tokens
    return tr, inputs


def _denoise(tr, inputs):
    with torch.no_grad():
        return tr(**inputs, return_dict=False)[0]


def test_diffusers_short_calls_are_sdpa(floor, fresh_stats, monkeypatch):
    """The diffusers patch routes as the transformers integration does: a tiny Wan block's cross-attention (48
    image queries over 8 text keys) is below the floor of 24, its self-attention (48 over 48) is not; with the
    floor above both, the patched denoiser is the unpatched one bit for bit."""
    tr, inputs = _tiny_wan()
    want = _denoise(tr, inputs)
    with hf_qattn.patch(tr, plan="int8"):
        got = _denoise(tr, inputs)
    calls = fresh_stats()["calls"]
    assert calls.pop(support.BELOW_BREAK_EVEN) == 2  # one cross-attention a block
    assert sum(calls.values()) == 2 and not fresh_stats()["fallbacks"]  # the self-attentions, quantized
    assert not torch.equal(got, want)
    assert torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0) > 0.99

    monkeypatch.setattr(tuning, "break_even", lambda arch, head_dim, causal: 10 ** 6)
    hf_qattn.reset_fallback_stats()
    with hf_qattn.patch(tr, plan="int8"):
        assert torch.equal(_denoise(tr, inputs), want)
    assert fresh_stats()["calls"] == {support.BELOW_BREAK_EVEN: 4}
