"""The sm90 Gluon kernel family without a GPU: what ptxas makes of every shipped configuration, the
K/V pass in the Hopper layout (under the Triton interpreter), and the dispatch rules.

The kernel itself runs only on an H100/H200: ``eval/check_device.py`` compares it with the
reference there, case by case (results in ``eval/results/check-hopper-*.md``).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import types

import pytest
import torch

from hf_qattn import quant, support
from hf_qattn.kernels import launch, tuning
from hf_qattn.kernels.hopper import gluon_api

needs_gluon = pytest.mark.skipif(gluon_api.missing() is not None, reason=f"{gluon_api.missing()}")
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not ON_SM90 or gluon_api.missing() is not None,
                                reason="needs an sm90 GPU (H100/H200) and Gluon")
# the K/V pass runs on the GPU where there is one, else under the Triton interpreter (conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _shipped(d, causal, lse, kv_range, dtype, split=False, keys=4096):
    """The build a call over ``keys`` keys launches (tuning.hopper_solo, hopper_stages, hopper_causal_split)."""
    persistent = tuning.hopper_config(d)["PERSISTENT"]
    solo = tuning.hopper_solo(d, persistent=persistent)
    stages = tuning.hopper_stages(d, solo)
    causal_split = tuning.hopper_causal_split(d, causal=causal, variant_span=False, keys=keys)
    return {"head_dim": d, "stages": stages, "causal": causal, "return_lse": lse, "has_kv_range": kv_range,
            "dtype": dtype, "persistent": persistent, "solo": solo,
            **({"split": True} if split else {}), **({"causal_split": True} if causal_split else {})}


# every configuration the dispatcher can launch: head dim (padded) × causal × lse × kv range, both dtypes, short and
# long calls (SOLO CTAs up to head dim 128), and K's split channel, the heaviest; the warp-specialized CTA (head dim
# 256, tests/test_hopper_variants.py) at d64 / d128 too, as a launch with ``solo=False`` builds it
SHIPPED = [
    _shipped(d, causal, lse, kv_range, dtype, keys=keys)
    for d in (64, 128)
    for keys in (2048, 32768, 65536)
    for causal, lse, kv_range, dtype in (
        (False, False, False, "fp16"), (True, True, True, "bf16"), (True, False, False, "fp16"),
        (False, True, True, "fp16"), (False, False, True, "bf16"))
] + [_shipped(d, causal, True, True, "bf16", split=True, keys=keys) for d in (64, 128) for causal in (False, True)
     for keys in (2048, 32768)]
SHIPPED += [{**_shipped(d, causal, False, False, "fp16"), "solo": False, "stages": tuning.hopper_stages(d, False)}
            for d, causal in ((128, False), (64, True))]
SHIPPED = [c for i, c in enumerate(SHIPPED) if c not in SHIPPED[:i]]  # causal builds are the same at both lengths


# The sm90 builds run in a child process (a Gluon compile error can abort the process: seen with triton 3.6),
# one child kept per test process and fed one build a line: importing torch and triton takes as long as a build.
_PROBE = """
import json, sys
from hf_qattn.kernels.hopper import offline_build as ob
for line in sys.stdin:
    kernel = ob.compile_sm90(**json.loads(line))
    ops = ob.opcode_counts(kernel)
    print(json.dumps({**ob.resources(kernel), "loop_local": ob.loop_local_memory(kernel),
                      **{op: ops[op] for op in ("IGMMA", "QGMMA", "UTMALDG", "LDL", "STL", "I2FP")}}), flush=True)
"""
_prober: dict = {}  # "process", "log": the child of this test process and the file its stderr goes to


@atexit.register
def _stop_prober():
    """Close the child's input (it then exits) and its streams when this test process ends."""
    if "process" in _prober:
        process = _prober["process"]
        process.stdin.close()
        process.wait(timeout=60)
        process.stdout.close()
        _prober["log"].close()


def offline_report(config: dict) -> dict:
    """The sm90 build of ``config`` (kernels/hopper/offline_build.py's arguments): resources, loop-local memory,
    opcode counts, from the child process (started on first use, started again after a build killed it)."""
    process = _prober.get("process")
    if process is None or process.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
        _prober["log"] = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: warnings must not fill a buffer
        process = _prober["process"] = subprocess.Popen([sys.executable, "-c", _PROBE], stdin=subprocess.PIPE,
                                                        stdout=subprocess.PIPE, stderr=_prober["log"], text=True,
                                                        env=env)
    process.stdin.write(json.dumps(config) + "\n")
    process.stdin.flush()
    line = "print"
    while line and not line.startswith("{"):  # the report is one JSON line; anything else the build printed is skipped
        ready, _, _ = select.select([process.stdout], [], [], 600)
        line = process.stdout.readline() if ready else ""
    if not line:  # died (or hung) on this build: its stderr says why; the next build starts a new child
        process.kill()
        process.wait()
        _prober["log"].seek(0)
        pytest.fail(f"the sm90 build of {config} failed:\n{_prober['log'].read()[-3000:]}")
    return json.loads(line)


@needs_gluon
@pytest.mark.parametrize("config", SHIPPED, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_shipped_configuration_compiles_for_sm90_with_wgmma_tma_and_no_spills(config):
    report = offline_report(config)
    assert report["IGMMA"] > 0, "INT8 Q·Kᵀ must run on the INT8 wgmma"
    assert report["QGMMA"] > 0, "P·V must run on the FP8 wgmma"
    assert report["UTMALDG"] >= 3, "K, V and ΔS tiles must come through TMA"
    consumers = 1 if config["solo"] else 2
    loops = 2 if config.get("causal_split") else 1  # the split causal loop: tiles left of the diagonal, then on it
    assert len(report["loop_local"]) == consumers * loops, "one main loop (or two) per consumer warpgroup"
    if config["solo"]:  # one warpgroup a CTA, its loop (or two) with no local memory; three or four CTAs an SM
        cap = tuning.hopper_register_cap(config["head_dim"], True)
        ctas = 65536 // (128 * cap)
        assert report["regs"] <= cap and ctas * (report["shared"] + 1024) <= 228 * 1024, report
        # causal d128 at 168 registers with triton 3.6: ptxas keeps one value on the stack between its two loops
        # (12 bytes, two stores and a load a work item, not a key tile). Causal d64 at 128 registers (four CTAs)
        # with triton 3.6: one value reloaded a key tile in each loop, 12 bytes — measured on the H200 with it,
        # four CTAs ran causal d64 2–5 % faster than three at 168 with none (eval/results/solo-*.md)
        assert max(report["loop_local"]) <= (1 if ctas == 4 else 0) and report["spill_bytes"] <= 16, report
        assert report["LDL"] + report["STL"] <= 4, report
    else:  # no local memory in the main loops; with K's split channel (opt-in, its heaviest configuration) ptxas
        # reloads one 4-byte stack slot in a branch of one warpgroup's loop (measured with triton 3.9)
        assert max(report["loop_local"]) <= (1 if config.get("split") else 0), report
        assert report["spill_bytes"] == 0, report
        if not config.get("split"):
            assert report["LDL"] == 0 and report["STL"] == 0, report
    assert report["shared"] <= 227 * 1024, report


def _hopper_pass(q, k, v, kv_start=None, kv_end=None):
    return launch.quantize_kv(q, k, v, sm_scale=q.shape[-1] ** -0.5, qk="int8", v_fp8=True, smooth_q=True,
                              smooth_k=True, smooth_v=True, kv_start=kv_start, kv_end=kv_end, block_n=128,
                              k_token_scale=False, v_channel_scale=True, permute_v=True, v_dither=True)


def _key_of_column(nk_pad: int) -> torch.Tensor:
    """Token held by each column of V̂ᵀ in the Hopper key order (the kernel's relabelling of P)."""
    inside = torch.arange(32).reshape(2, 2, 2, 2, 2).permute(0, 2, 3, 1, 4).reshape(32)
    return torch.cat([32 * g + inside for g in range(nk_pad // 32)])


def test_kv_pass_hopper_layout_matches_the_reference_quantization():
    b, hq, hk, n, d = 2, 4, 2, 300, 64
    q, k = _randn(b, hq, n, d), _randn(b, hk, n, d)
    v = 3 * _randn(b, hk, n, d) + _randn(1, hk, 1, d)
    kv = _hopper_pass(q, k, v)
    # the centers match the reference's up to float summation order; exact comparisons below use the
    # pass's own centers, so a last-bit difference in v̄ or k̄ cannot flip a rounding tie
    v_bar, k_bar = kv.v_bar.view(b, hk, d), kv.k_bar.view(b, hk, d)
    torch.testing.assert_close(v_bar, quant.smoothing_center(v, tuning.v_center_sample()))
    torch.testing.assert_close(k_bar, quant.smoothing_center(k, tuning.center_sample()))
    v_smooth = v - v_bar[:, :, None]
    # V's range per channel over all keys (max V, max −V), from which max |V − v̄| follows exactly
    v_range = kv.vs.view(b, hk, 2, -1)[..., :d]
    assert torch.equal(v_range[:, :, 0], v.amax(2)) and torch.equal(v_range[:, :, 1], (-v).amax(2))
    assert torch.isinf(kv.vs.view(b, hk, 2, -1)[..., d:]).all(), "padding channels keep −inf"
    absmax = torch.maximum(v_range[:, :, 0] - v_bar, v_bar + v_range[:, :, 1])
    assert torch.equal(absmax, v_smooth.abs().amax(2))
    v_hat, _ = quant.quantize_v(v_smooth, "fp8_e4m3", "channel-dither", 128)  # 3 tiles: 3 dithers
    stored = kv.vq.view(b, hk, d, kv.nk_pad).float()
    by_token = torch.empty_like(stored)
    by_token[..., _key_of_column(kv.nk_pad).to(DEVICE)] = stored
    assert torch.equal(by_token[..., :n], v_hat.transpose(2, 3)), "V̂ᵀ columns must follow the Hopper key order"
    assert not by_token[..., n:].any(), "padding keys are zeros"
    # K: INT8 per 128-key tile, as the reference quantizes it
    k_hat, k_scale = quant.quantize_int(k - k_bar[:, :, None], 127.0, 128)
    assert torch.equal(kv.kq.view(b, hk, kv.nk_pad, d)[:, :, :n].float(), k_hat)
    torch.testing.assert_close(kv.ks.view(b, hk, -1), k_scale[..., ::128])

def test_kv_pass_writes_minus_inf_delta_s_outside_key_ranges_and_padding():
    b, hq, hk, n, d = 2, 4, 2, 300, 64
    q, k, v = _randn(b, hq, n, d), _randn(b, hk, n, d), _randn(b, hk, n, d)
    start, end = _int32([0, 37]), _int32([300, 250])
    ds = _hopper_pass(q, k, v, start, end).delta_s.view(b, hq, -1)
    keys = torch.arange(ds.shape[-1], device=DEVICE)
    for batch in range(b):
        outside = (keys < start[batch]) | (keys >= end[batch])
        assert torch.isinf(ds[batch][:, outside]).all() and (ds[batch][:, outside] < 0).all()
        assert torch.isfinite(ds[batch][:, ~outside]).all()


def test_kv_pass_delta_s_is_the_smoothing_term_of_each_query_head():
    """ΔS, written by the K/V pass from the K tile it quantizes, is q̄·(K − k̄)ᵀ·sm_scale·log2 e for each
    query head of the group (GQA, key ranges, padding), plus log2 φ_t of V̂'s tile dither."""
    b, hq, hk, n, d = 2, 4, 2, 300, 64
    q, k = _randn(b, hq, n, d), _randn(b, hk, n, d) + _randn(1, hk, 1, d)
    v = _randn(b, hk, n, d)
    start, end = _int32([0, 37]), _int32([300, 250])
    kv = launch.quantize_kv(q, k, v, sm_scale=0.3, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True,
                            smooth_v=True, kv_start=start, kv_end=end, block_n=128, k_token_scale=False,
                            v_channel_scale=True, permute_v=True, v_dither=True)
    k_centered = k - kv.k_bar.view(b, hk, 1, d)
    want = torch.einsum("bgd,bgnd->bgn", kv.q_bar.view(b, hk, hq // hk, d).flatten(1, 2),
                        k_centered.repeat_interleave(hq // hk, dim=1)) * 0.3 * launch.LOG2E
    want = want + torch.tensor([math.log2(quant.v_dither(j // 128)) for j in range(n)], device=DEVICE)
    got = kv.delta_s.view(b, hq, -1)[..., :n]
    keys = torch.arange(n, device=DEVICE)
    inside = (keys >= start.view(-1, 1, 1)) & (keys < end.view(-1, 1, 1))
    torch.testing.assert_close(got[inside.expand_as(got)], want[inside.expand_as(want)], rtol=1e-5, atol=1e-5)


def test_kv_pass_gives_a_non_finite_key_tile_a_nan_scale():
    b, h, n, d = 1, 1, 300, 64
    q, k, v = _randn(b, h, n, d), _randn(b, h, n, d), _randn(b, h, n, d)
    k[0, 0, 201, 3] = float("inf")  # tile 1 of 128 keys: [128, 256); an odd token, outside the centers' sample
    scales = _hopper_pass(q, k, v).ks.view(-1)
    assert torch.isnan(scales[1]) and torch.isfinite(scales[[0, 2]]).all()


def test_dispatch_on_a_cpu_tensor_never_picks_the_hopper_kernel():
    q = torch.randn(1, 2, 8, 64)
    assert support.select_path(q)[0] == support.REFERENCE
    assert support._hopper_gap(q, "int8", "fp8") == "not an sm90 GPU"
    assert support.effective_qk(q, "int4") == "int4"  # the int4 → int8 rule is for sm90 only
    with pytest.raises(RuntimeError, match="hopper"):
        support.select_path(q, "hopper")


def test_hopper_config_is_read_from_the_shipped_table():
    assert tuning.hopper_config(128)["BLOCK_N"] == 128 and tuning.hopper_config(256)["BLOCK_N"] == 64
    assert [tuning.hopper_stages(d, solo=False) for d in (64, 128, 256)] == [2, 3, 2]
    assert tuning.hopper_stages(128, solo=True) == tuning.hopper_stages(64, solo=True) == 2
    assert tuning.hopper_solo(128, persistent=False) and tuning.hopper_solo(64, persistent=False)
    assert tuning.hopper_solo(96, persistent=False)  # pads to 128
    assert not tuning.hopper_solo(256, persistent=False) and not tuning.hopper_solo(128, persistent=True)
    # the one decision the launch and the offline build share: (SOLO, consumers, stages, register cap)
    assert tuning.hopper_cta_shape(64, persistent=False, variant=False) == (True, 1, 2, 128)
    assert tuning.hopper_cta_shape(64, persistent=False, variant=True) == (True, 1, 2, 168)
    assert tuning.hopper_cta_shape(128, persistent=False, variant=False, pv_tiles=8) == (False, 2, 3, 0)
    assert tuning.hopper_cta_shape(256, persistent=False, variant=False, stages=3) == (False, 2, 3, 0)


def test_causal_main_loop_split_from_the_head_dims_threshold():
    """tuning.hopper_causal_split: causal calls from CAUSAL_SPLIT_FROM keys (0 at d64 / d128, whose causal calls run
    SOLO CTAs; 8192 at d256), never for full attention or a window / chunk (their tiles are masked at both
    ends)."""
    for d, threshold in ((64, 0), (128, 0), (256, 8192)):
        assert tuning.hopper_config(d)["CAUSAL_SPLIT_FROM"] == threshold
        assert tuning.hopper_causal_split(d, causal=True, variant_span=False, keys=max(threshold, 1))
        if threshold:
            assert not tuning.hopper_causal_split(d, causal=True, variant_span=False, keys=threshold - 1)
        assert not tuning.hopper_causal_split(d, causal=False, variant_span=False, keys=4 * threshold + 1)
        assert not tuning.hopper_causal_split(d, causal=True, variant_span=True, keys=4 * threshold + 1)


def test_sm90_without_gluon_runs_the_portable_kernel_counted_and_warned(monkeypatch):
    import hf_qattn
    from hf_qattn.kernels.hopper import gluon_api as api

    q = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 2, 8, 64))  # a query on an sm90 GPU
    monkeypatch.setattr(support, "capability", lambda device: (9, 0))
    monkeypatch.setattr(api, "missing", lambda: "Gluon unavailable (ImportError: test)")
    hf_qattn.reset_fallback_stats()
    with pytest.warns(RuntimeWarning, match="triton kernels instead"):
        path, reason = support.select_path(q)
    assert (path, reason) == (support.TRITON, None)
    (counted,) = hf_qattn.fallback_stats()["fallbacks"]
    assert counted.startswith(support.REASON_NO_GLUON)


@needs_sm90
@pytest.mark.parametrize("d, causal, window, lse, ragged", [
    (128, False, 0, False, False), (64, False, 0, True, True), (128, True, 0, True, False),
    (128, True, 1000, False, True), (64, True, 0, False, False)])
def test_solo_cta_agrees_with_the_reference_and_the_warp_specialized_cta(seed, d, causal, window, lse, ragged):
    """SOLO CTAs (one warpgroup loading its own tiles, each tile's P·V in a fresh accumulator added into FP32
    registers) against the reference of the kernel's quantization (float32 sums) and against exact attention, as
    well as the warp-specialized CTA does: a stage refilled before its wgmmas read it, a wrong ring phase, a P·V
    accumulator that carries across tiles or a missing rescale would all move it far past this. 71 key tiles,
    GQA, V off zero; a ragged key range, causal with and without a window, the lse."""
    from hf_qattn import reference

    g = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hk, n = 2, 4, 2, 9000
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = v + 0.3
    kv_start = torch.zeros(b, device="cuda", dtype=torch.int32) if ragged else None
    kv_end = torch.tensor([n, n - 777], device="cuda", dtype=torch.int32) if ragged else None
    sm_scale = d ** -0.5
    kv = launch.hopper_quantize_kv(q, k, v, sm_scale=sm_scale, kv_start=kv_start, kv_end=kv_end)
    outs, lses = {}, {}
    for solo in (True, False):
        outs[solo] = torch.full_like(q, float("nan"))
        lses[solo] = launch.hopper_kernel_launch(q, hk, n, kv, outs[solo], is_causal=causal, sm_scale=sm_scale,
                                                 qk="int8", kv_end=kv_end, return_lse=lse, window=window,
                                                 solo=solo)
    spans = {"window": window} if window else {}
    ref, ref_lse = reference.quantized_attention(q, k, v, is_causal=causal, sm_scale=sm_scale, qk="int8",
                                                 kv_end=kv_end, return_lse=True, **spans,
                                                 **tuning.hopper_reference_settings())
    exact = reference.exact_attention(q, k, v, is_causal=causal, sm_scale=sm_scale, kv_end=kv_end, **spans)
    solo, specialized = outs[True].float(), outs[False].float()
    assert torch.isfinite(solo).all()
    assert (solo - ref.float()).abs().amax() <= 0.02 * ref.float().abs().amax()
    rel_l1 = {name: ((o - exact.float()).abs().sum() / exact.float().abs().sum()).item()
              for name, o in (("solo", solo), ("specialized", specialized), ("reference", ref.float()))}
    assert rel_l1["solo"] <= 1.05 * rel_l1["specialized"] + 1e-4, rel_l1
    assert rel_l1["solo"] <= rel_l1["reference"] + 0.005, rel_l1
    if lse:
        assert (lses[True] - ref_lse).abs().nan_to_num(0.0).amax() <= 0.01
        assert torch.equal(torch.isinf(lses[True]), torch.isinf(ref_lse))


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_shipped_path_error_does_not_grow_with_length_to_131k_keys(causal):
    """The Hopper path as a call takes it (SOLO CTAs at d128 where tuning picks them) against float32 attention on
    256 query rows spread over the sequence, at 4k, 75.6k (Wan-14B-720p's video) and 131k keys (128k context),
    B1 H2 d128 bf16, K with a channel offset: with V of mean 0.3 RelL1 at 131k at most 1.2× its value at 4k (an
    FP8 P·V accumulator summed over too many tiles grows it 7.5×: issue 22), and with zero-mean V — where the part
    attention selects is all there is — cosine ≥ 0.999 at every length."""
    results = {}
    for n in (4096, 75600, 131072):
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(1, 2, n, 128, device="cuda", generator=g) for _ in range(3))
        k += 2.0 * torch.randn(1, 2, 1, 128, device="cuda", generator=g)
        rows = torch.linspace(0, n - 1, 256, device="cuda").long()
        mask = torch.arange(n, device="cuda")[None, :] <= rows[:, None] if causal else None
        for v_kind, shift in (("v-mean", 0.3), ("zero-mean", 0.0)):
            qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v + shift))
            out = torch.empty_like(qb)
            launch.hopper_attention(qb, kb, vb, out, is_causal=causal, sm_scale=128 ** -0.5, qk="int8",
                                    smooth_q=True, smooth_k=True, smooth_v=True, kv_start=None, kv_end=None,
                                    return_lse=False)
            ref = torch.nn.functional.scaled_dot_product_attention(qb[:, :, rows].float(), kb.float(), vb.float(),
                                                                   attn_mask=mask)
            got = out[:, :, rows].float()
            results[v_kind, n] = ((got - ref).abs().sum() / ref.abs().sum()).item(), \
                torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    assert results["v-mean", 131072][0] <= 1.2 * results["v-mean", 4096][0], results
    assert results["v-mean", 75600][0] <= 1.2 * results["v-mean", 4096][0], results
    assert min(cos for (kind, _), (_, cos) in results.items() if kind == "zero-mean") >= 0.999, results


def _recorded_launch(monkeypatch, d=128, keys=4096, **call) -> dict:
    """The keywords hopper_kernel_launch gives the kernel for a call (CPU: the launch recorded, not run)."""
    launched = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.update(kwargs, grid=grid)

    monkeypatch.setattr(launch, "fast", lambda kernel: Recorder())
    monkeypatch.setattr(tuning, "interpreting", lambda: False)  # the GPU's launch options (the register cap)
    d_pad, tiles = tuning.padded_head_dim(d), keys // tuning.hopper_config(d)["BLOCK_N"]
    kv = launch.QuantizedKV(
        kq=torch.zeros(keys, d_pad, dtype=torch.int8), ks=torch.zeros(1, tiles),
        vq=torch.zeros(d_pad, keys, dtype=torch.float8_e4m3fn), vs=torch.zeros(1, 2, d_pad), ds=torch.zeros(2, keys),
        split=torch.zeros(0, dtype=torch.int32), q_bar=torch.zeros(2, d), k_bar=torch.zeros(1, d),
        v_bar=torch.zeros(1, d), nk_pad=keys, tiles=tiles)
    q = torch.zeros(1, 2, keys, d, dtype=torch.float16)
    launch.hopper_kernel_launch(q, 1, keys, kv, torch.empty_like(q), sm_scale=d ** -0.5, qk="int8", kv_end=None,
                                return_lse=False, **call)
    return launched


@needs_gluon
@pytest.mark.parametrize("d, keys, causal, solo, consumers, stages", [
    (128, 16384, False, True, 1, 2),  # head dims up to 128: SOLO CTAs of one warpgroup, every call
    (64, 4096, True, True, 1, 2),
    (96, 8192, True, True, 1, 2),
    (256, 16384, False, False, 2, 2),  # head dim 256: the warp-specialized CTA of two consumers
    (128, 65536, False, False, 2, 3),  # where SOLO is off (kernels.json SOLO false): the same CTA, 3 stages at d128
    (64, 16384, True, False, 2, 2),
])
def test_launch_passes_the_cta_that_tuning_picks(monkeypatch, d, keys, causal, solo, consumers, stages):
    """hopper_kernel_launch hands the kernel the CTA shape (SOLO, consumers, stages, grid, register cap) that tuning
    decides for the call, on the CPU with the launch recorded instead of run. SOLO CTAs without their register cap
    would hold an SM alone, and a ring of the other CTA's depth would not fit three of them an SM, while every GPU
    output stayed right: only this sees it."""
    if not solo and d <= 128:
        monkeypatch.setattr(tuning, "hopper_solo", lambda head_dim, **call: False)
    launched = _recorded_launch(monkeypatch, d=d, keys=keys, is_causal=causal)
    assert (launched["SOLO"], launched["CONSUMERS"]) == (solo, consumers), launched
    assert launched["STAGES"] == stages
    assert launched["grid"] == (math.ceil(keys / (64 * consumers)) * 2,)  # two query heads
    assert launched.get("maxnreg", 0) == (tuning.hopper_config(d)["SOLO_REGISTERS"]["plain"] if solo else 0)
    if solo:  # three CTAs an SM at least: 3 × 128 threads × the cap within its 64K registers
        assert 3 * 128 * launched["maxnreg"] <= 65536
    assert not launched["PERSISTENT"]


@needs_gluon
def test_a_causal_call_past_the_masks_float_positions_is_refused(monkeypatch):
    """The causal mask compares positions as float32, exact below 2^24: a causal call at or past the limit (a
    smaller one patched in here) is a ValueError naming is_causal, not a silently wrong mask; full attention and a
    window (masked in int32) still launch."""
    monkeypatch.setattr(launch, "HOPPER_CAUSAL_POSITIONS", 4096 + 128)
    assert _recorded_launch(monkeypatch, keys=4096, is_causal=True)["CAUSAL"]
    monkeypatch.setattr(launch, "HOPPER_CAUSAL_POSITIONS", 4096 + 127)
    with pytest.raises(ValueError, match="is_causal: .*float32"):
        _recorded_launch(monkeypatch, keys=4096, is_causal=True)
    assert not _recorded_launch(monkeypatch, keys=4096, is_causal=False)["CAUSAL"]
    assert _recorded_launch(monkeypatch, keys=4096, is_causal=True, window=1024)["WINDOW"]


@needs_gluon
def test_solo_register_cap_by_head_dim_and_variant(monkeypatch):
    """SOLO's register cap (kernels.json SOLO_REGISTERS): 128 (four CTAs an SM) for plain d64 calls, measured faster
    on the H200; 168 (three) at d128 and for every d64 call with a window, chunk, sinks or soft-cap, whose loops
    Triton 3.9 builds with local memory at 128. The launch must ask with the call's variant."""
    assert tuning.hopper_register_cap(64, True) == 128 and tuning.hopper_register_cap(64, True, variant=True) == 168
    assert tuning.hopper_register_cap(128, True) == tuning.hopper_register_cap(96, True, variant=True) == 168
    assert tuning.hopper_register_cap(256, False) == tuning.hopper_register_cap(64, False) == 0
    assert _recorded_launch(monkeypatch, d=64, is_causal=True)["maxnreg"] == 128
    assert _recorded_launch(monkeypatch, d=64, is_causal=True, window=1024)["maxnreg"] == 168
    assert _recorded_launch(monkeypatch, d=64, is_causal=False, softcap=30.0)["maxnreg"] == 168
    assert _recorded_launch(monkeypatch, d=64, is_causal=False, sinks=torch.zeros(2))["maxnreg"] == 168


@needs_gluon
def test_scores_become_floats_by_an_integer_add_where_kernels_json_says(monkeypatch):
    """S_FLOAT_BY_ADD (kernels.json, by head dim and the call's kind): the launch turns it on for causal calls,
    windows, chunks and sinks at d64 and d128 and for full ones at d128 (faster on the H200, or level), off for
    full d64 calls (1 % slower), soft-caps (the tanh needs the true scores), K's split channel (Triton 3.9 reloads
    its row offset from local memory in the causal loop) and head dim 256."""
    on = {(64, True), (128, True), (128, False)}
    for d in (64, 128):
        for causal in (False, True):
            assert _recorded_launch(monkeypatch, d=d, is_causal=causal)["S_FLOAT_BY_ADD"] == ((d, causal) in on)
        assert _recorded_launch(monkeypatch, d=d, is_causal=True, window=1024)["S_FLOAT_BY_ADD"]
        assert _recorded_launch(monkeypatch, d=d, is_causal=False, sinks=torch.zeros(2))["S_FLOAT_BY_ADD"]
        assert not _recorded_launch(monkeypatch, d=d, is_causal=False, softcap=30.0)["S_FLOAT_BY_ADD"]
    assert not _recorded_launch(monkeypatch, d=256, is_causal=True)["S_FLOAT_BY_ADD"]
    assert not tuning.hopper_s_float_by_add(128, causal=False, variant=False, softcap=True, split=False)
    assert not tuning.hopper_s_float_by_add(128, causal=True, variant=False, softcap=False, split=True)


@needs_gluon
def test_scores_turned_float_by_an_integer_add_leave_the_exp2_unit():
    """The sm90 build with S_FLOAT_BY_ADD (full d128) converts no score by I2F, the quarter-rate unit exp2 uses:
    its only I2FP is outside the main loop; without it (full d64) every score of a key tile takes one (64 a thread
    a tile)."""
    assert offline_report({"head_dim": 128})["I2FP"] <= 1
    assert offline_report({"head_dim": 64})["I2FP"] >= 64


@needs_gluon
def test_an_explicit_solo_launch_that_cannot_run_is_refused(monkeypatch):
    """SOLO asked for past head dim 128 or with a persistent grid is a ValueError naming the argument, not a
    KeyError, a spilled build or a hang (a SOLO CTA's ring restarts at each work item); an explicit warp-specialized
    CTA (solo=False, or pv_tiles, which only it has) is honoured."""
    with pytest.raises(ValueError, match="solo: .*head dims up to 128"):
        _recorded_launch(monkeypatch, d=256, is_causal=False, solo=True)
    with pytest.raises(ValueError, match="solo: .*persistent"):
        _recorded_launch(monkeypatch, is_causal=False, solo=True, persistent=True)
    assert not _recorded_launch(monkeypatch, is_causal=False, solo=False)["SOLO"]
    assert not _recorded_launch(monkeypatch, is_causal=False, pv_tiles=8)["SOLO"]


@pytest.mark.parametrize("softcap, split", [(0.0, False), (30.0, True)])
def test_hopper_attention_quantizes_kv_as_the_kernel_reads_it(monkeypatch, softcap, split):
    """hopper_attention's K/V pass (launch.hopper_quantize_kv, which the studies share): FP8 V̂ᵀ with per-channel
    scales in the kernel's key order, the kernel's key tile and the pass's warps from kernels.json, V's tile dither
    unless soft-capped, the split channel when asked, kept buffers (CPU, both launches recorded)."""
    seen = {}
    monkeypatch.setattr(launch, "quantize_kv", lambda *args, **kwargs: seen.update(kwargs) or "kv")
    monkeypatch.setattr(launch, "hopper_kernel_launch", lambda *args, **kwargs: seen.update(kv=args[3]))
    q = torch.zeros(1, 2, 16, 128)
    launch.hopper_attention(q, q, q, q, is_causal=True, sm_scale=0.1, qk="int8", smooth_q=True, smooth_k=True,
                            smooth_v=False, kv_start=None, kv_end=None, return_lse=False, split_channel=split,
                            softcap=softcap)
    config = tuning.hopper_config(128)
    assert seen["kv"] == "kv"
    assert (seen["v_fp8"], seen["v_channel_scale"], seen["permute_v"], seen["k_token_scale"]) == (True, True, True,
                                                                                                  False)
    assert (seen["block_n"], seen["num_warps"]) == (config["BLOCK_N"], config["KV_PASS_WARPS"])
    assert seen["v_dither"] == tuning.v_dither(bool(softcap)) and seen["split"] == split and seen["keep"] is True
    assert (seen["smooth_q"], seen["smooth_k"], seen["smooth_v"], seen["sm_scale"]) == (True, True, False, 0.1)
