"""Time a fixed list of qattn calls from whichever hf_qattn is importable: for A/B runs of two builds.

    python3 eval/studies/time_calls.py LABEL [SHAPE ...]   # one line per shape: LABEL, shape, eager ms, graph ms

Run it alternately under two installs (PYTHONPATH=/tmp/a ..., PYTHONPATH=/tmp/b ...) in one session,
so both builds see the same GPU, clocks and host, and compare medians of the repeated lines. Eager:
``timing.bench_ms`` (``triton.testing.do_bench``'s median of back-to-back calls); graph:
``timing.bench_graph_ms``, the same call replayed from a CUDA graph (GPU time alone).
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
    ("d128 16k", 4, 32, 16384, 128, False, torch.float16),
    ("d128 8k causal", 4, 32, 8192, 128, True, torch.float16),
    ("d64 4k", 4, 32, 4096, 64, False, torch.float16),
    ("Flux-like", 1, 24, 4608, 128, False, torch.bfloat16),
]


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "build"
    for name, b, h, n, d, causal, dtype in SHAPES:
        if len(sys.argv) > 2 and name not in sys.argv[2:]:
            continue
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        call = lambda: hf_qattn.qattn(q, k, v, is_causal=causal)  # noqa: E731
        eager = bench_ms(call, warmup=25, rep=100)
        graph = bench_graph_ms(call, rep=100)
        print(f"{label} | {name} | {eager:.4f} | {graph:.4f}", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
