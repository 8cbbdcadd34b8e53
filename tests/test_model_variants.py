"""Today's attention variants through the transformers integration (issue 27): tiny models of each family, built
from the family's own config class shrunk, with a prompt longer than the window or chunk, run every attention
call on a quantized path — sliding windows (Mistral, Gemma 2/3, Cohere2, gpt-oss), Llama 4's chunks (also where
left padding or a cache offset moves their starts), gpt-oss's sinks, Gemma 2's soft-cap — and what the kernel still
cannot serve (a bidirectional window, per-token sinks, malformed values) falls back, counted.

Each family is checked twice against the model's own eager attention (float32):
- the semantics: with the quantization taken out (qattn's call evaluated by the exact float64 reference, same
  keywords), the logits equal eager's to float32 rounding — a window off by one, a sink in the wrong units or a
  soft-cap in the wrong place would show at once (dropping the variant moves the logits' cosine to 0.34–0.97);
- the quantized run: the logits' cosine to eager's, and hf_qattn's call counts (every call on a kernel path).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_qattn
from hf_qattn import reference, support
from hf_qattn.integrations import transformers as integration

tf = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("seed")

SPAN = 24  # window / chunk, and a prompt more than three times longer
PROMPT = 80
_SHRUNK = dict(hidden_size=64, intermediate_size=128, vocab_size=128)

# Cosine of the logits (per sequence, over every position) of the quantized model to eager attention's. Measured
# on these models: Mistral, Cohere2, gpt-oss ≥ 0.9998, Llama 4 ≥ 0.9995. Gemma 2 and 3 put every attention output
# through a norm before the residual (post_attention_layernorm), so in a random-weight model attention, not the
# embeddings, carries the residual and its ~3 % per-layer FP8 P·V error reaches the logits: 0.9982–0.9991 measured
# over seeds (with FP16 P·V the same models reach 0.9999+, and with the variant dropped 0.3–0.55). Their floor is
# therefore lower; the semantics check above is what pins their variants exactly.
LOGITS_COS = 0.999
LOGITS_COS_POST_NORM = 0.997


def _config(name: str):
    """The family's config class, shrunk; None where this transformers lacks it."""
    cls = getattr(tf, {"mistral": "MistralConfig", "gemma3": "Gemma3TextConfig", "gemma2": "Gemma2Config",
                       "cohere2": "Cohere2Config", "llama4": "Llama4TextConfig", "gpt_oss": "GptOssConfig"}[name], None)
    if cls is None:
        return None
    if name == "mistral":  # every layer sliding
        return cls(**_SHRUNK, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   sliding_window=SPAN)
    if name == "gemma3":  # local and global layers (1 in 6 global at real size)
        return cls(**_SHRUNK, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=SPAN,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    if name == "gemma2":  # soft-capping on every layer, sliding on half
        return cls(**_SHRUNK, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=SPAN, attn_logit_softcapping=5.0)
    if name == "cohere2":  # three sliding layers, then a global one
        return cls(**_SHRUNK, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=SPAN)
    if name == "llama4":  # chunked on the RoPE layers, a global NoPE layer every 4th (the config's own rule)
        return cls(**_SHRUNK, intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, attention_chunk_size=SPAN, num_local_experts=1)
    if name == "gpt_oss":  # sinks on every layer, sliding on half; both experts taken (no routing flips)
        return cls(**_SHRUNK, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   sliding_window=SPAN, num_local_experts=2, num_experts_per_tok=2)
    raise ValueError(name)


FAMILIES = ["mistral", "gemma3", "gemma2", "cohere2", "llama4", "gpt_oss"]


def _model(name: str, attn: str = "eager", **overrides):
    config = _config(name)
    if config is None:
        pytest.skip(f"this transformers ({tf.__version__}) has no config class for {name}")
    for key, value in overrides.items():
        setattr(config, key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shrunk vocabulary makes some families warn about their token ids
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.eval()


def _expected_variants(model) -> list[dict]:
    """Per layer, the keywords its qattn call must carry: what the config says the layer does."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    expected = []
    for kind in layer_types:
        want = {}
        if kind == "sliding_attention":
            want["window"] = config.sliding_window
        if kind == "chunked_attention":
            want["chunk"] = config.attention_chunk_size
        if getattr(config, "attn_logit_softcapping", None) is not None:
            want["softcap"] = config.attn_logit_softcapping
        expected.append(want)
    return expected


def _logits(model, ids, attn: str) -> torch.Tensor:
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(out.flatten(1).double(), ref.flatten(1).double(), dim=-1).min().item()


def assert_all_quantized(counts: dict, calls: int) -> None:
    """Every call on a quantized path: kernel paths only, none on SDPA / eager; the only reasons counted are the
    sm90 kernel handing a variant to the portable kernel (a quantized path still, on a GPU)."""
    assert set(counts["calls"]) <= set(support.KERNEL_PATHS), counts
    assert sum(counts["calls"].values()) == calls, counts
    assert all(reason.startswith(support.REASON_HOPPER_VARIANT) for reason in counts["fallbacks"]), counts


# ------------------------------------------------------------------------------------------------
# every family on qattn


@pytest.mark.parametrize("name", FAMILIES)
def test_family_variants_reach_qattn_exactly(name, monkeypatch, fresh_stats):
    """The window / chunk / sinks / soft-cap the model hands its attention reach qattn's keywords, and with the
    quantization taken out the model computes exactly what its eager attention does."""
    model = _model(name)
    ids = torch.randint(3, 128, (2, PROMPT))
    ref = _logits(model, ids, "eager")
    calls = []

    def exact(q, k, v, *, layout, qk, sm_scale, split_channel, **options):
        calls.append(options)
        return reference.exact_attention(q, k, v, sm_scale=sm_scale, dtype=torch.float64, **options).to(q.dtype)

    monkeypatch.setattr(integration.attention.api, "qattn", exact)
    out = _logits(model, ids, "qattn")
    assert fresh_stats()["fallbacks"] == {}
    expected = _expected_variants(model)
    assert len(calls) == len(expected)
    for layer, (options, want) in enumerate(zip(calls, expected)):
        got = {key: options[key] for key in ("window", "chunk", "softcap") if options[key] is not None}
        assert got == want, (layer, got, want)
        assert options["is_causal"] and options["kv_start"] is None and options["kv_end"] is None
        sinks = options["sinks"]
        if name == "gpt_oss":
            torch.testing.assert_close(sinks, model.model.layers[layer].self_attn.sinks.detach())
        else:
            assert sinks is None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_runs_quantized_close_to_eager(name, fresh_stats):
    model = _model(name)
    ids = torch.randint(3, 128, (2, PROMPT))
    ref = _logits(model, ids, "eager")
    hf_qattn.reset_fallback_stats()
    out = _logits(model, ids, "qattn")
    assert_all_quantized(fresh_stats(), model.config.num_hidden_layers)
    floor = LOGITS_COS_POST_NORM if name in ("gemma2", "gemma3") else LOGITS_COS
    assert _cosine(out, ref) >= floor


@pytest.mark.parametrize("name", ["mistral", "gemma3", "llama4", "gpt_oss"])
def test_family_decodes_on_qattn_with_a_dynamic_cache(name, fresh_stats):
    """Prefill and one-token steps past the window / chunk with transformers' own cache (its sliding layers keep
    the last W − 1 keys; a step's window or chunk is then a key range of the mask): no call falls back. (The
    quantized cache's steps: tests/test_cache_variants.py.)"""
    model = _model(name)
    ids = torch.randint(3, 128, (1, PROMPT))
    model.set_attn_implementation("qattn")
    hf_qattn.reset_fallback_stats()
    steps = 6
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert out.shape[1] == PROMPT + steps
    assert_all_quantized(fresh_stats(), model.config.num_hidden_layers * steps)


# ------------------------------------------------------------------------------------------------
# the mask confirms the model's window / chunk


def _transformers_mask(function, batch, nq, nk, padding=None):
    from transformers.masking_utils import sdpa_mask

    attention_mask = None
    if padding is not None:
        attention_mask = torch.ones(batch, nk, dtype=torch.bool)
        for row, pad in enumerate(padding):
            attention_mask[row, :pad] = False
    return sdpa_mask(batch_size=batch, q_length=nq, kv_length=nk, q_offset=nk - nq,
                     mask_function=function, attention_mask=attention_mask, allow_is_causal_skip=False)


@pytest.mark.parametrize("nq", [1, 12, 40])  # a step, a continuation across a chunk edge, a prefill
def test_transformers_window_and_chunk_masks_are_recognised(nq):
    """transformers' own sliding-window and chunked masks (with left padding, and with a cache offset) are causal
    ∧ range ∧ the model's window / chunk, exactly; a window that does not bite is left out; a bidirectional
    window and shifted chunks are refused."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    from hf_qattn.masks import analyse_mask

    nk, window = 40, 6
    padding = [0, 3]
    mask = _transformers_mask(sliding_window_causal_mask_function(window), 2, nq, nk, padding)
    found = analyse_mask(mask, 2, 4, nq, nk, window)
    assert found.kv_len == nk and found.causal == (nq > 1)  # one query's window is a key range
    assert found.window == (window if nq > 1 else None)
    rebuilt = reference.visible_keys(2, nq, nk, is_causal=True, kv_start=found.kv_start, kv_end=found.kv_end,
                                     window=found.window)
    assert torch.equal(rebuilt, mask)
    if nq > 1:  # a window other than the mask's is refused
        assert isinstance(analyse_mask(mask, 2, 4, nq, nk, window + 1), str)
        assert isinstance(analyse_mask(mask, 2, 4, nq, nk, window - 1), str)

    chunk = 8
    unpadded = _transformers_mask(chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long)), 1, nq, nk)
    found = analyse_mask(unpadded, 1, 4, nq, nk, None, chunk)
    assert found.chunk == (chunk if nq > 1 else None)
    assert torch.equal(reference.visible_keys(1, nq, nk, is_causal=found.causal, kv_start=found.kv_start,
                                              chunk=found.chunk), unpadded)
    shifted = _transformers_mask(chunked_causal_mask_function(chunk, torch.tensor([0, 3])), 2, nq, nk, padding)
    found = analyse_mask(shifted, 2, 4, nq, nk, None, chunk)
    if nq > 1:  # the second sequence's chunks start at its first token, key 3: shift 5 (3 + 5 = 8)
        assert found.chunk == chunk and found.chunk_shift.tolist() == [0, 5]
    rebuilt = torch.stack([_rebuilt_row(found.for_batch(2), row, nq) for row in range(2)])
    assert torch.equal(rebuilt, shifted[:, 0])

    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    both_ways = _transformers_mask(sliding_window_bidirectional_mask_function(window), 1, nq, nk)
    assert isinstance(analyse_mask(both_ways, 1, 4, nq, nk, window), str) or nq == 1


def _rebuilt_row(pattern, row, nq):
    """The (Nq, kv_len) visibility a pattern stands for in one sequence, the chunk shift applied by moving the
    sequence's tokens as the integration does."""
    q = torch.zeros(1, 1, nq, 1)
    k = torch.arange(pattern.kv_len, dtype=torch.float32).view(1, 1, -1, 1)
    one = type(pattern)(pattern.causal, pattern.kv_len, *(None if t is None else t[row : row + 1] for t in
                                                          (pattern.kv_start, pattern.kv_end)),
                        pattern.window, pattern.chunk,
                        None if pattern.chunk_shift is None else pattern.chunk_shift[row : row + 1])
    if one.chunk_shift is None:
        return reference.visible_keys(1, nq, one.kv_len, is_causal=one.causal, kv_start=one.kv_start,
                                      kv_end=one.kv_end, window=one.window, chunk=one.chunk)[0, 0]
    q, k, _, moved, undo = one.realigned(q, k, k)
    seen = reference.visible_keys(1, q.shape[2], moved.kv_len, is_causal=True, kv_start=moved.kv_start,
                                  kv_end=moved.kv_end, window=moved.window, chunk=moved.chunk)[0, 0]
    shift = int(one.chunk_shift[0])
    return seen[shift : shift + nq, shift : shift + one.kv_len]


def test_a_window_longer_than_the_keys_is_no_variant():
    from hf_qattn.masks import analyse_mask, visible_keys

    mask = visible_keys(1, 10, 10, is_causal=True)
    found = analyse_mask(mask, 1, 1, 10, 10, 24, 32)
    assert found.causal and found.window is None and found.chunk is None


# ------------------------------------------------------------------------------------------------
# what still falls back, counted


def test_bidirectional_sliding_window_falls_back_counted(fresh_stats):
    """Gemma 3 as an encoder (use_bidirectional_attention: EmbeddingGemma) slides a window both ways; qattn's
    window is causal. Its sliding layers fall back, counted; its global (non-causal) layers stay quantized."""
    model = _model("gemma3", attn="sdpa", use_bidirectional_attention=True)
    if model.model.layers[0].self_attn.is_causal:
        pytest.skip("this transformers' Gemma 3 has no bidirectional attention")
    ids = torch.randint(3, 128, (1, PROMPT))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    hf_qattn.reset_fallback_stats()
    model.set_attn_implementation("qattn")
    with pytest.warns(RuntimeWarning, match="sliding-window or chunked layer"):
        with torch.no_grad():
            out = model(input_ids=ids).logits
    counts = fresh_stats()
    assert counts["fallbacks"] == {integration.REASON_SLIDING_WINDOW: 2}
    assert counts["calls"] == {"sdpa": 2, "reference": 2}
    assert _cosine(out, ref) >= LOGITS_COS_POST_NORM


@pytest.mark.parametrize("padding", [5, 24 + 3])
def test_chunks_shifted_by_left_padding_are_served(padding, fresh_stats):
    """Llama 4 starts a padded sequence's chunks at its first token; qattn's chunks start at key 0 of the call.
    The mask shows the shift (hf_qattn.masks: chunk_shift) and the integration moves each sequence by it: every
    call stays quantized and the real tokens' logits match SDPA's (padded rows differ by design)."""
    model = _model("llama4", attn="sdpa")
    ids = torch.randint(3, 128, (3, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    mask[2, :2] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    hf_qattn.reset_fallback_stats()
    model.set_attn_implementation("qattn")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    assert_all_quantized(fresh_stats(), model.config.num_hidden_layers)
    for row in range(3):
        real = mask[row].bool()
        assert _cosine(out[row : row + 1, real], ref[row : row + 1, real]) >= LOGITS_COS


def test_a_step_across_a_chunk_edge_over_a_cache_is_served(fresh_stats):
    """A multi-token step over transformers' cache (its chunked layers hold the last C − 1 keys, so the call's
    key 0 is not a chunk start) that crosses a chunk edge: quantized, and as eager computes it."""
    model = _model("llama4")
    ids = torch.randint(3, 128, (1, 62))
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, 40:]
        model.set_attn_implementation("qattn")
        cache = tf.DynamicCache(config=model.config)
        model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
        hf_qattn.reset_fallback_stats()
        out = model(input_ids=ids[:, 40:], past_key_values=cache, use_cache=True).logits  # 40..61: edge at 48
    assert_all_quantized(fresh_stats(), model.config.num_hidden_layers)
    assert _cosine(out, ref) >= LOGITS_COS


def test_per_token_sinks_fall_back_to_eager_counted(fresh_stats):
    """Sinks that vary per token (one logit per head and query row) are not qattn's per-head sinks: eager."""

    class Attention(torch.nn.Module):  # its module (this file) has no eager_attention_forward: the plain one runs
        is_causal = True
        layer_idx = 0

    q, k, v = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    sinks = torch.randn(1, 4, 12, 1)
    with pytest.warns(RuntimeWarning, match="attention sinks other than"):
        out, _ = integration.qattn_attention_forward(Attention().eval(), q, k, v, None, scaling=0.25, sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2) * 0.25).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -torch.inf)
    weights = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(out, (weights @ vv).transpose(1, 2))
    counts = fresh_stats()
    assert counts["fallbacks"] == {integration.REASON_SINKS: 1} and counts["calls"] == {"eager": 1}


# ------------------------------------------------------------------------------------------------
# the attention function on its own


class _Module(torch.nn.Module):
    is_causal = True
    layer_idx = 0


@pytest.mark.parametrize("variant", [dict(sliding_window=5), dict(s_aux=True), dict(softcap=3.0),
                                     dict(sliding_window=5, s_aux=True, softcap=3.0)])
def test_attention_function_without_a_mask_applies_the_model_variant(variant, fresh_stats):
    """No mask (a direct call, or SDPA's skipped mask): the flags decide causality and the model's window applies
    as under FlashAttention; sinks and soft-cap go to qattn as given. Checked against the float64 reference."""
    q, k, v = torch.randn(2, 4, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    kwargs = dict(variant)
    if kwargs.get("s_aux"):
        kwargs["s_aux"] = torch.randn(4)
    out, weights = integration.qattn_attention_forward(_Module().eval(), q, k, v, None, scaling=0.2, **kwargs)
    assert weights is None
    exact = reference.exact_attention(q, k, v, is_causal=True, sm_scale=0.2, window=kwargs.get("sliding_window"),
                                      sinks=kwargs.get("s_aux"), softcap=kwargs.get("softcap")).float()
    err = ((out.transpose(1, 2) - exact).norm() / exact.norm()).item()
    assert err < 0.06, err  # INT8 Q·Kᵀ and FP8 P·V: measured 0.02–0.035; without the variant 0.2–1
    counts = fresh_stats()
    assert counts["fallbacks"] == {} and sum(counts["calls"].values()) == 1


def test_invalid_model_variants_fall_back_counted(fresh_stats):
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    module = _Module().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        integration.qattn_attention_forward(module, q, k, v, None, sliding_window=0)
        integration.qattn_attention_forward(module, q, k, v, None, softcap=-1.0)
    assert fresh_stats()["fallbacks"] == {integration.REASON_WINDOW: 1, integration.REASON_SOFTCAP: 1}


@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "llama4", "gemma2"])
def test_variants_inside_torch_compile(name, fresh_stats, monkeypatch):
    """Inside torch.compile the window / chunk join the pattern by shape and the mask check stays a tensor, sinks
    and soft-cap pass as they are: the call stays in the graph, the compiled model equals eager mode, and no call
    falls back."""
    left_graph = []
    monkeypatch.setattr(integration.attention, "_eager_attention_forward", torch.compiler.disable(
        lambda *args, **kwargs: left_graph.append(1) or integration.qattn_attention_forward(*args, **kwargs)))
    model = _model(name, attn="qattn", num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, 40))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = torch.compile(model, backend="eager")(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    assert not left_graph
    counts = fresh_stats()
    assert counts["fallbacks"] == {} and counts["calls"] == {"reference": 2}  # 1 eager call, 1 traced call site


# ------------------------------------------------------------------------------------------------
# calibration scores the variant layers with their variant


@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "gemma2", "llama4"])
def test_calibration_scores_every_variant_layer_with_its_variant(name, monkeypatch, fresh_stats):
    """Every layer gets a score, nothing is skipped, and each layer's scoring call carries the keywords its
    config gives it (window / chunk / soft-cap; gpt-oss's sinks), on both sides of the comparison."""
    from hf_qattn.calibration import scoring
    from hf_qattn.integrations.transformers import calibration

    model = _model(name)
    model.set_attn_implementation("qattn")
    seen: dict[int, dict] = {}
    real = scoring.attention_accuracy

    def spy(q, k, v, **options):
        layer = len(seen)  # one sequence, one call a layer, in layer order
        seen[layer] = {key: value for key, value in options.items()
                       if key in ("window", "chunk", "sinks", "softcap") and value is not None}
        return real(q, k, v, **options)

    monkeypatch.setattr(calibration, "attention_accuracy", spy)
    ids = torch.randint(0, _SHRUNK["vocab_size"], (1, PROMPT))
    result = hf_qattn.calibrate(model, ids, ratio=0.5, objective="attention", progress=False)
    assert result.skipped == {}, result.skipped
    assert sorted(result.scores) == list(range(model.config.num_hidden_layers))
    for layer, want in enumerate(_expected_variants(model)):
        got = dict(seen[layer])
        if name == "gpt_oss":
            assert got.pop("sinks").shape == (model.config.num_attention_heads,)
        assert got == want, (layer, got, want)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "llama4"])
def test_per_layer_accuracy_measures_each_layer_with_its_variant(name, monkeypatch):
    """hf-qattn eval-attention's engine: the captured calls carry each layer's variant, and both qattn and the
    float64 reference are called with it."""
    from hf_qattn.evaluation import layer_accuracy

    model = _model(name)
    records = layer_accuracy.capture_attention_inputs(model, [{"input_ids": torch.randint(0, 128, (1, PROMPT))}])
    calls = []
    real = reference.exact_attention

    def spy(*args, **options):
        calls.append({key: options.get(key) for key in ("window", "chunk", "sinks", "softcap")})
        return real(*args, **options)

    monkeypatch.setattr(layer_accuracy.reference, "exact_attention", spy)
    results = layer_accuracy.per_layer_accuracy(records)
    assert [r["layer"] for r in records] == list(range(model.config.num_hidden_layers))
    for layer, want in enumerate(_expected_variants(model)):
        got = {key: value for key, value in calls[layer].items() if value is not None}
        if name == "gpt_oss":
            assert got.pop("sinks").shape == (model.config.num_attention_heads,)
        assert got == want, (layer, got, want)
        assert results["qattn-8b"][layer][0].cos_sim > 0.999
