"""No silently wrong answers from ``hf_qattn.qattn`` (issue 15, items 1-4): non-finite inputs, gradients,
zero-size dimensions, bad ``sm_scale`` and key ranges. Each test reproduces one defect as reported.

The kernels run under the Triton interpreter on the CPU (conftest.py); "every path" here is the
reference, the Triton kernel, the decode kernel and the SDPA fallback.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_qattn
from hf_qattn import reference, support

triton = pytest.importorskip("triton")

from hf_qattn.kernels import attention, decode, decode_launch, launch, tuning  # noqa: E402
from mutants import mutant_module  # noqa: E402  (tests/mutants.py)

if not (torch.cuda.is_available() or tuning.interpreting()):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZED = ["reference", "triton"]
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def qkv(b=2, h=2, n=24, d=16, dtype=torch.float32, device=DEVICE):
    return tuple(torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))


def ints(values, dtype=torch.int64):
    """Key-range ends on the inputs' device (the API refuses a range on another device)."""
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# --- 1. non-finite inputs come out non-finite, never as rows that saw no key ----------------------------
@pytest.mark.parametrize("backend", QUANTIZED)
@pytest.mark.parametrize("where, value", [("q", math.nan), ("q", math.inf), ("k", math.nan), ("k", -math.inf),
                                          ("v", math.nan)])
def test_non_finite_input_is_not_masked_into_zeros(seed, backend, where, value):
    """The reported case: one NaN in q made every row of the head zero with lse −inf."""
    q, k, v = qkv()
    {"q": q, "k": k, "v": v}[where][0, 1, 3, 5] = value
    out, lse = hf_qattn.qattn(q, k, v, return_lse=True, backend=backend)
    # the affected row is non-finite (smoothing's centers may carry it to the whole head: allowed)
    assert not torch.isfinite(out[0, 1, 3]).all()
    if where != "v":  # V does not enter the log-sum-exp
        assert not torch.isfinite(lse[0, 1, 3])
    # never the "saw no key" pattern: no row of the affected head is all zeros with lse −inf
    assert not ((out[0, 1] == 0).all(-1) & (lse[0, 1] == -math.inf)).any()
    # other heads and sequences are untouched: the clean sequence gets exactly what it gets alone
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, 0]).all()
    assert torch.equal(out[1:], hf_qattn.qattn(q[1:], k[1:], v[1:], backend=backend))


@pytest.mark.parametrize("backend", QUANTIZED)
def test_non_finite_input_without_smoothing_reaches_only_its_rows(seed, backend):
    """Without smoothing, a NaN in q reaches its row (and, at most, the rows sharing its scale group)."""
    q, k, v = qkv(b=1, h=1, n=64)
    q[0, 0, 40, 2] = math.nan
    out = hf_qattn.qattn(q, k, v, smooth_q=False, smooth_k=False, smooth_v=False, backend=backend)
    bad = ~torch.isfinite(out[0, 0]).all(-1)
    assert bad[40]
    group = range(32, 48)  # the interpreter's Q_GROUP (16 rows share a scale) and the H100's warp rows
    assert not bad[[i for i in range(64) if i not in group]].any()


@pytest.mark.parametrize("backend", QUANTIZED)
def test_rows_without_keys_stay_zero_beside_non_finite_rows(seed, backend):
    q, k, v = qkv(b=2)
    q[0, 0, 0, 0] = math.nan
    start, end = ints([0, 5]), ints([24, 5])  # sequence 1 sees no key
    out, lse = hf_qattn.qattn(q, k, v, return_lse=True, kv_start=start, kv_end=end, backend=backend)
    assert (out[1] == 0).all() and (lse[1] == -math.inf).all()
    assert not torch.isfinite(out[0, 0]).all()


def test_sdpa_fallback_propagates_non_finite_input(seed):
    q, k, v = qkv()
    q[0, 1, 3, 5] = math.nan
    q.requires_grad_(True)  # gradients: the SDPA fallback
    with pytest.warns(RuntimeWarning):
        out = hf_qattn.qattn(q, k, v)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isfinite(out[1]).all()


def test_kernel_epilogue_mutant_masks_nan_into_zeros(seed, tmp_path, monkeypatch):
    """The test above fails for the epilogue as it was (``seen = l_i > 0``): the defect's own mutant."""
    q, k, v = qkv(b=1, h=1)
    q[0, 0, 3, 5] = math.nan
    mutant = mutant_module(tmp_path, attention, "seen = l_i != 0.0", "seen = l_i > 0.0")
    monkeypatch.setattr(launch, "attention_kernel", mutant.attention_kernel)
    out, lse = hf_qattn.qattn(q, k, v, return_lse=True, backend="triton")
    assert (out == 0).all() and (lse == -math.inf).all()


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_kernel_propagates_non_finite_query(seed, splits, tmp_path, monkeypatch):
    from hf_qattn.kv_cache import reference as kv_reference

    k, v = torch.randn(1, 2, 40, 32, device=DEVICE), torch.randn(1, 2, 40, 32, device=DEVICE)
    k_bar, v_bar = kv_reference.centers(k, v)
    buf = kv_reference.allocate(1, 2, 48, 32, "int8", DEVICE)
    decode_launch.append(k, v, k_bar, v_bar, buf, 0)
    q = torch.randn(1, 4, 2, 32, device=DEVICE)
    q[0, 1, 0, 3] = math.nan

    def run():  # 16-key tiles: 40 keys make three, so two splits happen on a GPU too
        return decode_launch.decode(q, buf, v_bar, 40, num_splits=splits, block_n=16)

    out = run()  # (B, Nq, Hq, D)
    assert torch.isnan(out[0, 0, 1]).all()
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(out[0, 0, 0]).all()
    old = "seen = l_run != 0.0" if splits > 1 else "seen = l_i != 0.0"  # the splits' merge, or one split's end
    mutant = mutant_module(tmp_path, decode, old, old.replace("!= 0.0", "> 0.0"))
    monkeypatch.setattr(decode_launch, "decode_kernel", mutant.decode_kernel)
    assert (run()[0, 0, 1] == 0).all()  # what the test guards against


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "0.1", True, torch.tensor(0.1)])
def test_sm_scale_must_be_a_finite_real_number(bad):
    q, k, v = qkv(b=1, h=1, n=4)
    with pytest.raises(ValueError, match="sm_scale"):
        hf_qattn.qattn(q, k, v, sm_scale=bad)


def test_sm_scale_accepts_real_numbers(seed):
    import numpy as np

    q, k, v = qkv(b=1, h=1, n=8)
    base = hf_qattn.qattn(q, k, v, sm_scale=0.25)
    for scale in (np.float32(0.25), np.float64(0.25)):
        assert torch.equal(hf_qattn.qattn(q, k, v, sm_scale=scale), base)
    assert torch.isfinite(hf_qattn.qattn(q, k, v, sm_scale=0)).all()  # uniform attention


# --- 2. gradients: one behaviour on every path ------------------------------------------------------------
def test_gradients_fall_back_to_sdpa_with_right_gradients(seed, fresh_stats):
    """Was: wrong gradients on the reference path (cosine 0.08 to SDPA's), a detached output on the kernels."""
    q, k, v = (t.requires_grad_(True) for t in qkv(b=1, h=4, n=20, d=16))
    k2, v2 = (t.detach()[:, :2].clone().requires_grad_(True) for t in (k, v))  # GQA as well
    for kk, vv in ((k, v), (k2, v2)):
        q.grad = None
        out = hf_qattn.qattn(q, kk, vv, is_causal=True)
        assert out.requires_grad
        out.square().sum().backward()
        q_ref = q.detach().clone().requires_grad_(True)
        groups = q.shape[1] // kk.shape[1]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q_ref, kk.detach().repeat_interleave(groups, 1), vv.detach().repeat_interleave(groups, 1), is_causal=True)
        ref.square().sum().backward()
        assert torch.allclose(q.grad, q_ref.grad, atol=1e-5, rtol=1e-4)
    stats = fresh_stats()
    assert stats["calls"] == {"sdpa": 2} and stats["fallbacks"] == {support.REASON_GRAD: 2}


def test_gradients_with_lse_fall_back_too(seed, fresh_stats):
    q, k, v = qkv(b=1, h=1, n=8)
    q.requires_grad_(True)
    out, lse = hf_qattn.qattn(q, k, v, return_lse=True)
    assert lse.requires_grad
    lse.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert fresh_stats()["fallbacks"] == {support.REASON_GRAD: 1}


@pytest.mark.parametrize("backend", QUANTIZED)
def test_forced_backend_refuses_gradients(backend):
    q, k, v = qkv(b=1, h=1, n=8)
    with pytest.raises(RuntimeError, match="gradients"):
        hf_qattn.qattn(q, k.requires_grad_(True), v, backend=backend)


def test_no_grad_or_detached_inputs_run_quantized(seed, fresh_stats):
    q, k, v = qkv(b=1, h=1, n=8)
    q.requires_grad_(True)
    with torch.no_grad():
        hf_qattn.qattn(q, k, v)
    with torch.inference_mode():
        hf_qattn.qattn(q.detach(), k, v)
    hf_qattn.qattn(q.detach(), k, v)
    quantized_path, _ = support.select_path(q.detach())  # the reference on a CPU, a kernel on a GPU
    assert quantized_path != support.SDPA
    assert fresh_stats() == {"calls": {quantized_path: 3}, "fallbacks": {}}


# --- 3. zero-size dimensions -----------------------------------------------------------------------------
ZERO_SHAPES = {  # (b, hq, hk, nq, nk, d)
    "batch 0": (0, 2, 1, 5, 7, 16),
    "heads 0": (2, 0, 1, 5, 7, 16),
    "no heads at all": (2, 0, 0, 5, 7, 16),
    "queries 0": (2, 2, 1, 0, 7, 16),
    "keys 0": (2, 2, 1, 5, 0, 16),
    "head_dim 0": (2, 2, 1, 5, 7, 0),
}


@pytest.mark.parametrize("backend", ["auto", *QUANTIZED])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("name", list(ZERO_SHAPES))
def test_zero_size_dimensions_return_the_empty_result(monkeypatch, fresh_stats, backend, layout, name):
    """Was: batch 0 on the kernel path raised AssertionError: shape must be positive."""
    b, hq, hk, nq, nk, d = ZERO_SHAPES[name]

    def make(h, n):
        t = torch.randn(b, h, n, d, device=DEVICE, dtype=torch.float16)
        return t if layout == "HND" else t.transpose(1, 2).contiguous()

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty call")

    monkeypatch.setattr(launch, "triton_attention", no_launch)
    q, k, v = make(hq, nq), make(hk, nk), make(hk, nk)
    ranges = dict(kv_start=ints([0] * b), kv_end=ints([nk] * b)) if b else {}
    for causal in (False, True):
        out, lse = hf_qattn.qattn(q, k, v, layout=layout, is_causal=causal, return_lse=True, backend=backend,
                                  **ranges)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
        assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
        if nk == 0:
            assert (out == 0).all() and (lse == -math.inf).all()
        if d == 0 and not causal:  # every score is 0: lse = log Nk, as SDPA's softmax over Nk equal scores
            assert torch.allclose(lse, torch.full_like(lse, math.log(nk)))
        if d == 0 and causal:  # bottom-right causal: row i sees Nk − Nq + i + 1 keys
            seen = torch.arange(nq, device=DEVICE) + nk - nq + 1
            assert torch.allclose(lse[0, 0], seen.float().log())
    assert fresh_stats()["calls"] == {}


def test_zero_size_with_gradients(seed):
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = v = torch.randn(1, 2, 0, 8)
    out = hf_qattn.qattn(q, k, v)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# --- 4. key ranges --------------------------------------------------------------------------------------
def test_kv_start_after_kv_end_is_an_error():
    """Checked where the check is free: ranges in host memory (on a GPU it would wait for the device;
    the kernels read such a range as empty, the next test)."""
    q, k, v = qkv(b=3, h=1, n=8, device="cpu")
    with pytest.raises(ValueError, match=r"kv_start must not exceed kv_end; sequence 1 has kv_start 5 > kv_end 2"):
        hf_qattn.qattn(q, k, v, kv_start=torch.tensor([0, 5, 1]), kv_end=torch.tensor([8, 2, 1]))
    # start == end is an empty range (zeros), not an error
    out = hf_qattn.qattn(q, k, v, kv_start=torch.tensor([0, 3, 1]), kv_end=torch.tensor([8, 3, 1]))
    assert (out[1:] == 0).all() and (out[0] != 0).any()


def test_kernel_reads_start_after_end_as_an_empty_range(seed):
    """What a GPU call (not checked: that would wait for the device) gets: zeros and lse −inf."""
    q, k, v = qkv(b=2, h=2, n=40, d=32)
    out = torch.full_like(q, math.nan)
    start, end = ints([33, 20], torch.int32), ints([40, 3], torch.int32)
    for causal in (False, True):
        lse = launch.triton_attention(q, k, v, out, is_causal=causal, sm_scale=0.2, qk="int8", v_fp8=True,
                                         smooth_q=True, smooth_k=True, smooth_v=True, kv_start=start, kv_end=end,
                                         return_lse=True)
        assert (out[1] == 0).all() and (lse[1] == -math.inf).all()
        assert torch.isfinite(out[0]).all()


def test_a_collectives_unfinished_output_is_waited_for_before_the_kernels_read_it(monkeypatch):
    """diffusers' ring attention hands a shard's K and V over as an ``AsyncCollectiveTensor`` (the all-gather
    may still be in flight; its own ``data_ptr()`` is 0): the kernels must get the filled tensor."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    q, k, v = qkv(b=1, h=2, n=40, d=32)
    backend = "auto" if DEVICE == "cuda" else "triton"
    expected = hf_qattn.qattn(q, k, v, backend=backend, return_lse=True)
    shards = [AsyncCollectiveTensor(t) for t in (q, k, v)]
    seen = []
    run = hf_qattn.api.ops.run

    def recording_run(q, k, v, *args, **kwargs):
        seen.extend(type(t) for t in (q, k, v))
        return run(q, k, v, *args, **kwargs)

    monkeypatch.setattr(hf_qattn.api.ops, "run", recording_run)
    out, lse = hf_qattn.qattn(*(t.transpose(1, 2) for t in shards), layout="NHD", backend=backend, return_lse=True)
    assert seen == [torch.Tensor] * 3
    torch.testing.assert_close(out.transpose(1, 2), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, expected[1], rtol=0, atol=0)
