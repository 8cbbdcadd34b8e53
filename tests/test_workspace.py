"""The K/V pass's buffers kept from one attention call to the next of the same shapes (kernels/workspace.py).

A kept buffer is overwritten by the next call: these tests check that calls of one shape, of other shapes in
between, and with the variants' extra buffers (ranges, the split channel) give the same output as calls with
nothing kept, bit for bit — on the GPU through the Hopper kernel (its TMA descriptors kept too), on the CPU through
the portable kernel under the interpreter — and the budget's rules.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import hf_qattn  # noqa: E402
from hf_qattn.kernels import launch, settings, tuning, workspace  # noqa: E402

if not (torch.cuda.is_available() or tuning.interpreting()):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "auto" if DEVICE == "cuda" else "triton"  # the Hopper kernel on an H100 / H200; on the CPU "auto" is the reference


@pytest.fixture(autouse=True)
def nothing_kept():
    workspace.release()
    yield
    workspace.release()


def _qkv(b, hq, hk, n, d, outlier=False):
    """q, k, v; with ``outlier`` K's channel 5 alternates ±60 over tokens (one the split channel takes out)."""
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE) + offset for h, offset in ((hq, 0.5), (hk, 3.0), (hk, 1.0)))
    if outlier:
        k[..., 5] += 60.0 * (1 - 2 * (torch.arange(n, device=DEVICE) % 2))
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


# (B, Hq, Hk, N, D) and qattn's options: plain, causal GQA, and with the split channel (its range and kc rows)
CALLS = [((1, 2, 2, 96, 64), {}),
         ((2, 4, 2, 80, 128), dict(is_causal=True)),
         ((1, 2, 1, 96, 64), dict(split_channel=True, return_lse=True))]


def _run_all(inputs):
    return [hf_qattn.qattn(*qkv, backend=BACKEND, **options) for qkv, (_, options) in zip(inputs, CALLS)]


def test_kept_buffers_give_the_outputs_of_new_ones(monkeypatch, seed):
    # the first inputs with an outlier channel, the second without: buffers left as the first calls wrote them
    # (K's and V's ranges, which the next call must start again from −inf) would split it in the second too
    first = [_qkv(*shape, outlier=True) for shape, _ in CALLS]
    second = [_qkv(*shape) for shape, _ in CALLS]
    monkeypatch.setenv(settings.WORKSPACE_MB, "0")
    fresh = _run_all(first) + _run_all(second)
    assert workspace.kept_bytes() == 0
    monkeypatch.setenv(settings.WORKSPACE_MB, "256")
    # each shape twice with the others in between: the second call of a shape overwrites its kept buffers
    kept = _run_all(first)
    held = workspace.kept_bytes()
    assert held > 0
    kept += _run_all(second)
    assert workspace.kept_bytes() == held  # reused, not made again
    for a, b in zip(fresh, kept):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)


def test_a_caller_holding_the_pass_output_gets_its_own_buffers():
    q, k, v = _qkv(1, 2, 2, 64, 64)
    options = dict(sm_scale=0.125, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True, smooth_v=True, kv_start=None,
                   kv_end=None, block_n=32, k_token_scale=False)
    held = launch.quantize_kv(q, k, v, **options)
    kept = launch.quantize_kv(q, k, v, **options, keep=True)
    again = launch.quantize_kv(q, k, v, **options, keep=True)
    assert held.kq.data_ptr() != kept.kq.data_ptr() and kept.kq.data_ptr() == again.kq.data_ptr()
    assert torch.equal(held.kq, again.kq) and torch.equal(held.ds, again.ds)


def _spec(n):
    return (("x", (n,), torch.float32),)


def test_budget_keeps_the_most_recent_within_it(monkeypatch):
    device = torch.device(DEVICE)
    monkeypatch.setenv(settings.WORKSPACE_MB, str(3 * 4096 / 2 ** 20))  # three buffers of 1,024 floats
    a, b, c = (workspace.get(_spec(1024 - i), device, keep=True) for i in range(3))
    assert workspace.kept_bytes() == 4 * (1024 + 1023 + 1022) and workspace.get(_spec(1024), device, True) is a
    d = workspace.get(_spec(1000), device, keep=True)  # evicts the least recently used: b (a was just used)
    assert workspace.get(_spec(1000), device, True) is d
    assert workspace.get(_spec(1024), device, True) is a and workspace.get(_spec(1022), device, True) is c
    assert workspace.get(_spec(1023), device, True) is not b  # made again (and d, now the oldest use, out)
    huge = workspace.get(_spec(10 ** 6), device, keep=True)  # over the budget: its own, not kept
    assert workspace.get(_spec(10 ** 6), device, True) is not huge
    assert workspace.kept_bytes() <= 3 * 4096
    assert workspace.get(_spec(1024), device, keep=False) is not workspace.get(_spec(1024), device, keep=False)
    monkeypatch.setenv(settings.WORKSPACE_MB, "0")
    assert workspace.get(_spec(8), device, True) is not workspace.get(_spec(8), device, True)


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_budget_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(settings.WORKSPACE_MB, value)
    with pytest.raises(ValueError, match=settings.WORKSPACE_MB):
        settings.workspace_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and graph capture are CUDA's")
def test_other_streams_and_graph_capture_get_their_own_buffers():
    device = torch.device("cuda")
    spec = _spec(256)
    mine = workspace.get(spec, device, keep=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = workspace.get(spec, device, keep=True)
    assert other is not mine and workspace.get(spec, device, keep=True) is mine
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = workspace.get(spec, device, keep=True)
    assert captured is not mine and captured is not other
