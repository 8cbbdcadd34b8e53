"""torch.compile: the launch as the op ``hf_qattn::attention`` (registration, fake implementation,
opcheck on the CPU reference path) and whole-model traces with no graph break. The kernels' own
compile runs (CUDA graphs, timings) are in eval/check_compile.py, on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hf_qattn
from hf_qattn import ops
import transformers  # noqa: E402
from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before

OP = torch.ops.hf_qattn.attention.default


def _qkv(layout="HND", b=2, hq=4, hk=2, n=12, d=16, dtype=torch.float32):
    shape = (lambda h: (b, h, n, d)) if layout == "HND" else (lambda h: (b, n, h, d))
    return (torch.randn(shape(hq), dtype=dtype), torch.randn(shape(hk), dtype=dtype),
            torch.randn(shape(hk), dtype=dtype))


def _args(q, k, v, *, layout="HND", kv_start=None, kv_end=None, return_lse=True, qk="int8", pv="fp8",
          causal=True):
    return (q, k, v, kv_start, kv_end, "reference", causal, 0.25, qk, pv, layout, True, True, True, return_lse)


def test_op_is_registered():
    assert hasattr(torch.ops.hf_qattn, "attention")
    schema = str(OP._schema)
    assert "Tensor? kv_start" in schema and "-> (Tensor, Tensor)" in schema
    assert torch._library.utils.is_builtin(OP) is False


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fake_shapes(layout, return_lse, dtype):
    with FakeTensorMode():
        q, k, v = _qkv(layout, b=3, hq=6, hk=2, n=10, d=32, dtype=dtype)
        out, lse = OP(*_args(q, k, v, layout=layout, return_lse=return_lse))
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.dtype == torch.float32
    assert tuple(lse.shape) == ((3, 6, 10) if return_lse else (0,))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fake_matches_real(layout):
    q, k, v = _qkv(layout)
    out, lse = OP(*_args(q, k, v, layout=layout))
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fout, flse = OP(*_args(fq, fk, fv, layout=layout))
    assert (fout.shape, fout.dtype, fout.stride()) == (out.shape, out.dtype, out.stride())
    assert (flse.shape, flse.dtype) == (lse.shape, lse.dtype)


@pytest.mark.parametrize("case", ["causal-lse", "nhd-range", "int4-fp16"])
def test_opcheck_reference(case):
    if case == "causal-lse":
        q, k, v = _qkv("HND")
        args = _args(q, k, v, kv_end=torch.tensor([7, 12]))
    elif case == "nhd-range":
        q, k, v = _qkv("NHD", dtype=torch.bfloat16)
        args = _args(q, k, v, layout="NHD", kv_start=torch.tensor([2, 0]), kv_end=torch.tensor([12, 9]),
                     return_lse=False, causal=False)
    else:
        q, k, v = _qkv("HND", dtype=torch.float16)
        args = _args(q, k, v, qk="int4", pv="fp16")
    torch.library.opcheck(OP, args)


def test_op_equals_eager_qattn():
    q, k, v = _qkv("NHD")
    end = torch.tensor([5, 12])
    eager = hf_qattn.qattn(q, k, v, layout="NHD", is_causal=True, kv_end=end, return_lse=True)
    out, lse = OP(q, k, v, None, end, "reference", True, 0.25, "int8", "fp8", "NHD", True, True, True, True)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


def test_compiled_qattn_no_break(fresh_stats):
    q, k, v = _qkv("HND")
    end = torch.tensor([9, 12])

    def fn(q, k, v, end):
        return hf_qattn.qattn(q, k, v, is_causal=True, kv_end=end)

    explanation = torch._dynamo.explain(fn)(q, k, v, end)
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, end), fn(q, k, v, end))


def test_record_counts_once_per_traced_site(fresh_stats):
    def fn(x):
        ops.record("sdpa", "a test reason")
        return x + 1

    with pytest.warns(RuntimeWarning, match="a test reason"):
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        compiled(torch.ones(2))
    compiled(torch.ones(2))
    assert hf_qattn.fallback_stats()["fallbacks"] == {"a test reason": 1}


def _llama(tiny_model):
    return tiny_model("llama", head="lm", attn="qattn")


def _compiled_without_breaks(forward, *args):
    """forward(*args) compiled with fullgraph=True, after asserting dynamo sees no graph break."""
    explanation = torch._dynamo.explain(forward)(*args)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    torch._dynamo.reset()
    hf_qattn.reset_fallback_stats()  # explain traced too, and counts once per traced call site: count the compile only
    return torch.compile(forward, backend="aot_eager", fullgraph=True)(*args)


@pytest.mark.parametrize("padded", [False, True])
def test_llama_compiles_without_breaks(tiny_model, fresh_stats, padded):
    model = _llama(tiny_model)
    ids = torch.randint(0, 128, (2, 12))
    mask = None
    if padded:
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :3] = 0  # left padding: a key range per sequence

    def forward(ids, mask):
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    with torch.no_grad():
        got, want = _compiled_without_breaks(forward, ids, mask), forward(ids, mask)
    assert torch.equal(got, want)
    calls = hf_qattn.fallback_stats()["calls"]
    assert set(calls) == {"reference"} and not hf_qattn.fallback_stats()["fallbacks"]


def test_llama_float_mask_under_compile_falls_back_without_breaks(tiny_model, fresh_stats):
    """An additive 4D mask is analysed by value in eager mode; inside a graph it falls back to SDPA, counted."""
    from hf_qattn.masks import visible_keys

    model = _llama(tiny_model)
    ids = torch.randint(0, 128, (2, 10))
    visible = visible_keys(2, 10, 10, is_causal=True, kv_start=torch.tensor([0, 3]))
    additive = torch.zeros(2, 1, 10, 10).masked_fill(~visible, torch.finfo(torch.float32).min)

    def forward(ids, mask):
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="float"):
            got = _compiled_without_breaks(forward, ids, additive)
        model.set_attn_implementation("sdpa")
        want = forward(ids, additive)
    torch.testing.assert_close(got, want)
    # counted once per traced call site: one per layer
    assert hf_qattn.fallback_stats()["fallbacks"] == {
        "under torch.compile: float (additive) attention mask": model.config.num_hidden_layers}


def test_llama_static_cache_decode_step_without_breaks(tiny_model, fresh_stats):
    import transformers as tf

    model = _llama(tiny_model)
    cache = tf.StaticCache(config=model.config, max_cache_len=24)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        logits = model(input_ids=ids, **{CACHE_KW: cache}, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)

        def step(token, position):
            return model(input_ids=token, **{CACHE_KW: cache}, cache_position=position, use_cache=True).logits

        explanation = torch._dynamo.explain(step)(token, torch.tensor([6]))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert not hf_qattn.fallback_stats()["fallbacks"]


def test_wan_denoiser_compiles_without_breaks(fresh_stats):
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                            in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                            num_layers=2, rope_max_seq_len=32).eval()
    x, t, text = torch.randn(1, 4, 3, 8, 8), torch.tensor([500.0]), torch.randn(1, 8, 32)

    def forward(x, t, text):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with hf_qattn.patch(model), torch.no_grad():
        want = forward(x, t, text)
        explanation = torch._dynamo.explain(forward)(x, t, text)
        assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
        torch._dynamo.reset()
        got = torch.compile(forward, backend="aot_eager", fullgraph=True)(x, t, text)
    assert torch.equal(got, want)
    assert set(hf_qattn.fallback_stats()["calls"]) == {"reference"}
