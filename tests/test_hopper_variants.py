"""The attention variants of issue 27 (sliding window, chunks, sinks, soft-capping) on the sm90 Gluon kernel.

On any machine: every variant switch, alone and together, and head dim 256 compile for sm_90 with their
wgmma and TMA, no spills and no local memory in the main loops (``offline_build``, as tests/test_hopper.py
does for the shipped configurations). On an H100/H200 (skipped elsewhere): the kernel against

- ``exact``, written here from the definitions (float32, not the code under test): cosine and RelL1;
- the quantized reference with the Hopper kernel's granularities (``reference.quantized_attention``): the
  same quantization, so the kernel must match it to a few FP8 steps, as ``eval/check_device.py`` holds the
  plain kernel; the lse too;
- the portable Triton kernel with the same variant: both near ``exact``, and near each other.

Windows and chunks are not multiples of the 128-key tiles, prompts are longer than the window, query
blocks start inside chunks, Nq ≠ Nk (bottom-right alignment; rows at negative positions see no key), GQA,
key ranges, both layouts, persistent CTAs (whose ring position must count the same skipped tiles in the
loader and the consumers: a mismatch deadlocks or reads the wrong stage), and long prompts (several
two-level flushes inside a window or chunk).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_qattn import reference
from hf_qattn.kernels import launch, tuning
from hf_qattn.kernels.hopper import gluon_api
from test_hopper import offline_report  # noqa: E402  (tests/test_hopper.py)

needs_gluon = pytest.mark.skipif(gluon_api.missing() is not None, reason=f"{gluon_api.missing()}")
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not ON_SM90 or gluon_api.missing() is not None,
                                reason="needs an sm90 GPU (H100/H200) and Gluon")

VARIANT_SWITCHES = ("window", "chunk", "sinks", "softcap")


# -- compiles for sm_90 (no GPU needed) ------------------------------------------------------------------

def _build(d: int, **switches) -> dict:
    """A build as a call launches it (offline_build picks the CTA: tuning.hopper_solo, and the causal split for
    ``keys``)."""
    return {"head_dim": d, "persistent": tuning.hopper_config(d)["PERSISTENT"], **switches}


# each switch alone (window and chunk need causal), the two families' combinations (gpt-oss: sinks in a
# window; Gemma 2: softcap in a window), and every switch at once on the heaviest configuration
BUILDS = [
    _build(d, **v) for d in (64, 128) for v in (
        {"causal": True, "window": True},
        {"causal": True, "chunk": True},
        {"sinks": True, "return_lse": True},
        {"softcap": True},
        {"softcap": True, "sinks": True, "keys": 32768},  # long full attention
        {"causal": True, "window": True, "sinks": True},
        {"causal": True, "window": True, "softcap": True},
        {"causal": True, "window": True, "chunk": True, "sinks": True, "softcap": True, "return_lse": True,
         "has_kv_range": True, "dtype": "bf16"},
    )
] + [  # head dim 256 (key tiles of 64, kernels.json): plain, as shipped, and with the variants
    _build(256, **v) for v in (
        {}, {"causal": True, "return_lse": True, "has_kv_range": True, "dtype": "bf16"},
        {"causal": True, "window": True}, {"causal": True, "window": True, "softcap": True},
        {"causal": True, "window": True, "chunk": True, "sinks": True, "softcap": True, "return_lse": True,
         "has_kv_range": True, "dtype": "bf16"},
    )
]



@needs_gluon
@pytest.mark.parametrize("config", BUILDS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_variant_compiles_for_sm90_with_wgmma_tma_and_no_spills(config):
    report = offline_report(config)
    assert report["IGMMA"] > 0 and report["QGMMA"] > 0 and report["UTMALDG"] >= 3, report
    assert report["spill_bytes"] == 0, report
    assert report["loop_local"] and set(report["loop_local"]) == {0}, "no local memory in any consumer's main loop"
    # outside the main loops ptxas may keep one value (the thread index) in a stack slot without reporting a
    # spill: a load per work item, not per tile (offline_build.loop_local_memory). Measured: window + softcap
    # at d128, 9–10 loads of one slot stored once; window + sinks at d256, 2 and 2; none elsewhere
    assert report["LDL"] <= 12 and report["STL"] <= 2, report
    assert report["shared"] <= 227 * 1024, report


@pytest.mark.parametrize("path", ["hopper", "triton", "reference"])
def test_window_and_chunk_need_a_causal_call(path):
    """The public op refuses a non-causal window or chunk on every path, before any launch (qattn checks it
    too; the op is callable on its own)."""
    q = torch.zeros(1, 1, 4, 64)
    for variant in ({"window": 16}, {"chunk": 16}):
        with pytest.raises(ValueError, match="is_causal"):
            torch.ops.hf_qattn.attention(q, q, q, None, None, path, False, 0.125, "int8", "fp8", "HND", True, True,
                                         True, False, False, **variant)


# -- on the GPU -------------------------------------------------------------------------------------------

def exact(q, k, v, *, sm_scale, causal, window=None, chunk=None, sinks=None, softcap=None, kv_start=None,
          kv_end=None):
    """(out, lse) in float32 from the definitions, one query head at a time: query row i at key position
    p = i + Nk − Nq sees keys j in [kv_start, kv_end) with j ≤ p (causal), p − W < j (window),
    j // C == p // C (chunk); s = sm_scale·q·k, capped to c·tanh(s / c); the sink one more logit, no value."""
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    dev = q.device
    p = torch.arange(nq, device=dev)[:, None] + (nk - nq)
    j = torch.arange(nk, device=dev)[None, :]
    seen = torch.ones(b, nq, nk, dtype=torch.bool, device=dev)
    if causal:
        seen &= j <= p
    if window is not None:
        seen &= j > p - window
    if chunk is not None:
        seen &= torch.div(j, chunk, rounding_mode="floor") == torch.div(p, chunk, rounding_mode="floor")
    if kv_start is not None:
        seen &= j >= kv_start.view(b, 1, 1)
    if kv_end is not None:
        seen &= j < kv_end.view(b, 1, 1)
    outs, lses = [], []
    for h in range(hq):
        s = torch.einsum("bid,bjd->bij", q[:, h].float(), k[:, h // (hq // hk)].float()) * sm_scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~seen, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks[h].float().expand(b, nq, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        w = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])[..., :nk]
        outs.append(w @ v[:, h // (hq // hk)].float())
        lses.append(lse)
    return torch.stack(outs, 1), torch.stack(lses, 1)


def _metrics(x, ref):
    x, ref = x.float().flatten(), ref.float().flatten()
    return (torch.nn.functional.cosine_similarity(x, ref, dim=0).item(),
            ((x - ref).abs().sum() / ref.abs().sum().clamp_min(1e-30)).item())


# (b, hq, hk, nq, nk, d, variants, kv range, layout, persistent); kv range: per batch (start, end) or None
CASES = [
    # windows not multiples of 128, Nq = Nk, GQA; the long-prompt cases flush the two-level sum in a window
    (2, 8, 2, 1000, 1000, 128, {"window": 300}, None, "HND", False),
    (2, 8, 2, 1000, 1000, 128, {"window": 300}, None, "HND", True),
    (2, 4, 4, 300, 1234, 64, {"window": 200}, ((0, 1234), (37, 1100)), "NHD", False),
    (1, 4, 1, 1234, 300, 128, {"window": 77}, None, "HND", False),  # rows at negative positions see no key
    (1, 4, 2, 1, 777, 128, {"window": 129}, None, "HND", False),  # one query
    (1, 4, 2, 8192, 8192, 128, {"window": 1024}, None, "HND", True),
    # chunks: boundaries inside query blocks and key tiles, and on them
    (2, 8, 2, 1000, 1000, 128, {"chunk": 300}, None, "HND", False),
    (2, 8, 8, 1000, 1000, 64, {"chunk": 256}, ((0, 1000), (100, 900)), "HND", True),
    (1, 4, 2, 300, 1000, 128, {"chunk": 333}, None, "NHD", False),
    (1, 4, 2, 8192, 8192, 128, {"chunk": 2048}, None, "HND", False),
    (2, 8, 2, 1000, 1000, 128, {"window": 200, "chunk": 333}, None, "HND", True),
    # sinks: with and without a causal mask, one large enough to outweigh every key, rows that see no key
    (2, 8, 1, 1000, 1000, 64, {"sinks": True}, None, "HND", False),
    (2, 8, 2, 1000, 1000, 64, {"sinks": True, "window": 128}, ((0, 1000), (300, 1000)), "HND", True),
    (1, 4, 2, 8192, 8192, 64, {"sinks": True, "window": 128}, None, "HND", True),
    (1, 4, 4, 1234, 300, 128, {"sinks": True, "causal": True}, None, "HND", False),
    # soft-capping, scores large enough that the cap bends them
    (2, 8, 2, 1000, 1000, 128, {"softcap": 20.0}, None, "HND", False),
    (2, 8, 2, 1000, 1000, 64, {"softcap": 50.0, "window": 300}, ((0, 1000), (0, 700)), "NHD", True),
    (2, 8, 2, 1000, 1000, 128, {"softcap": 30.0, "sinks": True, "window": 250, "chunk": 400}, None, "HND", False),
    # head dim 256 (Gemma 2 / 3): plain, sliding, soft-capped, and a long sliding prompt
    (2, 4, 2, 1000, 1000, 256, {}, None, "HND", False),
    (2, 4, 2, 1000, 1000, 256, {"causal": True}, ((0, 1000), (100, 900)), "NHD", False),
    (2, 4, 2, 1000, 1000, 256, {"window": 300, "softcap": 50.0}, None, "HND", False),
    (1, 4, 2, 8192, 8192, 256, {"window": 1024}, None, "HND", False),
]


def _case_id(case):
    b, hq, hk, nq, nk, d, variants, kv_range, layout, persistent = case
    parts = [f"b{b}h{hq}k{hk}", f"{nq}x{nk}", f"d{d}", *(f"{k}={v}" for k, v in variants.items()), layout]
    return "-".join(parts + (["range"] if kv_range else []) + (["persistent"] if persistent else []))


def _inputs(case, dtype=torch.float16):
    b, hq, hk, nq, nk, d, variants, kv_range, layout, _ = case
    dev = "cuda"
    # channel offsets (what the smoothing removes) and, with a soft cap, scores large enough to be bent
    scale = 3.0 if "softcap" in variants else 1.0
    q = (torch.randn(b, hq, nq, d, device=dev) + torch.randn(1, 1, 1, d, device=dev)) * scale
    k = (torch.randn(b, hk, nk, d, device=dev) + 2 * torch.randn(1, hk, 1, d, device=dev)) * scale
    v = torch.randn(b, hk, nk, d, device=dev) + torch.randn(1, hk, 1, d, device=dev)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if layout == "NHD":  # a real NHD tensor, read through its transposed view by strides
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    kv_start = kv_end = None
    if kv_range is not None:
        kv_start = torch.tensor([r[0] for r in kv_range], device=dev, dtype=torch.int32)
        kv_end = torch.tensor([r[1] for r in kv_range], device=dev, dtype=torch.int32)
    sinks = None
    if variants.get("sinks"):
        sinks = 2 * torch.randn(hq, device=dev)
        sinks[0] = 30.0  # outweighs every key of head 0: its rows are mostly the sink's
        sinks = sinks.to(dtype)  # in the model's dtype, as gpt-oss keeps them: the kernel reads them as they are
    call = dict(window=variants.get("window"), chunk=variants.get("chunk"), sinks=sinks,
                softcap=variants.get("softcap"))
    causal = bool(variants.get("causal") or call["window"] or call["chunk"])
    return q, k, v, kv_start, kv_end, causal, call


@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hopper_variant_against_exact_reference_and_portable_kernel(case):
    persistent = case[-1]
    q, k, v, kv_start, kv_end, causal, call = _inputs(case)
    sm_scale = q.shape[-1] ** -0.5
    common = dict(is_causal=causal, sm_scale=sm_scale, qk="int8", smooth_q=True, smooth_k=True, smooth_v=True,
                  kv_start=kv_start, kv_end=kv_end, return_lse=True)
    kernel_call = dict(window=call["window"] or 0, chunk=call["chunk"] or 0, sinks=call["sinks"],
                       softcap=call["softcap"] or 0.0)
    out = torch.full_like(q, float("nan"))
    lse = launch.hopper_attention(q, k, v, out, persistent=persistent, **common, **kernel_call)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()

    ref_out, ref_lse = exact(q, k, v, sm_scale=sm_scale, causal=causal, kv_start=kv_start, kv_end=kv_end, **call)
    cos, rel_l1 = _metrics(out, ref_out)
    assert cos >= 0.998 and rel_l1 <= 0.04, (cos, rel_l1)

    # the same quantization simulated: within a few FP8 steps of it, and no further from exact than it is
    sim, sim_lse = reference.quantized_attention(q, k, v, **{n: common[n] for n in ("is_causal", "sm_scale", "qk")},
                                                 kv_start=kv_start, kv_end=kv_end, return_lse=True, **call,
                                                 **{**tuning.hopper_reference_settings(bool(call.get("softcap"))),  # the head dim's tiles
                                                    "block_n": tuning.hopper_config(q.shape[-1])["BLOCK_N"]})
    diff = (out.float() - sim.float()).abs()
    frac = (diff > 0.02 * sim.float().abs().amax()).float().mean().item()
    assert frac <= 1e-3, frac
    assert rel_l1 <= _metrics(sim, ref_out)[1] + 0.01
    gap = (lse - sim_lse).abs().nan_to_num(0.0)
    # the kernel and the simulation round a few Q/K elements differently (ties, FP32 order): their scores differ
    # by a step of the INT8 grid, which grows with |q|·|k| — the soft-cap cases scale q and k by 3 (scores ×9)
    score_scale = 9.0 if call["softcap"] else 1.0
    assert (gap <= 0.01 * score_scale + 4e-6 * sim_lse.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)).all(), gap.max()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see no key (and no sink): lse −inf"
    # against exact, the lse moves with the quantized scores (tenths where scores are large: the soft-cap cases):
    # on average no further than the simulated quantization's
    seen = torch.isfinite(ref_lse)
    assert (lse[seen] - ref_lse[seen]).abs().mean() <= (sim_lse[seen] - ref_lse[seen]).abs().mean() + 0.005

    # the portable kernel with the same variant: the two quantized paths agree with each other
    portable = torch.full_like(q, float("nan"))
    portable_lse = launch.triton_attention(q, k, v, portable, v_fp8=True, **common, **kernel_call)
    torch.cuda.synchronize()
    p_cos, _ = _metrics(portable, ref_out)
    assert p_cos >= 0.998, p_cos
    assert _metrics(out, portable)[1] <= 0.05
    assert torch.equal(torch.isinf(lse), torch.isinf(portable_lse))


@needs_sm90
def test_sinks_only_rows_that_see_no_key_give_zeros_and_the_sink_as_lse():
    """Nq > Nk causal: the first Nq − Nk rows see no key; with a sink their output is 0 and their lse the sink."""
    q, k, v, _, _, causal, call = _inputs((1, 4, 2, 400, 100, 64, {"sinks": True, "causal": True}, None, "HND",
                                           False))
    call["sinks"][1] = -150.0  # far below any score: the lse of a row without keys must still be the sink
    out = torch.full_like(q, float("nan"))
    lse = launch.hopper_attention(q, k, v, out, is_causal=True, sm_scale=0.125, qk="int8", smooth_q=True,
                                  smooth_k=True, smooth_v=True, kv_start=None, kv_end=None, return_lse=True,
                                  sinks=call["sinks"])
    torch.cuda.synchronize()
    blind = slice(0, 300)  # row i sits at key position i − 300: rows below 300 see no key
    assert (out[:, :, blind] == 0).all()
    torch.testing.assert_close(lse[:, :, blind], call["sinks"].float().view(1, 4, 1).expand(1, 4, 300), rtol=0,
                               atol=1e-4)
    # head 0's sink (30) takes all but ~e^-30 of each row: in float16 its output underflows to zero
    assert (out[:, 1:, 300:] != 0).any(dim=-1).all(), "every row from 300 on sees a key"
