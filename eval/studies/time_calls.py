"""Time a fixed list of qattn calls from whichever hf_qattn is importable: for A/B runs of two builds.

    python3 eval/studies/time_calls.py LABEL [--cudnn] [SHAPE ...]   # a line a shape: LABEL, shape, eager ms, graph ms

Run it alternately under two installs (PYTHONPATH=/tmp/a ..., PYTHONPATH=/tmp/b ...) in one session,
so both builds see the same GPU, clocks and host, and compare medians of the repeated lines. Eager:
``timing.bench_ms`` (``triton.testing.do_bench``'s median of back-to-back calls); graph:
``timing.bench_graph_ms``, the same call replayed from a CUDA graph (GPU time alone). ``--cudnn``: SDPA's cuDNN
backend on the same inputs too, timed alike, on a line of its own (LABEL "cudnn").
"""

from __future__ import annotations

import os
import sys

import torch

import hf_qattn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import bench_graph_ms, bench_ms  # noqa: E402

SHAPES = [  # label, B, H, N, d, causal, dtype
    ("d128 1k", 4, 32, 1024, 128, False, torch.float16),
    ("d128 4k", 4, 32, 4096, 128, False, torch.float16),
    ("d128 6k", 4, 32, 6144, 128, False, torch.float16),
    ("d128 8k", 4, 32, 8192, 128, False, torch.float16),
    ("d128 16k", 4, 32, 16384, 128, False, torch.float16),
    ("d128 32k", 4, 32, 32768, 128, False, torch.float16),
    ("d128 8k causal", 4, 32, 8192, 128, True, torch.float16),
    ("d64 4k", 4, 32, 4096, 64, False, torch.float16),
    ("Flux-like", 1, 24, 4608, 128, False, torch.bfloat16),
    ("Wan-denoiser-like", 1, 40, 17160, 128, False, torch.bfloat16),  # the video tokens of bench_models.py's Wan
]


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "build"
    cudnn = "--cudnn" in sys.argv[2:]
    names = [a for a in sys.argv[2:] if a != "--cudnn"]
    for name, b, h, n, d, causal, dtype in SHAPES:
        if names and name not in names:
            continue
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        calls = {label: lambda: hf_qattn.qattn(q, k, v, is_causal=causal)}
        if cudnn:
            def sdpa():
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            calls["cudnn"] = sdpa
        for who, call in calls.items():
            eager = bench_ms(call, warmup=25, rep=100)
            graph = bench_graph_ms(call, rep=100)
            print(f"{who} | {name} | {eager:.4f} | {graph:.4f}", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
