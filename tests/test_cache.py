"""hf_qattn.QAttnCache: storage, memory accounting, the packed hand-over, and generation with it."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_qattn  # noqa: E402
from hf_qattn.kv_cache import cache as qcache  # noqa: E402
from hf_qattn.kv_cache import reference as kv_reference  # noqa: E402
from hf_qattn.plan import PRECISIONS, QAttnPlan  # noqa: E402
from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before

UNQUANTIZED = PRECISIONS[-1]  # the plan's name for "leave this layer in full precision"


def llama_config(layers=3, **overrides):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, vocab_size=128,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_layers_follow_the_plan():
    plan = QAttnPlan(default="int4", layers={1: "int8", 2: UNQUANTIZED}, num_layers=3).to_dict()
    cache = hf_qattn.QAttnCache(llama_config(qattn_plan=plan))
    assert cache.precisions() == ["int4", "int8", "DynamicLayer"]
    assert hf_qattn.QAttnCache(llama_config()).precisions() == ["int8"] * 3  # no plan: INT8 everywhere
    assert hf_qattn.QAttnCache(llama_config(), plan="int4").precisions() == ["int4"] * 3
    with pytest.raises(ValueError):  # PlanError
        hf_qattn.QAttnCache(llama_config(), plan="int3")
    # 8-bit K and V groups for the layers the plan marks int8; INT4 and unquantized layers as the plan says
    grouped = hf_qattn.QAttnCache(llama_config(qattn_plan=plan), int8_layout="groups")
    assert grouped.precisions() == ["int4", "int8g", "DynamicLayer"]
    with pytest.raises(ValueError, match="int8_layout must be one of"):
        hf_qattn.QAttnCache(llama_config(), int8_layout="channels")


@pytest.mark.parametrize("build,error,message", [
    (lambda: hf_qattn.QAttnCache(llama_config(), static_max_len=0), ValueError,
     r"static_max_len must be an int >= 1 \(tokens a layer holds\) or None; got 0"),
    (lambda: hf_qattn.QAttnCache(llama_config(), static_max_len=100.5), ValueError, "static_max_len must be an int"),
    (lambda: hf_qattn.QAttnCache(llama_config(), center_sample=0), ValueError, "center_sample must be an int >= 1"),
    (lambda: hf_qattn.QAttnCache(llama_config(), center_sample=-1), ValueError, "center_sample must be an int >= 1"),
    (lambda: hf_qattn.QAttnCache(None), TypeError, "model_or_config must be a transformers model or its config"),
    (lambda: hf_qattn.QAttnCache(llama_config()).reserve(-1), ValueError, "tokens must be an int >= 1; got -1"),
    (lambda: hf_qattn.QAttnCache(llama_config()).reserve(True), ValueError, "tokens must be an int >= 1; got True"),
])
def test_cache_arguments_are_checked_when_given(build, error, message):
    """Counts the cache would divide by, slice with or allocate (a zero centers sample, a negative capacity) are
    refused when the cache is built, naming the argument — not a ZeroDivisionError or a torch error at the fill."""
    with pytest.raises(error, match=message):
        build()


def _shared_kwargs_layer_types(config):
    """transformers <= 5.17's get_layer_types_and_kwargs: one kwargs dict shared by all layers."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return list(kinds), {}


@pytest.mark.parametrize("layer_types", ["installed", "shared kwargs (transformers 5.17)"])
def test_one_layer_per_decoder_layer(seed, monkeypatch, layer_types):
    """Regression (H100 run of eval/bench_decode.py, transformers 5.17): the cache built from an
    8-layer model had no layers (a shared kwargs dict zipped with the layer types) and the first
    update failed with IndexError in Cache.update. A cache from a model has one layer per decoder
    layer, and a layer index past the config's layers gets a layer on demand."""
    if layer_types != "installed":
        monkeypatch.setattr(qcache, "get_layer_types_and_kwargs", _shared_kwargs_layer_types)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(layers=8), attn_implementation="qattn").eval()
    for source in (model, model.config):
        cache = hf_qattn.QAttnCache(source, plan="int4")
        assert len(cache.layers) == len(model.model.layers) == 8
        assert cache.precisions() == ["int4"] * 8
    ids = torch.randint(1, 128, (1, 9))
    with torch.no_grad():
        out = model(ids, **{CACHE_KW: cache}, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), **{CACHE_KW: cache}, use_cache=True)
    assert [layer.get_seq_length() for layer in cache.layers] == [10] * 8
    # a config that under-reports its layers: the missing ones are created on demand
    short = hf_qattn.QAttnCache(llama_config(layers=1))
    k, v = _states(1, 2, 5, 16)
    short.update(k, v, 3)
    assert len(short.layers) == 4 and short.layers[3].get_seq_length() == 5


def _states(b, h, n, d, dtype=torch.float32):
    k = torch.randn(b, h, n, d) + 4.0 * torch.randn(1, h, 1, d)
    v = torch.randn(b, h, n, d) + torch.randn(1, h, 1, d)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_tokens_are_quantized_once_with_the_first_centers(seed, precision):
    """Prefill returns the exact states; later steps return packed handles; the storage equals
    quantizing all tokens at once with the centers of the first fill — through growth of the buffers."""
    layer = qcache.QAttnLayer(precision)
    k, v = _states(2, 2, 300, 32)
    pieces = [(0, 200), (200, 201), (201, 205), (205, 300)]  # crosses the initial capacity of 256
    for i, (a, b) in enumerate(pieces):
        keys, values = layer.update(k[:, :, a:b], v[:, :, a:b])
        if i == 0:
            assert keys is not None and torch.equal(keys, k[:, :, :200])
        else:
            assert qcache.is_packed(keys) and qcache.is_packed(values)
            assert keys.shape == (2, 2, b, 32) and keys.dtype == k.dtype
    assert layer.get_seq_length() == 300 and layer.get_mask_sizes(1) == (301, 0)
    k_bar, v_bar = kv_reference.centers(k[:, :, :200], v[:, :, :200])
    store = layer.storage()
    assert store.length == 300 and store.capacity >= 300
    torch.testing.assert_close(store.k_bar, k_bar)
    once = kv_reference.allocate(2, 2, 320, 32, precision, "cpu", k.dtype)
    kv_reference.set_equalizers(once, k[:, :, :200], v[:, :, :200], k_bar, v_bar)  # the first fill's
    kv_reference.append(k, v, k_bar, v_bar, once, 0)
    group = kv_reference.GROUP
    whole = 300 // group * group
    for name, grouped in (("k", kv_reference.k_grouped(precision)), ("v", kv_reference.v_grouped(precision))):
        got, want = (getattr(x, name + "q") for x in (store, once))
        got_s, want_s = (getattr(x, name + "s") for x in (store, once))
        if grouped:  # the whole groups' values and scales, the incomplete group's rows exactly
            assert torch.equal(got[:, :, :whole], want[:, :, :whole]), name
            assert torch.equal(got_s[:, :, : 300 // group], want_s[:, :, : 300 // group]), name
            assert torch.equal(getattr(store, name + "_recent")[:, :, : 300 - whole],
                               getattr(once, name + "_recent")[:, :, : 300 - whole]), name
        else:  # per token: the values, their scales, the equalizers of the first fill (V's tiles as rows of slots)
            if name == "v":
                got, want = (kv_reference.token_major(t).flatten(2, 3) for t in (got, want))
            assert torch.equal(got[:, :, :300], want[:, :, :300]), name
            torch.testing.assert_close(got_s[:, :, :300], want_s[:, :, :300], rtol=1e-6, atol=0)
            assert torch.equal(getattr(store, name + "_eq"), getattr(once, name + "_eq")), name
    # the dequantized fallback rebuilds K and V to the format's resolution: half a step of the grid (per token
    # and channel, or per (group, channel) with the incomplete group exact)
    kd, vd = layer.dequantized()
    for name, got, original in (("k", kd, k), ("v", vd, v)):
        grouped = (kv_reference.k_grouped if name == "k" else kv_reference.v_grouped)(precision)
        if grouped:
            step = getattr(once, name + "s")[:, :, :, 0].float().repeat_interleave(group, dim=2)[:, :, :300]
            step[:, :, whole:] = 0.0
            assert ((got - original).abs() <= 0.5 * step * 1.001 + 1e-5).all(), name
        else:
            step = getattr(once, name + "s")[:, :, :300, None] * getattr(once, name + "_eq")[:, :, None, :]
            assert ((got - original).abs() <= 0.5 * step * 1.001 + 1e-5).all(), name


@pytest.mark.parametrize("precision", ["int4", "int8g"])
def test_crop_back_into_a_quantized_group(seed, precision):
    """Cropping to inside a group quantized already puts the kept tokens of its grouped tensors back in the
    recent rows (dequantized); the group then completes anew from them and the new tokens: each token within
    half a step of each quantization it went through."""
    layer, group = qcache.QAttnLayer(precision), kv_reference.GROUP
    k, v = _states(1, 2, 150, 32)
    layer.update(k, v)
    before = layer.dequantized()
    steps_before = [getattr(layer.storage(), n + "s")[:, :, 1, 0].float()  # group 1's, where grouped
                    if getattr(layer.storage(), n + "s").dim() == 5 else None for n in ("k", "v")]
    layer.crop(-50)  # 100 tokens: inside group 1 (slots 64–127)
    for got, was in zip(layer.dequantized(), before):
        torch.testing.assert_close(got, was[:, :, :100], rtol=0, atol=1e-5)
    k2, v2 = _states(1, 2, 40, 32)
    layer.update(k2, v2)  # 140 tokens: group 1 completes again
    store = layer.storage()
    for i, (name, got, original) in enumerate(zip(("k", "v"), layer.dequantized(), (torch.cat([k[:, :, :100], k2], 2),
                                                                                    torch.cat([v[:, :, :100], v2], 2)))):
        if not (kv_reference.k_grouped if name == "k" else kv_reference.v_grouped)(precision):
            continue
        step = getattr(store, name + "s")[:, :, 1, 0].float()[:, :, None]  # (1, 2, 1, 32)
        err = (got[:, :, group: 2 * group] - original[:, :, group: 2 * group]).abs()
        assert (err[:, :, :36] <= 0.5 * (step + steps_before[i][:, :, None]) * 1.001 + 1e-5).all(), name
        assert (err[:, :, 36:] <= 0.5 * step * 1.001 + 1e-5).all(), name


def test_equalizers_of_a_first_fill(seed):
    """σ of the per-token formats (formats.KV_EQ_FLOOR): each channel's largest |x − x̄| over the first fill, floored
    at 1/64 of the head's largest; 1 for a fill shorter than KV_EQ_MIN_TOKENS; NaN where the fill holds a NaN."""
    from hf_qattn.kernels.formats import KV_EQ_FLOOR, KV_EQ_MIN_TOKENS

    xc = torch.randn(2, 3, 40, 16)
    xc[..., 0] *= 10.0  # an outlier channel (its σ / 64 below every other channel's)
    xc[..., 1] *= 1e-4  # a channel all but constant: floored
    sigma = kv_reference.equalizers(xc)
    top = xc[..., 0].abs().amax(-1)
    assert torch.equal(sigma[..., 0], top) and torch.equal(sigma[..., 2:], xc[..., 2:].abs().amax(-2))
    assert torch.equal(sigma[..., 1], top * KV_EQ_FLOOR)
    assert torch.equal(kv_reference.equalizers(xc[:, :, : KV_EQ_MIN_TOKENS - 1]), torch.ones(2, 3, 16))
    xc[1, 2, 7, 5] = float("nan")
    sigma = kv_reference.equalizers(xc)
    assert torch.isnan(sigma[1, 2]).all() and not torch.isnan(sigma[0]).any() and not torch.isnan(sigma[1, :2]).any()


def test_nbytes_and_the_memory_targets():
    """Bytes per token: INT8 K + INT8 V + two fp32 scales; INT4 halves K. Against a bf16 cache (d128)."""
    b, h, n, d = 1, 2, 40, 128
    k, v = _states(b, h, n, d, torch.bfloat16)
    cache = hf_qattn.QAttnCache(llama_config(layers=2, head_dim=d, hidden_size=256, num_attention_heads=2),
                                plan=QAttnPlan(default="int8", layers={1: "int4"}, num_layers=2))
    for index in range(2):
        cache.update(k, v, index)
    per_layer = cache.nbytes(per_layer=True, used=True)
    centers = 2 * b * h * d * 4
    equalizers = {"int8": 2 * b * h * d * 2, "int4": b * h * d * 2}  # σ_K and σ_V bf16; INT4: σ_V
    group = kv_reference.GROUP
    recent = b * h * group * d * 2  # INT4: the incomplete group's K in bf16
    # INT4 per token: K's nibbles, V, V's scale, and per group a bf16 scale and zero a channel
    int4_slot = d // 2 + d + 4 + 2 * d * 2 / group
    fixed = [centers + equalizers["int8"], recent + centers + equalizers["int4"]]
    assert per_layer == [b * h * n * (d + d + 8) + fixed[0], int(b * h * n * int4_slot) + fixed[1]]
    assert cache.nbytes(used=True) == sum(per_layer)
    # allocated: whole blocks (per-token V's tiles; INT4's groups), every byte of the layers' tensors counted
    blocks = -(-n // kv_reference.block_tokens("int8")) * kv_reference.block_tokens("int8")
    assert cache.nbytes(per_layer=True) == [b * h * blocks * (d + d + 8) + fixed[0],
                                            int(b * h * group * int4_slot) + fixed[1]]
    assert cache.nbytes() == sum(_tensor_bytes(layer) for layer in cache.layers)
    bf16 = b * h * n * d * 2 * 2
    assert (per_layer[0] - fixed[0]) / bf16 <= 0.55 and (per_layer[1] - fixed[1]) / bf16 <= 0.41
    dynamic = hf_qattn.QAttnCache(llama_config(layers=1, head_dim=d, hidden_size=256, num_attention_heads=2),
                                  plan=UNQUANTIZED)
    dynamic.update(k, v, 0)
    assert dynamic.nbytes() == bf16


def _tensor_bytes(layer) -> int:
    """Bytes of every tensor a QAttnLayer holds (what its storage takes from the device)."""
    store = layer.storage()
    return sum(t.numel() * t.element_size() for t in (store.kq, store.ks, store.vq, store.vs, store.k_recent,
                                                       store.v_recent, store.k_eq, store.v_eq, store.k_bar,
                                                       store.v_bar) if t is not None)


@pytest.mark.parametrize("prompt", [4096, 4000, 300, 64])
def test_generation_never_doubles_the_cache(prompt):
    """A prompt, then 256 tokens (the first alone, as generate's first step; then in 15 appends of 17):
    nbytes() reports what is allocated, which from 1,000 tokens on stays ≤ 0.56× (INT8 K) / ≤ 0.45× (INT4 K)
    of a bf16 cache of the same tokens after every append, and ends there. Below 1,000 tokens a block
    (64 tokens: per-token V's tile, INT4's group) is more than the bounds' slack, and INT4 holds its incomplete group's
    K in the model's dtype (16 KiB a head at d128 in bf16), a fixed cost: there INT8 still ends ≤ 0.56×, INT4
    ≤ 0.45× plus that buffer and the centers. Doubling the capacity at the first generated token held 1.03×
    at a 4,096-token prompt. int8g (8-bit K and V groups) is held to its own arithmetic."""
    b, h, d = 1, 1, 128
    bf16_per_token = b * h * d * 2 * 2
    for precision, bound in (("int8", 0.56), ("int4", 0.45)):
        layer = qcache.QAttnLayer(precision)
        layer.update(*_states(b, h, prompt, d))
        for tokens in [1] + [17] * 15:
            layer.update(*_states(b, h, tokens, d))
            allocated = _tensor_bytes(layer)
            assert layer.nbytes() == allocated
            ratio = allocated / (bf16_per_token * layer.get_seq_length())
            assert ratio <= bound or layer.get_seq_length() < 1000, (precision, layer.get_seq_length(), ratio)
        assert layer.get_seq_length() == prompt + 256
        store = layer.storage()
        fixed = sum(t.numel() * t.element_size() for t in (store.k_recent, store.k_bar, store.v_bar)
                    if t is not None)
        if precision == "int8" or layer.get_seq_length() >= 1000:
            assert ratio <= bound, (precision, prompt, ratio)
        else:
            assert allocated - fixed <= bound * bf16_per_token * layer.get_seq_length(), (prompt, allocated, fixed)
        assert layer.nbytes(used=True) <= layer.nbytes()
    # 8-bit K and V groups: 2 · (D + 2 · 2 · D / 64) bytes a token (0.53× of bf16 at d128), at most a growth step
    # more, and the two incomplete groups in the model's dtype and the centers beside (bf16 model, 4,096 + 256
    # tokens: 0.546× of bf16 allocated)
    layer = qcache.QAttnLayer("int8g")
    layer.update(*_states(b, h, prompt, d))
    per_token = 2 * (d + 2 * 2 * d / kv_reference.GROUP)
    for tokens in [1] + [17] * 15:
        layer.update(*_states(b, h, tokens, d))
        store = layer.storage()
        fixed = sum(t.numel() * t.element_size() for t in (store.k_recent, store.v_recent, store.k_bar, store.v_bar))
        assert layer.nbytes() == _tensor_bytes(layer)
        # capacity: the tokens, a growth step of a sixteenth or a group, rounded up to whole groups
        allowed = per_token * (layer.get_seq_length() * (1 + 1 / 16) + 2 * kv_reference.GROUP) + fixed
        assert layer.nbytes() <= allowed, (prompt, layer.get_seq_length(), layer.nbytes(), allowed)


def test_static_storage_is_preallocated_and_bounded(seed):
    block = kv_reference.block_tokens("int8")
    layer = qcache.QAttnLayer("int8", max_len=block + 8)
    k, v = _states(1, 2, block + 4, 16)
    layer.update(k, v)
    buffer = layer.storage().kq
    assert layer.storage().capacity == layer.get_max_length() == 2 * block  # whole blocks
    layer.update(k[:, :, :block - 4], v[:, :, :block - 4])
    assert layer.storage().kq is buffer  # filled in place, to its capacity
    with pytest.raises(qcache.QAttnCacheError, match="static_max_len"):
        layer.update(k[:, :, :1], v[:, :, :1])


def test_advance_after_replay_moves_the_host_count_only(seed):
    """A replayed CUDA graph step already appended its token and advanced the device count: the layer's
    host count (what masks and positions are built from) follows, the device count is left alone."""
    layer = qcache.QAttnLayer("int8", max_len=8)
    k, v = _states(1, 2, 3, 16)
    layer.update(k, v)
    layer.advance_after_replay(2)
    assert layer.get_seq_length() == 5 and layer.get_mask_sizes(1) == (6, 0)
    assert layer.storage().length == 5 and layer.storage().device_length.tolist() == [3]


def test_packed_handles_refuse_other_attention_implementations(seed):
    layer = qcache.QAttnLayer("int8")
    k, v = _states(1, 2, 10, 16)
    layer.update(k, v)
    keys, values = layer.update(k[:, :, :1], v[:, :, :1])
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(qcache.QAttnCacheError, match="attn_implementation='qattn'"):
        torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    with pytest.raises(qcache.QAttnCacheError):
        torch.matmul(q, keys.transpose(-1, -2))


def test_reorder_and_crop(seed):
    layer = qcache.QAttnLayer("int4")
    k, v = _states(3, 2, 12, 16)
    layer.update(k, v)
    kq = layer.storage().kq.clone()
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.storage().kq, kq[[2, 0, 1]]) and layer.storage().k_bar.shape[0] == 3
    layer.crop(-5)
    assert layer.get_seq_length() == 7


# --- generation through the qattn attention function ---------------------------------------------


def _tiny_lm(attn="qattn", **overrides):
    # a wider initializer than the default makes the random model's logits more peaked
    config = llama_config(layers=2, initializer_range=0.1, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _greedy(model, ids, cache, steps):
    """``steps`` greedy tokens, all of them, and each step's logits: a random model may emit its end-of-sequence
    token, which must not end the run early (callers count the cache's tokens and the decode steps); the logits
    are the model's, before the processor that holds that token back sets it to −inf."""
    with torch.no_grad():
        out = model.generate(ids, **{CACHE_KW: cache}, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def test_generate_agrees_with_the_dynamic_cache(seed, fresh_stats):
    """Greedy tokens equal the DynamicCache run's, up to the first step where the reference itself
    has a near-tie (two logits within 10 % of the logit range): random tiny models have some. The
    logits stay within 10 % of their range of the DynamicCache run's (both quantize: measured 2–4 %)."""
    model = _tiny_lm()
    ids = torch.randint(1, 128, (1, 12))
    base, base_scores = _greedy(model, ids, transformers.DynamicCache(config=model.config), 6)
    cache = hf_qattn.QAttnCache(model)
    tokens, scores = _greedy(model, ids, cache, 6)
    differ = (tokens != base)[0].nonzero()
    checked = 6 if len(differ) == 0 else int(differ[0])
    if checked < 6:
        ref = base_scores[0, checked]
        gap = ref[base[0, checked]] - ref[tokens[0, checked]]
        assert gap < 0.1 * (ref.max() - ref.min()), (checked, tokens, base, gap)
    # logits of the steps both runs took with the same history agree closely
    rng = base_scores[0, :checked + 1].amax(-1) - base_scores[0, :checked + 1].amin(-1)
    err = (scores[0, :checked + 1] - base_scores[0, :checked + 1]).abs().amax(-1) / rng
    assert (err < 0.1).all(), err
    assert cache.get_seq_length() == 12 + 5 and cache.nbytes() > 0
    # the decode steps went to the decode kernel over the packed storage: 5 steps × 2 layers
    assert fresh_stats()["calls"].get("triton", 0) + fresh_stats()["calls"].get("reference", 0) >= 10
    assert not fresh_stats()["fallbacks"]


def _teacher_forced_logits(model, ids, mask, cache, steps):
    """Prefill then ``steps`` decode steps fed the tokens ``steps`` (B, S); the logits of every step."""
    out = []
    with torch.no_grad():
        for i in range(steps.shape[1] + 1):
            full = torch.cat([mask, torch.ones(mask.shape[0], i, dtype=mask.dtype)], dim=1)
            positions = (full.cumsum(-1) - 1).clamp_min(0)
            chunk = ids if i == 0 else steps[:, i - 1: i]
            logits = model(chunk, attention_mask=full, position_ids=positions[:, -chunk.shape[1]:],
                           **{CACHE_KW: cache}, use_cache=True).logits[:, -1]
            out.append(logits)
    return torch.stack(out, dim=1)


def test_left_padded_batch_with_a_mixed_plan(seed):
    plan = QAttnPlan(default="int8", layers={1: "int4"}, num_layers=2).to_dict()
    model = _tiny_lm(qattn_plan=plan)
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding of the second sequence
    ids[1, :4] = 0
    steps = torch.randint(1, 128, (2, 4))
    cache = hf_qattn.QAttnCache(model)
    assert cache.precisions() == ["int8", "int4"]
    logits = _teacher_forced_logits(model, ids, mask, cache, steps)
    base = _teacher_forced_logits(model, ids, mask, transformers.DynamicCache(config=model.config), steps)
    scale = base.abs().amax(-1, keepdim=True)
    err = ((logits - base).abs() / scale).amax()
    assert err < 0.15, err  # INT4 K in layer 1
    # the padded sequence run alone, unpadded: the padding is really masked out
    alone = _teacher_forced_logits(model, ids[1:, 4:], mask[1:, 4:], hf_qattn.QAttnCache(model), steps[1:])
    assert ((alone - base[1:]).abs() / scale[1:]).amax() < 0.15
    # a mask that let the padding in would be far off: the bound above is meaningful
    unmasked = _teacher_forced_logits(model, ids[1:], torch.ones(1, 10, dtype=torch.long),
                                      hf_qattn.QAttnCache(model), steps[1:])
    assert ((unmasked - base[1:]).abs() / scale[1:]).amax() > 0.3


def test_decode_step_matches_float64_attention_on_the_cache(seed):
    """One forward step with the packed cache equals the model run with exact attention over the
    dequantized cache (the decode kernel vs float64, through the whole integration)."""
    model = _tiny_lm()
    ids = torch.randint(1, 128, (2, 9))
    cache = hf_qattn.QAttnCache(model)
    with torch.no_grad():
        model(ids, **{CACHE_KW: cache}, use_cache=True)
        step = torch.randint(1, 128, (2, 3))  # three tokens at once: causal, bottom-right
        logits = model(step, **{CACHE_KW: cache}, use_cache=True).logits
    # replay: a DynamicCache holding the dequantized tokens of the quantized cache, eager attention in float32
    replay = transformers.DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        k, v = layer.dequantized()  # per-token scales: the first tokens dequantize alike without the last 3
        replay.update(k[:, :, :-3], v[:, :, :-3], index)
    eager = _tiny_lm(attn="eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = eager(step, **{CACHE_KW: replay}, use_cache=True).logits
    # the step's own tokens are quantized in the QAttnCache and not in the replay: loose but meaningful bound
    assert torch.allclose(logits, ref, atol=0.05 * ref.abs().max().item()), (logits - ref).abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_other_attention_implementations_get_a_clear_error(seed):
    model = _tiny_lm(attn="sdpa")
    ids = torch.randint(1, 128, (1, 6))
    with pytest.raises(qcache.QAttnCacheError, match="attn_implementation='qattn'"):
        _greedy(model, ids, hf_qattn.QAttnCache(model), 3)


def test_gradients_fall_back_to_the_dequantized_cache(seed, fresh_stats):
    model = _tiny_lm()
    ids = torch.randint(1, 128, (1, 6))
    cache = hf_qattn.QAttnCache(model)
    with torch.no_grad():
        model(ids, **{CACHE_KW: cache}, use_cache=True)
    out = model(torch.randint(1, 128, (1, 1)), **{CACHE_KW: cache}, use_cache=True)
    out.logits.sum().backward()  # autograd: served in full precision from the dequantized cache
    assert fresh_stats()["fallbacks"]


def _stepped_logits(model, ids, cache, steps, step_fn=None):
    """Prefill, then one decode step per token of ``steps`` (B, S): the logits of every step's token."""
    with torch.no_grad():
        out = [model(ids, **{CACHE_KW: cache}, use_cache=True).logits[:, -1]]
        step_fn = step_fn or (lambda token: model(token, **{CACHE_KW: cache}, use_cache=True).logits)
        for i in range(steps.shape[1]):
            out.append(step_fn(steps[:, i: i + 1])[:, -1].clone())
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("plan,layout", [("int8", "tokens"), ("int4", "tokens"), ("int8", "groups")])
def test_static_storage_keeps_the_token_count_on_the_device(seed, plan, layout):
    """With static storage the kernels read the token count from device memory (what lets a CUDA graph
    replay a step): decoding gives the growing cache's logits, and the device count follows every
    update, crop and reset."""
    model = _tiny_lm()
    ids = torch.randint(1, 128, (2, 11))
    steps = torch.randint(1, 128, (2, 5))
    growing = _stepped_logits(model, ids, hf_qattn.QAttnCache(model, plan=plan, int8_layout=layout), steps)
    static = hf_qattn.QAttnCache(model, plan=plan, static_max_len=40, int8_layout=layout)
    logits = _stepped_logits(model, ids, static, steps)
    rng = growing.amax(-1, keepdim=True) - growing.amin(-1, keepdim=True)
    assert ((logits - growing).abs() / rng).amax() < 1e-3
    for layer in static.layers:
        store = layer.storage()
        assert store.length == 16 and store.device_length.tolist() == [16]
        assert store.capacity == kv_reference.block_tokens(store.precision)  # whole blocks (40 slots asked)
    static.crop(-3)
    assert [layer.storage().device_length.item() for layer in static.layers] == [13, 13]
    static.reset()
    assert [layer.storage().device_length.item() for layer in static.layers] == [0, 0]


def test_captured_decode_step_runs_the_step_it_captures(seed, monkeypatch):
    """CapturedDecodeStep's eager warm-up steps (the step it captures, with the token and positions in
    fixed buffers) give the plain decode loop's logits; on a CPU cache it refuses to be built (CUDA
    graphs), and the capture itself checks again; the arguments are checked."""
    from hf_qattn.kv_cache import captured

    model = _tiny_lm()
    ids = torch.randint(1, 128, (2, 11))
    steps = torch.randint(1, 128, (2, 3))
    base = _stepped_logits(model, ids, hf_qattn.QAttnCache(model, static_max_len=20), steps)
    cache = hf_qattn.QAttnCache(model, static_max_len=20)
    with pytest.raises(qcache.QAttnCacheError, match="prefill"):
        hf_qattn.CapturedDecodeStep(model, cache)
    filled = hf_qattn.QAttnCache(model, static_max_len=20)
    with torch.no_grad():
        model(ids, **{CACHE_KW: filled}, use_cache=True)
    with pytest.raises(qcache.QAttnCacheError, match="CUDA device; it is on cpu"):
        hf_qattn.CapturedDecodeStep(model, filled)  # when built, not at the call that would capture
    monkeypatch.setattr(captured, "_capture_device_ok", lambda device: True)  # the warm-up steps run anywhere
    holder = {}

    def step(token):
        if "step" not in holder:
            holder["step"] = hf_qattn.CapturedDecodeStep(model, cache, warmup=3)
        return holder["step"](token)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step passes the cache under the keyword the model documents
        logits = _stepped_logits(model, ids, cache, steps, step)
    torch.testing.assert_close(logits, base, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 14
    # a step run on the cache by other code in between: the next step's position follows the cache
    more = torch.randint(1, 128, (2, 2))
    reference = hf_qattn.QAttnCache(model, static_max_len=20)
    expected = _stepped_logits(model, ids, reference, torch.cat([steps, more], 1))[:, -1]
    with torch.no_grad():
        holder["step"] = hf_qattn.CapturedDecodeStep(model, cache, warmup=1)
        model(more[:, :1], **{CACHE_KW: cache}, use_cache=True)
        torch.testing.assert_close(holder["step"](more[:, 1:])[:, -1], expected, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 16
    with pytest.raises(qcache.QAttnCacheError, match="CUDA"):
        holder["step"](steps[:, :1])  # the fourth call would capture
    with pytest.raises(ValueError, match="input_ids must have shape"):
        holder["step"](steps[:1, :1])
    with pytest.raises(qcache.QAttnCacheError, match="static_max_len"):
        hf_qattn.CapturedDecodeStep(model, hf_qattn.QAttnCache(model))
    mixed = hf_qattn.QAttnCache(model, plan=QAttnPlan(default="int8", layers={1: UNQUANTIZED}, num_layers=2),
                                static_max_len=20)
    with pytest.raises(qcache.QAttnCacheError, match="every cache layer quantized"):
        hf_qattn.CapturedDecodeStep(model, mixed)
    with pytest.raises(TypeError, match="QAttnCache"):
        hf_qattn.CapturedDecodeStep(model, transformers.DynamicCache(config=model.config))


def test_captured_step_runs_only_the_step_it_loaded(seed, monkeypatch):
    """captured_generate loads a step's tokens before its stop test and runs the step after it: a run with
    nothing loaded, or after the cache moved on since the load, is refused instead of replaying stale inputs;
    a load then a run is the plain call."""
    from hf_qattn.kv_cache import captured

    monkeypatch.setattr(captured, "_capture_device_ok", lambda device: True)
    model = _tiny_lm()
    ids, steps = torch.randint(1, 128, (1, 9)), torch.randint(1, 128, (1, 2))
    base = _stepped_logits(model, ids, hf_qattn.QAttnCache(model, static_max_len=16), steps)
    cache = hf_qattn.QAttnCache(model, static_max_len=16)
    with torch.no_grad():
        model(ids, **{CACHE_KW: cache}, use_cache=True)
        step = hf_qattn.CapturedDecodeStep(model, cache, warmup=4)
        with pytest.raises(qcache.QAttnCacheError, match="no step is loaded"):
            step._run()
        step._load(steps[:, :1])
        torch.testing.assert_close(step._run()[:, -1], base[:, 1], rtol=0, atol=1e-5)
        with pytest.raises(qcache.QAttnCacheError, match="no step is loaded"):
            step._run()  # a load serves one run
        step._load(steps[:, 1:])
        model(steps[:, 1:], **{CACHE_KW: cache}, use_cache=True)  # other code steps the cache in between
        with pytest.raises(qcache.QAttnCacheError, match="no step is loaded"):
            step._run()
    assert cache.get_seq_length() == 11


def test_captured_step_refuses_a_step_past_the_static_storage(seed, monkeypatch):
    """A full static cache (its every slot holds a token) refuses the next step, before anything is written."""
    from hf_qattn.kv_cache import captured

    monkeypatch.setattr(captured, "_capture_device_ok", lambda device: True)
    model = _tiny_lm()
    block = kv_reference.block_tokens("int8")  # a static cache's storage: whole blocks
    cache = hf_qattn.QAttnCache(model, static_max_len=block)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, block - 1)), **{CACHE_KW: cache}, use_cache=True)
    step = hf_qattn.CapturedDecodeStep(model, cache, warmup=4)
    step(torch.randint(1, 128, (1, 1)))  # the last slot
    with pytest.raises(qcache.QAttnCacheError, match=f"static_max_len={block}.* is full"):
        step(torch.randint(1, 128, (1, 1)))
    assert cache.get_seq_length() == block


def test_captured_step_refuses_a_mask_it_cannot_replay(seed):
    """Inside CapturedDecodeStep a mask reading with key ranges (a padded batch) is refused, not replayed
    as the plain causal mask; outside it the reading passes through unchanged."""
    from hf_qattn.kv_cache import attention as kv_attention
    from hf_qattn.masks import MaskPattern

    layer = qcache.QAttnLayer("int8")
    k, v = _states(2, 2, 10, 16)
    layer.update(k, v)
    key, _ = layer.update(k[:, :, :1], v[:, :, :1])
    query = torch.randn(2, 4, 1, 16)
    padded = MaskPattern(False, 11, kv_start=torch.tensor([0, 3]))
    assert kv_attention.step_pattern(query, key, lambda: (padded, None)) == (padded, None)
    token = kv_attention._captured_step.set(True)
    try:
        with pytest.raises(qcache.QAttnCacheError, match="padded batches"):
            kv_attention.step_pattern(query, key, lambda: (padded, None))
        with pytest.raises(qcache.QAttnCacheError, match="padded batches"):
            kv_attention.step_pattern(query, key, lambda: (None, "attention mask of unexpected shape or type"))
        plain = MaskPattern(False, 11)
        assert kv_attention.step_pattern(query, key, lambda: (plain, None)) == (plain, None)
    finally:
        kv_attention._captured_step.reset(token)
