"""The reference quantized attention (hf_qattn.reference) and the qattn boundary, on the CPU.

Every comparison is against float64 attention on fresh random inputs (the ``seed`` fixture prints
the seed). Inputs carry channel-wise outliers like real Q/K/V so that a missing smoothing
correction or a wrong scale shows up as a large error.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_qattn
from hf_qattn import quant, reference
from hf_qattn.calibration.metrics import accuracy

OFF = dict(qk="none", pv="none")  # quantization switched off, smoothing still on


def outlier_qkv(b, hq, hk, nq, nk, d, dtype=torch.float32):
    """Gaussian Q/K/V plus a large per-channel offset shared by all tokens (what smoothing removes)."""
    def make(h, n, offset):
        return torch.randn(b, h, n, d) + offset * torch.randn(1, h, 1, d)
    return make(hq, nq, 3.0).to(dtype), make(hk, nk, 8.0).to(dtype), make(hk, nk, 2.0).to(dtype)


def ranges(b, nk):
    start = torch.randint(0, nk // 3, (b,))
    end = torch.randint(nk // 2, nk + 1, (b,))
    return start, end


def score_magnitude(q, k):
    """max over keys of Σ_c |q_c·k_c|·d^-½, per query row (B, Hq, Nq): the size of a score's terms."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q.double().abs() @ k.double().abs().transpose(-1, -2)).amax(-1) * q.shape[-1] ** -0.5


# --- quantization switched off: the smoothing corrections (ΔS, v̄, k̄ in the lse) are exact -----------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,nq,nk", [(4, 4, 37, 37), (4, 2, 20, 53), (3, 1, 1, 40), (2, 2, 50, 30)])
def test_unquantized_is_exact(seed, causal, hq, hk, nq, nk):
    q, k, v = outlier_qkv(2, hq, hk, nq, nk, 32)
    start, end = ranges(2, nk)
    for kw in ({}, {"kv_start": start, "kv_end": end}):
        out, lse = reference.quantized_attention(q, k, v, is_causal=causal, return_lse=True, block_m=16, block_n=16,
                                                 **OFF, **kw)
        ref, ref_lse = reference.exact_attention(q, k, v, is_causal=causal, return_lse=True, **kw)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        # the lse is a sum of float32 terms as large as the scores' |q|·|k| (the inputs' offsets make them
        # hundreds, and smoothing moves parts of them between terms): allow a few float32 roundings of that
        err = (lse.double() - ref_lse).abs()[finite]
        assert (err <= 1e-5 + 8 * torch.finfo(torch.float32).eps * score_magnitude(q, k)[finite]).all(), err.max()


def test_rows_without_keys_are_zero(seed):
    q, k, v = outlier_qkv(1, 2, 2, 6, 3, 16)  # causal with Nq > Nk: the first 3 rows see nothing
    out, lse = reference.quantized_attention(q, k, v, is_causal=True, return_lse=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, :3] < 0).all()
    assert out[:, :, 3:].abs().sum() > 0


# --- quantized: error bounds a wrong scale or a missing correction would break --------------------
# Bounds measured on these inputs with the correct code have margin ~2x; dropping ΔS, v̄ or K
# smoothing, or scaling by amax instead of amax/qmax, each lands far outside (see the mutation test).
BOUNDS = {"int8": 0.03, "int4": 0.25}


@pytest.mark.parametrize("qk", ["int8", "int4"])
@pytest.mark.parametrize("causal", [False, True])
def test_quantized_error_bounds(seed, qk, causal):
    q, k, v = outlier_qkv(2, 4, 2, 96, 96, 64)
    out = reference.quantized_attention(q, k, v, is_causal=causal, qk=qk, block_m=32, block_n=32)
    acc = accuracy(out, reference.exact_attention(q, k, v, is_causal=causal))
    assert acc.rel_l1 < BOUNDS[qk], acc
    assert acc.cos_sim > 1 - BOUNDS[qk] / 2, acc


def test_bounds_catch_broken_corrections(seed, monkeypatch):
    """The bounds above are tight enough: each way of getting the method wrong breaks them."""
    q, k, v = outlier_qkv(2, 4, 2, 96, 96, 64)
    exact = reference.exact_attention(q, k, v)

    def rel_l1(out):
        return accuracy(out, exact).rel_l1

    def run(**kw):
        return reference.quantized_attention(q, k, v, qk="int8", block_m=32, block_n=32, **kw)

    assert rel_l1(run()) < BOUNDS["int8"]
    # ΔS dropped: the scores would be (q − q̄)·k instead of q·k
    q_bar = quant.smoothing_center(q)[:, :, None]
    assert rel_l1(reference.exact_attention(q - q_bar, k, v)) > BOUNDS["int8"]
    # v̄ not added back
    v_bar = quant.smoothing_center(v)[:, :, None].repeat_interleave(2, dim=1)
    assert rel_l1(run() - v_bar) > BOUNDS["int8"]
    # a scale of amax instead of amax / qmax
    monkeypatch.setattr(quant, "quantize_int", lambda x, qmax, rows: (
        torch.round(x / quant.row_scales(x, 1.0, rows)[..., None]), quant.row_scales(x, qmax, rows)))
    assert rel_l1(run()) > BOUNDS["int8"]


def test_orderings_of_the_paper(seed):
    """Per-token ≤ per-warp ≤ per-block ≤ per-tensor; smoothing Q+K beats Q alone, K alone and none."""
    q, k, v = outlier_qkv(2, 4, 4, 128, 128, 64)
    exact = reference.exact_attention(q, k, v)

    def err(**kw):
        kw = {"qk": "int4", "block_m": 64, "block_n": 64, "warp_rows": 16, **kw}
        return accuracy(reference.quantized_attention(q, k, v, **kw), exact).rel_l1

    by_granularity = [err(q_granularity=g, k_granularity=g) for g in ("token", "warp", "block", "tensor")]
    assert by_granularity == sorted(by_granularity), by_granularity
    both = err()
    assert both < min(err(smooth_q=False), err(smooth_k=False), err(smooth_q=False, smooth_k=False))


def test_pv_formats_with_an_attention_sink(seed):
    """FP16 ≤ E4M3 ≤ E5M2 for P/V; INT8 falls behind when many small probabilities carry the mass.

    One key scores 6 above the rest (an attention sink, as in LLMs); the other keys each get
    P̃ ≈ e⁻⁶ ≈ 0.0025 yet hold most of the mass. P̃·127 rounds them to zero in INT8 while E4M3
    keeps them. Smoothing V hides most of that loss (the dropped terms are then deviations from
    v̄ that nearly cancel), so INT8 is compared without it; with peaked attention INT8's uniform
    grid can even beat E4M3 (see eval/results/accuracy_tables.md).
    """
    b, h, n, d = 1, 4, 1024, 64
    q = torch.zeros(b, h, n, d)
    q[..., 0] = 1.0
    k = torch.randn(b, h, n, d)
    k[..., 0] = 0.3 * torch.randn(b, h, n)
    k[:, :, 0, 0] = 6.0 * math.sqrt(d)  # the sink: q·k₀/√d = 6 for every query
    v = torch.randn(b, h, n, d) + 1.0
    exact = reference.exact_attention(q, k, v)
    p = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d), -1)
    assert (p[..., 1:].sum(-1) > 0.5).all()  # most mass lies outside the sink

    def err(pv, smooth_v=True):
        out = reference.quantized_attention(q, k, v, qk="int8", pv=pv, block_m=64, block_n=64, smooth_v=smooth_v)
        return accuracy(out, exact).rel_l1

    by_format = [err(f) for f in ("fp16", "fp8_e4m3", "fp8_e5m2")]
    assert by_format == sorted(by_format), by_format
    assert err("int8", smooth_v=False) > err("fp8_e5m2", smooth_v=False) > err("fp8_e4m3", smooth_v=False)


# --- primitives ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("rows", [None, 1, 16, 32])
def test_quantize_int(seed, fmt, qmax, rows):
    x = torch.randn(2, 3, 50, 8) * torch.rand(2, 3, 50, 1) * 10
    xq, scale = quant.quantize_int(x, quant.INT_MAX[fmt], rows)
    assert torch.equal(xq, xq.round()) and xq.abs().max() <= qmax
    assert ((xq * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-6).all()
    groups = [x.shape[2]] if rows is None else [rows] * (x.shape[2] // rows) + [x.shape[2] % rows] * (x.shape[2] % rows > 0)
    first = 0
    for size in groups:
        block = scale[..., first:first + size]
        assert torch.equal(block, block[..., :1].expand_as(block)) if rows else torch.equal(block, scale.flatten()[0].expand_as(block))
        if rows:
            amax = x[:, :, first:first + size].abs().amax(dim=(-1, -2))
            torch.testing.assert_close(block[..., 0], amax / qmax)
        first += size
    # all-zero input: zeros, not NaN
    zq, _ = quant.quantize_int(torch.zeros(1, 1, 4, 4), 127, 1)
    assert torch.equal(zq, torch.zeros_like(zq))


@pytest.mark.parametrize("granularity", ["channel", "channel-dither", "block"])
def test_quantize_v_fp8(seed, granularity):
    v = torch.randn(1, 2, 70, 16) * 5
    vq, scale = quant.quantize_v(v, "fp8_e4m3", granularity, 32)
    assert scale.shape == (1, 2, 3, 16)
    if granularity != "block":  # one scale per channel over all keys, times tile t's dither φ_t
        dither = [quant.v_dither(t) if granularity == "channel-dither" else 1.0 for t in range(3)]
        assert dither[0] == 1.0 and len(set(dither)) == (3 if granularity == "channel-dither" else 1)
        base = v.abs().amax(2) / 448
        for t in range(3):
            assert torch.equal(scale[:, :, t], base * dither[t])
    assert vq.abs().max() <= 448
    assert torch.equal(vq, vq.to(torch.float8_e4m3fn).float())  # on the E4M3 grid
    per_token = scale.repeat_interleave(32, dim=2)[:, :, :70]
    assert ((vq * per_token - v).abs() <= v.abs() * 2 ** -4 + per_token * 2 ** -9).all()  # ≤ half an E4M3 step


def test_v_dither_averages_the_rounding_of_repeated_values_away(seed):
    """bf16 V holds a few thousand distinct values a channel; with one scale per channel every copy of a value
    rounds to FP8 alike, so V̂'s error keeps a mean over the keys that length does not average away (attention
    over many keys then carries it: the sm90 kernel's zero-mean-V error grew with length). The tile dither
    brings that mean down to the level of independent errors, σ/√N."""
    n, d = 262144, 128  # 128 channels: the root mean square below varies less from seed to seed than over 32
    v = torch.randn(1, 1, n, d).bfloat16().float()
    v = v - v[:, :, ::1024].mean(2, keepdim=True)  # a center from 256 tokens, as the kernels': not exactly zero
    mean_error = {}
    for granularity in ("channel", "channel-dither"):
        vq, scale = quant.quantize_v(v, "fp8_e4m3", granularity, 128)
        error = vq * scale.repeat_interleave(128, dim=2)[:, :, :n] - v
        independent = error.std(2) / math.sqrt(n)  # the mean's size if the errors were independent
        mean_error[granularity] = (error.mean(2).square().mean() / independent.square().mean()).sqrt().item()
    assert mean_error["channel"] > 2.5, mean_error  # the effect the dither is for (3.3–5.4 in 33 seeds)
    assert mean_error["channel-dither"] < 2.0, mean_error  # 1.2–1.6 in the same seeds


def test_smoothing_center_sample():
    x = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 1, 10, 2)
    assert torch.equal(quant.smoothing_center(x), torch.full((1, 1, 2), 4.5))
    assert torch.equal(quant.smoothing_center(x, sample=5), torch.full((1, 1, 2), 4.0))  # rows 0, 2, 4, 6, 8
    assert torch.equal(quant.smoothing_center(x, sample=4), torch.full((1, 1, 2), 4.5))  # rows 0, 3, 6, 9


# --- the public function: layouts, GQA, validation ----------------------------------------------
def test_layouts_and_gqa_agree(seed):
    q, k, v = outlier_qkv(2, 6, 2, 33, 45, 32, dtype=torch.bfloat16)
    hnd = hf_qattn.qattn(q, k, v, is_causal=True)
    nhd = hf_qattn.qattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, layout="NHD")
    assert nhd.shape == (2, 33, 6, 32) and nhd.dtype == torch.bfloat16
    assert torch.equal(nhd.transpose(1, 2), hnd)
    repeated = hf_qattn.qattn(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    assert torch.equal(repeated, hnd)
    acc = accuracy(hnd, reference.exact_attention(q, k, v, is_causal=True))
    assert acc.rel_l1 < BOUNDS["int8"], acc


def test_empty_and_single_token(seed):
    q, k, v = outlier_qkv(1, 2, 2, 1, 1, 16)
    out, lse = hf_qattn.qattn(q, k, v, return_lse=True)
    torch.testing.assert_close(out, v, rtol=0.05, atol=0.05)  # one key: the output is its value
    torch.testing.assert_close(lse, (q * k).sum(-1) / 4, rtol=1e-4, atol=1e-4)
    empty = hf_qattn.qattn(q[:, :, :0], k, v)
    assert empty.shape == (1, 2, 0, 16)
    out, lse = hf_qattn.qattn(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_key_ranges_equal_per_sequence_runs(seed):
    q, k, v = outlier_qkv(3, 2, 2, 24, 24, 16)
    start, end = torch.tensor([0, 5, 2]), torch.tensor([24, 24, 13])
    out = hf_qattn.qattn(q, k, v, kv_start=start, kv_end=end, backend="reference")
    exact = reference.exact_attention(q, k, v, kv_start=start, kv_end=end)
    for b in range(3):
        alone = reference.exact_attention(q[b:b + 1], k[b:b + 1, :, start[b]:end[b]], v[b:b + 1, :, start[b]:end[b]])
        torch.testing.assert_close(exact[b:b + 1], alone)
    assert accuracy(out, exact).rel_l1 < BOUNDS["int8"]


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"][0]), "q must have 4 dimensions"),
    (lambda a: a.update(k=a["k"][:1]), "same batch size"),
    (lambda a: a.update(v=a["v"][..., :8]), "same head_dim"),
    (lambda a: a.update(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), "multiple of k/v.s heads"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), "q must be float16, bfloat16 or float32"),
    (lambda a: a.update(q=a["q"].double(), k=a["k"].double(), v=a["v"].double()), "float16, bfloat16 or float32"),
    (lambda a: a.update(k=a["k"].half()), "share one dtype"),
    (lambda a: a.update(qk="int2"), "qk must be one of"),
    (lambda a: a.update(pv="e5m2"), "pv must be one of"),
    (lambda a: a.update(layout="BHND"), "layout must be one of"),
    (lambda a: a.update(backend="cuda"), "backend must be one of"),
    (lambda a: a.update(kv_start=torch.zeros(3, dtype=torch.int64)), "kv_start must be an int32/int64 tensor"),
    (lambda a: a.update(kv_end=torch.tensor([9, 99])), "kv_end values must lie in"),
    (lambda a: a.update(v=a["v"][:, :, :5]), "same heads and tokens"),
    (lambda a: a.update(is_causal="yes"), "is_causal must be True or False; got 'yes'"),
    (lambda a: a.update(return_lse=None), "return_lse must be True or False; got None"),
])
def test_validation_errors(change, message):
    args = dict(q=torch.randn(2, 4, 8, 16), k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16))
    change(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=message):
        hf_qattn.qattn(q, k, v, **args)


def test_cpu_calls_are_counted(fresh_stats):
    q = torch.randn(1, 2, 4, 16)
    hf_qattn.qattn(q, q, q)
    assert fresh_stats()["calls"] == {"reference": 1}
    assert fresh_stats()["fallbacks"] == {}


def test_metrics():
    r = torch.randn(100).double()
    acc = accuracy(r, r)
    assert acc.cos_sim == pytest.approx(1.0) and acc.rel_l1 == 0 and acc.rmse == 0 and acc.score == pytest.approx(1.0)
    acc = accuracy(2 * r, r)
    assert acc.cos_sim == pytest.approx(1.0) and acc.rel_l1 == pytest.approx(1.0)
    assert acc.rmse == pytest.approx(math.sqrt((r ** 2).mean().item()))
    assert math.isnan(accuracy(torch.full((3,), float("nan")), torch.ones(3)).cos_sim)
    with pytest.raises(ValueError, match="same shape"):
        accuracy(r, r[:5])


def test_triton_backend_on_cpu_without_the_interpreter_is_one_clear_error(monkeypatch, fresh_stats):
    """Was: Triton's raw "0 active drivers" error, and the call counted as a triton call."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        hf_qattn.qattn(q, q, q, backend="triton")
    assert fresh_stats()["calls"] == {}

