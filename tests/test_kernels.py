"""The real Triton kernels against the reference with the same tiles.

On a machine without a GPU they run under TRITON_INTERPRET=1 (set in conftest.py) with the
interpreter's small tiles, so small shapes still cross many tile boundaries. The kernel and the
reference compute the same function step by step; they may differ only where float32 rounding
(sum order of the smoothing centers, say) flips an FP8 or INT rounding, i.e. by a few FP8 steps
on a few elements. Mutated copies of the kernel (ΔS dropped, v̄ dropped, causal diagonal moved)
must fail the same check — that is what makes the tolerance meaningful.
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

import hf_qattn  # noqa: E402
from hf_qattn import reference  # noqa: E402
from hf_qattn.kernels import attention, launch, tuning  # noqa: E402
from mutants import mutant_module  # noqa: E402  (tests/mutants.py)
from hf_qattn.calibration.metrics import accuracy  # noqa: E402

if not (torch.cuda.is_available() or tuning.interpreting()):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def outlier_qkv(b, hq, hk, nq, nk, d, dtype):
    def make(h, n, offset):
        return torch.randn(b, h, n, d) + offset * torch.randn(1, h, 1, d)
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (make(hq, nq, 3.0), make(hk, nk, 8.0), make(hk, nk, 2.0)))


def kernel_and_reference(q, k, v, *, layout="HND", causal=False, qk="int8", kv_start=None, kv_end=None,
                         split_channel=False, smooth=True, **variants):
    """(kernel out, kernel lse, reference out, reference lse), all HND; reference with the kernel's tiles.
    ``smooth``: K and V smoothing; ``variants``: qattn's window / chunk / sinks / softcap, on both sides."""
    args = (q, k, v) if layout == "HND" else tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = hf_qattn.qattn(*args, is_causal=causal, qk=qk, layout=layout, kv_start=kv_start, kv_end=kv_end,
                              return_lse=True, backend="triton", split_channel=split_channel, smooth_k=smooth,
                              smooth_v=smooth, **variants)
    if layout == "NHD":
        out = out.transpose(1, 2)
    config = tuning.attention_config(tuning.arch_of(q.device), q.shape[-1], causal, "fp8", qk)
    # the kernel's own centers: the reference's torch mean sums in another order, and a last-bit difference
    # in k̄ can flip an INT8 rounding tie (seen: lse off by 2.6e-3, HF_QATTN_SEED=1243664804)
    centers = tuple(c.view(t.shape[0], t.shape[1], -1) for c, t in
                    zip(launch.smoothing_centers(q, k, v, True, smooth, smooth), (q, k, v)))
    ref, ref_lse = reference.quantized_attention(q, k, v, is_causal=causal, qk=qk, kv_start=kv_start, kv_end=kv_end,
                                                 return_lse=True, centers=centers, split_channel=split_channel,
                                                 **tuning.reference_settings(config), **variants)
    return out, lse, ref, ref_lse


def mismatch(out, ref, lse, ref_lse) -> str | None:
    """Why the kernel's result is not the reference's up to a few FP8 steps, or None if it is."""
    # one step of the output dtype is allowed on top: the interpreter rounds float32 → bfloat16 by
    # truncation where the GPU rounds to nearest
    dtype_step = torch.finfo(out.dtype).eps
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return "non-finite output"
    scale = ref.abs().max().clamp_min(1e-6)
    diff = (out - ref).abs()
    if diff.max() > 0.03 * scale:
        return f"max |kernel − reference| = {diff.max():.4g} > 3% of max |ref| ({scale:.4g})"
    if diff.mean() > (2e-3 + dtype_step) * ref.abs().mean():
        return f"mean |kernel − reference| = {diff.mean():.4g} > {2e-3 + dtype_step:.2%} of mean |ref|"
    finite = torch.isfinite(ref_lse)
    if not torch.equal(finite, torch.isfinite(lse)):
        return "lse is infinite in different rows"
    if finite.any() and (lse - ref_lse)[finite].abs().max() > 1e-3:
        return f"max lse difference {(lse - ref_lse)[finite].abs().max():.3g} > 1e-3"
    return None


CASES = [
    dict(b=2, hq=4, hk=2, nq=70, nk=70, d=64, causal=False, dtype=torch.float16),
    dict(b=2, hq=4, hk=2, nq=70, nk=70, d=64, causal=True, dtype=torch.bfloat16),
    dict(b=1, hq=3, hk=1, nq=20, nk=53, d=32, causal=True, dtype=torch.float16),  # bottom-right diagonal
    dict(b=2, hq=2, hk=2, nq=40, nk=24, d=32, causal=True, dtype=torch.bfloat16),  # rows with no key
    dict(b=2, hq=4, hk=4, nq=1, nk=45, d=64, causal=True, dtype=torch.float16),  # decoding
    dict(b=1, hq=2, hk=2, nq=33, nk=33, d=40, causal=False, dtype=torch.float32),  # head dim padded to 64
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items() if k != "dtype")
                         + "-" + str(c["dtype"]).split(".")[-1])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_kernel_matches_reference(seed, case, layout):
    q, k, v = outlier_qkv(case["b"], case["hq"], case["hk"], case["nq"], case["nk"], case["d"], case["dtype"])
    out, lse, ref, ref_lse = kernel_and_reference(q, k, v, layout=layout, causal=case["causal"])
    assert out.dtype == case["dtype"]
    assert mismatch(out, ref, lse, ref_lse) is None, mismatch(out, ref, lse, ref_lse)
    exact = reference.exact_attention(q, k, v, is_causal=case["causal"])
    assert accuracy(out, exact).rel_l1 < 0.03, accuracy(out, exact)


@pytest.mark.parametrize("causal", [False, True])
def test_int4_and_key_ranges(seed, causal):
    q, k, v = outlier_qkv(3, 2, 2, 50, 50, 32, torch.float16)
    start = torch.tensor([0, 7, 20], device=DEVICE)
    end = torch.tensor([50, 41, 50], device=DEVICE)
    for qk in ("int8", "int4"):
        out, lse, ref, ref_lse = kernel_and_reference(q, k, v, causal=causal, qk=qk, kv_start=start, kv_end=end)
        assert mismatch(out, ref, lse, ref_lse) is None, (qk, mismatch(out, ref, lse, ref_lse))
        exact = reference.exact_attention(q, k, v, is_causal=causal, kv_start=start, kv_end=end)
        assert accuracy(out, exact).rel_l1 < (0.03 if qk == "int8" else 0.3)


def test_outputs_are_fully_written(seed):
    """Every output element is written: poison the buffer, run, check nothing of the poison is left."""
    q, k, v = outlier_qkv(1, 2, 2, 37, 37, 32, torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = launch.triton_attention(q, k, v, out, is_causal=True, sm_scale=32 ** -0.5, qk="int8", v_fp8=True,
                                     smooth_q=True, smooth_k=True, smooth_v=True, kv_start=None, kv_end=None,
                                     return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("d,shape", [(48, dict(RANGE_ROWS=48, CHUNK_ROWS=16)), (48, dict(RANGE_ROWS=16, CHUNK_ROWS=16)),
                                     (48, dict(RANGE_ROWS=4096, CHUNK_ROWS=32)), (48, {}), (100, {}), (200, {})])
def test_centers_launch_finds_each_channels_range_over_all_keys(seed, d, shape):
    """V's and K's range per channel (max x, max −x) over every key, from the same launch as the centers, under
    blocks of keys that do not divide the length (nor the chunk the block), and under the shipped shape of each
    padded head dim ({}: kernels.json's, at 64 / 128 / 256): exact, as max is. One large value of each sign is
    planted per head at a random key, where a block or chunk that skipped rows would miss it."""
    b, hk, n = 2, 3, 203 if shape else 531
    q = torch.randn(b, 2 * hk, n, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, n, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for x in (k, v):
        for bh in range(b * hk):
            x[bh // hk, bh % hk, torch.randint(n, ()), torch.randint(d, ())] = 40.0
            x[bh // hk, bh % hk, torch.randint(n, ()), torch.randint(d, ())] = -50.0
    d_pad = tuning.padded_head_dim(d)
    ranges = torch.full((2, b * hk, 2, d_pad), float("-inf"), device=DEVICE)
    launch.smoothing_centers(q, k, v, True, True, True, v_range=ranges[0], k_range=ranges[1], **shape)
    for got, x in zip(ranges, (v, k)):
        x = x.float().reshape(b * hk, n, d)
        assert torch.equal(got[:, 0, :d], x.amax(1)) and torch.equal(got[:, 1, :d], (-x).amax(1))
        assert torch.isneginf(got[:, :, d:]).all()  # padding channels stay −inf: nothing is read there


# --- mutants: the check above must catch a broken kernel -------------------------------------------
MUTATIONS = {
    "drop ΔS": ("bias = tl.load(DS_bhq + offs_n)[None, :]", "bias = 0.0 * tl.load(DS_bhq + offs_n)[None, :]"),
    "drop v̄": ("acc / l_safe[:, None] + v_bar", "acc / l_safe[:, None]"),
    "causal diagonal top-left": ("diag_offset = NK - NQ", "diag_offset = NK * 0"),
}


def mutant_kernel(tmp_path, old, new):
    """A copy of the attention kernel with one edit (tests/mutants.py)."""
    return mutant_module(tmp_path, attention, old, new).attention_kernel


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutants_fail_the_check(seed, tmp_path, monkeypatch, name):
    q, k, v = outlier_qkv(1, 2, 2, 24, 40, 32, torch.float16)
    out, lse, ref, ref_lse = kernel_and_reference(q, k, v, causal=True)
    assert mismatch(out, ref, lse, ref_lse) is None
    monkeypatch.setattr(launch, "attention_kernel", mutant_kernel(tmp_path, *MUTATIONS[name]))
    out, lse, ref, ref_lse = kernel_and_reference(q, k, v, causal=True)
    assert mismatch(out, ref, lse, ref_lse) is not None, f"the mutant '{name}' passed the check"


# --- the split channel: one zero-mean outlier channel of K, computed in float outside K̂ ------------
def zero_mean_outlier_qkv(b, hq, hk, n, d, channel, dtype, size=300.0):
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hk, hk))
    k[..., ::2, channel], k[..., 1::2, channel] = size, -size  # smoothing cannot remove it (mean 0)
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_split_channel_kernel_matches_reference(seed, causal):
    q, k, v = zero_mean_outlier_qkv(2, 4, 2, 70, 32, channel=5, dtype=torch.float16)
    k[1, 1] = torch.randn_like(k[1, 1])  # one kv head without an outlier: no split there
    kv = launch.quantize_kv(q, k, v, sm_scale=0.2, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True,
                            smooth_v=True, kv_start=None, kv_end=None, block_n=16, k_token_scale=False, split=True)
    assert kv.split.tolist() == [5, 5, 5, -1]
    k_bar = kv.k_bar.view(2, 2, -1)
    assert kv.split.tolist() == hf_qattn.quant.split_channel(k, k_bar).flatten().tolist()
    want = (k.float() - k_bar[:, :, None])[..., 5] * (kv.split >= 0).view(2, 2, 1)
    assert torch.equal(kv.kc.view(2, 2, -1)[:, :, :70], want)
    out, lse, ref, ref_lse = kernel_and_reference(q, k, v, causal=causal, split_channel=True)
    assert mismatch(out, ref, lse, ref_lse) is None, mismatch(out, ref, lse, ref_lse)
    exact = reference.exact_attention(q, k, v, is_causal=causal)
    assert accuracy(out, exact).cos_sim > 0.99, accuracy(out, exact)
    plain, *_ = kernel_and_reference(q, k, v, causal=causal)  # the default: no split, the outlier crushes K̂
    assert accuracy(plain, exact).cos_sim < 0.95


def test_dropping_the_split_term_fails_the_check(seed, tmp_path, monkeypatch):
    q, k, v = zero_mean_outlier_qkv(1, 2, 2, 40, 32, channel=3, dtype=torch.float16)
    old = "bias += q_split[:, None] * tl.load(KC_bhk + offs_n)[None, :]"
    monkeypatch.setattr(launch, "attention_kernel", mutant_kernel(tmp_path, old, "bias += 0.0 * q_split[:, None]"))
    out, lse, ref, ref_lse = kernel_and_reference(q, k, v, split_channel=True)
    assert mismatch(out, ref, lse, ref_lse) is not None
