"""hf_qattn.captured_generate: transformers' generate with its decode steps run by the package (CUDA graphs on a GPU,
eager steps here) gives the tokens of transformers' own loop over the same cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_qattn  # noqa: E402
from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402
from hf_qattn.kv_cache import reference as kv_reference  # noqa: E402
from hf_qattn.plan import PRECISIONS, QAttnPlan  # noqa: E402

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="qattn").eval().to(DEVICE)


def _generate(model, ids, captured: bool, **kwargs):
    extra = {"custom_generate": hf_qattn.captured_generate} if captured else {}
    return model.generate(ids, **{CACHE_KW: hf_qattn.QAttnCache(model)}, pad_token_id=0, **extra, **kwargs)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=20, temperature=0.8)],
                         ids=["greedy", "sampling"])
def test_captured_generate_gives_transformers_tokens(seed, fresh_stats, options):
    model = _model()
    ids = torch.randint(1, 128, (2, 11), device=DEVICE)
    torch.manual_seed(seed)
    # min_new_tokens: the random model's config has an EOS token it may draw
    want = _generate(model, ids, False, max_new_tokens=9, min_new_tokens=9, **options)
    torch.manual_seed(seed)
    got = _generate(model, ids, True, max_new_tokens=9, min_new_tokens=9, **options)
    assert got.shape == (2, 20) and torch.equal(got, want)
    assert fresh_stats()["fallbacks"] == {}


def test_captured_generate_stops_at_eos_and_pads_finished_rows(seed):
    model = _model()
    # no EOS of the config's: the run that picks one and the runs that stop at it share every logits processor
    # (min_new_tokens would mask the config's EOS in the first run only, and the greedy tokens could part)
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (2, 11), device=DEVICE)
    free = _generate(model, ids, False, max_new_tokens=8, do_sample=False)
    eos = int(free[0, 13])  # row 0's third new token (or an earlier one equal to it) ends its generation
    stop = 11 + int((free[0, 11:] == eos).nonzero()[0])
    want = _generate(model, ids, False, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    got = _generate(model, ids, True, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, want) and got[0, stop] == eos
    assert (got[0, stop + 1:] == 0).all()  # the finished row padded (nothing after it when every row stopped)


def test_captured_generate_returns_a_dict_with_the_cache(seed):
    model = _model()
    ids = torch.randint(1, 128, (1, 7), device=DEVICE)
    cache = hf_qattn.QAttnCache(model)
    out = model.generate(ids, **{CACHE_KW: cache}, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, custom_generate=hf_qattn.captured_generate)
    assert out.sequences.shape == (1, 11)
    # static storage for the prompt and max_new_tokens, in whole blocks; the last token is not appended (no step
    # needs it)
    block = kv_reference.block_tokens(cache.layers[0].precision)
    assert cache.layers[0].storage().capacity == block and cache.get_seq_length() == 10


def test_what_it_cannot_replay_runs_transformers_loop_counted(seed, fresh_stats):
    """A padded batch (rows at different positions) and a cache with full-precision layers: transformers' own
    loop on the same cache, the same tokens, one warning and a count per reason."""
    model = _model()
    ids = torch.randint(1, 128, (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = _generate(model, ids, False, max_new_tokens=5, do_sample=False, attention_mask=mask)
    with pytest.warns(RuntimeWarning, match="padded batch"):
        got = _generate(model, ids, True, max_new_tokens=5, do_sample=False, attention_mask=mask)
    assert torch.equal(got, want)
    mixed = hf_qattn.QAttnCache(model, plan=QAttnPlan(default="int8", layers={1: PRECISIONS[-1]}, num_layers=2))
    with pytest.warns(RuntimeWarning, match="every cache layer quantized"):
        model.generate(ids, **{CACHE_KW: mixed}, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       custom_generate=hf_qattn.captured_generate)
    reasons = fresh_stats()["fallbacks"]
    assert sorted(reasons) == ["captured_generate: a padded batch (rows at different positions)",
                               "captured_generate: static storage needs every cache layer quantized; this cache "
                               "also has ['DynamicLayer'] layers"]


@pytest.mark.parametrize("batch,options,mode", [
    (2, dict(num_beams=2), "beam search"),
    (2, dict(num_beams=2, do_sample=True, num_return_sequences=2), "beam sample"),
    (1, dict(prompt_lookup_num_tokens=3), "assisted generation")], ids=["beams", "beam-sample", "prompt-lookup"])
def test_other_generation_modes_run_transformers_method_counted(seed, fresh_stats, batch, options, mode):
    """transformers hands custom_generate every call whatever its mode (beams expanded into the batch): beam
    search and prompt lookup run transformers' own method over the same cache — its sequences, not greedy
    rows in their place — counted and warned once."""
    model = _model()
    model.generation_config.eos_token_id = None  # the random model could draw its EOS in one run and not another
    ids = torch.randint(1, 128, (batch, 11), device=DEVICE)
    torch.manual_seed(seed)
    want = _generate(model, ids, False, max_new_tokens=5, **options)
    torch.manual_seed(seed)
    with pytest.warns(RuntimeWarning, match=f"{mode} is not greedy search or sampling"):
        got = _generate(model, ids, True, max_new_tokens=5, **options)
    assert got.shape == want.shape and torch.equal(got, want)
    assert fresh_stats()["fallbacks"] == {f"captured_generate: {mode} is not greedy search or sampling": 1}


def test_a_mode_transformers_keeps_on_the_hub_is_refused(seed):
    """Contrastive search (transformers runs it from a Hub repository's own custom_generate): a ValueError naming
    the mode, not greedy tokens."""
    model = _model()
    ids = torch.randint(1, 128, (1, 11), device=DEVICE)
    with pytest.raises(ValueError, match="greedy search and sampling.*contrastive search.*Hub repository"):
        _generate(model, ids, True, max_new_tokens=3, penalty_alpha=0.6, top_k=4)


def test_synced_gpus_is_left_to_transformers_loop(seed):
    """With synced_gpus (DeepSpeed ZeRO-3 / FSDP) every rank must run forwards until all have finished, which
    transformers' loop does and the replayed one does not: the call is not replayed (its reason names it)."""
    from hf_qattn.kv_cache import generate

    model = _model()
    ids = torch.randint(1, 128, (1, 5), device=DEVICE)
    cache = hf_qattn.QAttnCache(model)
    assert generate._why_not_replayed(model, ids, cache, model.generation_config, {}, synced_gpus=False) is None
    reason = generate._why_not_replayed(model, ids, cache, model.generation_config, {}, synced_gpus=True)
    assert reason is not None and reason.startswith("synced_gpus")


def test_zero3_over_several_ranks_counts_as_synced_gpus(monkeypatch):
    """generate hands a callable custom_generate no synced_gpus: captured_generate decides it as generate does —
    DeepSpeed ZeRO-3 (or FSDP) over more than one process — and not for one process or without ZeRO-3."""
    from transformers.integrations import deepspeed

    from hf_qattn.kv_cache import generate

    model = _model()
    assert generate._synced_gpus(model, True) and not generate._synced_gpus(model, False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    assert not generate._synced_gpus(model, False)  # two ranks, neither ZeRO-3 nor FSDP: nothing to wait for
    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    assert generate._synced_gpus(model, False)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 1)
    assert not generate._synced_gpus(model, False)  # one rank: no other rank waits


def test_generate_hands_captured_generate_no_streamer(seed):
    """transformers' generate hands a callable custom_generate no streamer (README, Limits): its streamer gets the
    prompt from generate and nothing after. If a transformers release starts passing it, this fails, and the README
    line goes (captured_generate streams each new token it is given a streamer for, as transformers' _sample)."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    model = _model()
    ids = torch.randint(1, 128, (1, 7), device=DEVICE)
    streamer = Recorder()
    out = _generate(model, ids, True, max_new_tokens=3, min_new_tokens=3, do_sample=False, streamer=streamer)
    assert out.shape == (1, 10)
    assert streamer.puts == [ids.cpu().tolist()] and not streamer.ended
