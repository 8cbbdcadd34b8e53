"""A QAttnCache layer's eager decode step replayed from its CUDA graph (hf_qattn/kv_cache/step_graph.py): the
logits of the step launched from Python, every step — across storage growth, a change of batch, a padded step —
and no reader of the storage ever sees it without the deferred token.

On a GPU the steps replay real graphs; on the CPU (kernels under the interpreter) the layer's recorded step runs as
it is (``step_graph._device_ok`` patched), which checks everything but the capture."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_qattn  # noqa: E402
from hf_qattn.kv_cache import cache as qcache, step_graph  # noqa: E402
from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHE_KW = cache_argument(transformers.LlamaForCausalLM)
# logits of the graphed steps against steps launched eagerly: the same kernels, but the eager steps plan the decode's
# splits by the host's count, the graphed ones by the capacity (another float32 summation order)
ATOL = 2e-3


@pytest.fixture(autouse=True)
def graphs_anywhere(monkeypatch):
    monkeypatch.setattr(step_graph, "_device_ok", lambda device: True)
    monkeypatch.setenv("HF_QATTN_STEP_GRAPHS", "1")


def _model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="qattn").eval().to(DEVICE)


def _steps(model, monkeypatch, graphs: bool, prompt, tokens, precision="int8", **cache_options):
    """Logits of a prefill and one-token steps feeding ``tokens`` (B, steps), and the cache."""
    monkeypatch.setenv("HF_QATTN_STEP_GRAPHS", "1" if graphs else "0")
    cache = hf_qattn.QAttnCache(model, plan=precision, **cache_options)
    out = []
    with torch.no_grad():
        out.append(model(prompt, use_cache=True, **{CACHE_KW: cache}).logits[:, -1])
        for i in range(tokens.shape[1]):
            out.append(model(tokens[:, i:i + 1], use_cache=True, **{CACHE_KW: cache}).logits[:, -1])
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("precision,layout", [("int8", "tokens"), ("int4", "tokens"), ("int8", "groups")],
                         ids=["int8", "int4", "int8g"])
def test_graphed_steps_give_the_eager_steps_logits(monkeypatch, fresh_stats, precision, layout):
    """8 steps after a 60-token prompt: step 1 warms, step 2 captures, the 5th token grows the storage (the graph
    is dropped, warmed and captured again, then replayed by steps 7 and 8), and the grouped formats complete a group
    (64 tokens) in a replay."""
    model = _model()
    prompt = torch.randint(1, 128, (2, 60), device=DEVICE)
    tokens = torch.randint(1, 128, (2, 8), device=DEVICE)
    want, _ = _steps(model, monkeypatch, False, prompt, tokens, precision, int8_layout=layout)
    got, cache = _steps(model, monkeypatch, True, prompt, tokens, precision, int8_layout=layout)
    assert (got - want).abs().max() <= ATOL * want.abs().max(), (got - want).abs().max()
    assert cache.get_seq_length() == 68
    for layer in cache.layers:
        assert layer.pending() is None  # the last step's attention wrote it
        assert isinstance(layer.storage().launches.get("step graph"), step_graph._StepGraph)
        assert int(layer.storage().device_length) == layer.get_seq_length() == 68
    assert not fresh_stats()["fallbacks"]


@pytest.mark.parametrize("reader", ["dequantized", "storage", "crop", "batch selection"])
def test_every_reader_sees_the_deferred_token(monkeypatch, reader):
    """A token ``update`` deferred (counted, not yet written) is written by whatever reads or changes the storage
    first; a crop then removes it as a written token."""
    model = _model()
    _, cache = _steps(model, monkeypatch, True, torch.randint(1, 128, (1, 20), device=DEVICE),
                      torch.randint(1, 128, (1, 3), device=DEVICE))
    layer = cache.layers[0]
    k, v = (torch.randn(1, 2, 1, 16, device=DEVICE, dtype=layer.dtype) for _ in range(2))
    layer.update(k, v)
    assert layer.pending() is not None and layer.get_seq_length() == 24
    if reader == "dequantized":
        layer.dequantized()
    elif reader == "storage":
        layer.storage()
    elif reader == "crop":
        layer.crop(-1)
    else:
        layer.batch_select_indices(torch.tensor([0], device=DEVICE))
    assert layer.pending() is None
    length = 23 if reader == "crop" else 24
    assert layer.get_seq_length() == length == int(layer.storage().device_length)
    keys, values = layer.dequantized()
    if reader == "crop":  # the token before it is still the 23rd
        assert keys.shape[2] == 23
    else:  # the newest row is the token, to the INT8 K / FP8 V cache's rounding
        assert torch.allclose(keys[:, :, -1].float(), k[:, :, 0].float(), atol=0.02 * float(k.abs().max()) + 0.02)
        assert torch.allclose(values[:, :, -1].float(), v[:, :, 0].float(), atol=0.1 * float(v.abs().max()) + 0.02)


def test_a_padded_step_is_appended_eagerly_and_attended_as_before(monkeypatch, fresh_stats):
    """A left-padded batch: its steps' masks carry key ranges, which the graph does not reproduce: each such step
    appends the token eagerly, and the logits are those of steps launched eagerly throughout."""
    model = _model()
    ids = torch.randint(1, 128, (2, 12), device=DEVICE)
    mask = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0

    def run(graphs):
        monkeypatch.setenv("HF_QATTN_STEP_GRAPHS", "1" if graphs else "0")
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              **{CACHE_KW: hf_qattn.QAttnCache(model)})

    want, got = run(False), run(True)
    assert torch.equal(got.sequences, want.sequences)
    # with step graphs a layer keeps its count on the device and a step's splits span its capacity (whole 64-token
    # blocks), without them its length: the merge rounds differently (fp32, ≤ 1e-5 here); a padded key attended, or
    # one left out, moves these logits by 1e-2 and more
    assert torch.allclose(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=0)
    assert not fresh_stats()["fallbacks"]


def test_switched_off_or_in_a_window_layer_nothing_is_deferred(monkeypatch):
    model = _model()
    prompt = torch.randint(1, 128, (1, 20), device=DEVICE)
    _, cache = _steps(model, monkeypatch, False, prompt, torch.randint(1, 128, (1, 2), device=DEVICE))
    assert all(layer.storage().device_length is None for layer in cache.layers)
    window = qcache.QAttnWindowLayer("sliding_attention", 8)
    k, v = (torch.randn(1, 2, 4, 16, device=DEVICE) for _ in range(2))
    window.update(k, v)
    window.update(k[:, :, :1], v[:, :, :1])
    assert window.pending() is None



# --- a recorded step replayed by its call's key; its output handed out without a copy ----------------------------

from hf_qattn.integrations.transformers import attention as tf_attention  # noqa: E402


def _layer_steps(model, monkeypatch, graphs: bool, inputs, last_options=None, hold: int | None = None):
    """One cache layer driven through the attention function: a 20-token fill, then one-token steps ``inputs``
    [(q, k, v)], the last one with the call's keywords ``last_options``; the outputs (B, 1, Hq, D), each copied
    right after its step unless it is step ``hold`` (kept as a view of what the step returned), and the layer."""
    monkeypatch.setenv("HF_QATTN_STEP_GRAPHS", "1" if graphs else "0")
    layer = hf_qattn.QAttnCache(model, plan="int8").layers[0]
    module = model.model.layers[0].self_attn
    fill = torch.linspace(-1, 1, 20 * 16, device=DEVICE).reshape(1, 1, 20, 16).expand(1, 2, 20, 16)
    layer.update(fill, fill.flip(2))
    outs = []
    for i, (q, k, v) in enumerate(inputs):
        keys, values = layer.update(k, v)
        options = (last_options or {}) if i == len(inputs) - 1 else {}
        out = tf_attention.qattn_attention_forward(module, q, keys, values, None, scaling=0.25, **options)[0]
        outs.append(out.reshape(out.shape[0], -1) if i == hold else out.clone())
        del out  # as a model's layer drops it (the view kept for ``hold`` holds it)
    return outs, layer


def _inputs(steps):
    return [(torch.randn(1, 4, 1, 16, device=DEVICE), torch.randn(1, 2, 1, 16, device=DEVICE),
             torch.randn(1, 2, 1, 16, device=DEVICE)) for _ in range(steps)]


def _close(got, want):
    return bool((got - want).abs().max() <= ATOL * want.abs().max())


def test_a_step_with_the_recording_calls_key_replays_without_deciding_again(monkeypatch, fresh_stats):
    """Step 1 warms, step 2 records the graph with its call's key, steps 3–5 replay it without the decisions
    (call_variants is not called); the outputs are the eager steps'."""
    model = _model()
    inputs = _inputs(5)
    want, _ = _layer_steps(model, monkeypatch, False, inputs)
    decided = []
    real = tf_attention.call_variants
    monkeypatch.setattr(tf_attention, "call_variants", lambda *a, **k: decided.append(1) or real(*a, **k))
    hf_qattn.reset_fallback_stats()
    got, layer = _layer_steps(model, monkeypatch, True, inputs)
    assert len(decided) == 2  # the warm step and the recording step
    assert all(_close(g, w) for g, w in zip(got, want))
    assert layer.launch_memo()["step graph"].call is not None
    assert fresh_stats()["calls"].get("triton") == 5


@pytest.mark.parametrize("option", [dict(softcap=2.0), dict(output_attentions=True), dict(sliding_window=8)],
                         ids=["softcap", "output_attentions", "sliding_window"])
def test_a_call_with_another_key_is_decided_as_usual(monkeypatch, fresh_stats, option):
    """After steps 1–2 recorded the graph, a step 3 whose call sets a keyword the decisions read is not replayed:
    it is decided and attended as without graphs (soft-capped; a full-precision fallback; a window)."""
    model = _model()
    inputs = _inputs(3)
    plain, _ = _layer_steps(model, monkeypatch, False, inputs)
    want, _ = _layer_steps(model, monkeypatch, False, inputs, last_options=option)
    hf_qattn.reset_fallback_stats()
    got, _ = _layer_steps(model, monkeypatch, True, inputs, last_options=option)
    assert _close(got[2], want[2])
    if "softcap" in option:  # the keyword changes the answer: a replay of the plain graph would fail above
        assert not _close(want[2], plain[2])
    else:  # a full-precision fallback, counted (a replay would have counted a kernel call instead)
        reason = (tf_attention.REASON_OUTPUT_ATTENTIONS if "output_attentions" in option
                  else tf_attention.REASON_SLIDING_WINDOW)
        assert fresh_stats()["fallbacks"] == {reason: 1}


def test_the_decisions_read_no_keyword_the_replay_key_leaves_out(monkeypatch):
    """replay_key gives a key only to calls with none of _DECIDING_KEYWORDS set; every keyword the decisions read
    must be one of them, or a call setting it would replay a graph recorded without it."""
    read = set()

    class Recording(dict):
        def get(self, name, default=None):
            read.add(name)
            return super().get(name, default)

        def __getitem__(self, name):
            read.add(name)
            return super().__getitem__(name)

        def __contains__(self, name):
            read.add(name)
            return super().__contains__(name)

    model = _model()
    module = model.model.layers[0].self_attn
    q, k, v = (torch.randn(1, h, 1, 16, device=DEVICE) for h in (4, 2, 2))
    tf_attention.call_variants(module, q, k, v, 0.0, Recording())
    tf_attention.resolve_pattern(module, q, k, None, None, {})
    assert read and read <= set(tf_attention._DECIDING_KEYWORDS), read - set(tf_attention._DECIDING_KEYWORDS)
    assert tf_attention.replay_key(module, q, None, 0.0, 0.25, None, {"position_ids": 1}) is not None
    for name in tf_attention._DECIDING_KEYWORDS:
        assert tf_attention.replay_key(module, q, None, 0.0, 0.25, None, {name: 1}) is None
    assert tf_attention.replay_key(module, q, torch.ones(1, 1, 1, 21, dtype=torch.bool), 0.0, 0.25, None, {}) is None


def test_a_held_output_is_never_overwritten(monkeypatch):
    """The graph's output buffer is handed out as it is; a caller that keeps a step's output (a view of it) past
    the next step keeps its values: the layer records a new graph with a buffer of its own, which copies."""
    model = _model()
    inputs = _inputs(5)
    want, _ = _layer_steps(model, monkeypatch, False, inputs)
    got, layer = _layer_steps(model, monkeypatch, True, inputs, hold=2)  # step 3: the first replay
    assert _close(got[2].reshape(want[2].shape), want[2])  # steps 4 and 5 ran after it
    assert all(_close(g, w) for g, w in zip(got[3:], want[3:]))
    assert layer.launch_memo()["step graph"].copy_out


def test_without_torchs_storage_count_every_output_is_a_copy(monkeypatch):
    """A torch without ``torch._C._storage_Use_Count`` (a private function) gets graphs that copy their outputs:
    the same answers, no held-output check to run."""
    monkeypatch.setattr(step_graph, "_STORAGE_USES", None)
    model = _model()
    inputs = _inputs(4)
    want, _ = _layer_steps(model, monkeypatch, False, inputs)
    got, layer = _layer_steps(model, monkeypatch, True, inputs, hold=2)
    assert _close(got[2].reshape(want[2].shape), want[2]) and _close(got[3], want[3])
    graph = layer.launch_memo()["step graph"]
    assert graph.copy_out and not graph.held()
