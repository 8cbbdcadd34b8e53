"""What filling the quantized KV cache costs at prefill, next to the prefill attention it accompanies (H100).

    bash eval/device_run.sh python3 eval/studies/prefill_fill_cost.py

QAttnCache quantizes the prompt's K/V once more when it stores them (the append kernel: per-token
scales, a format the prefill kernel's per-tile K/V pass does not produce). Per layer of a
Llama-3-8B-shaped model (Hq 32, Hk 8, d128, bf16, batch 1): GPU µs of that append (INT8 and INT4 K)
and of the layer's causal qattn prefill call, each from a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import torch

import hf_qattn
from hf_qattn.kv_cache import reference as kv_reference
from hf_qattn.kernels import decode_launch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import graph_ms  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    print("| prompt | prefill attention µs | append INT8 µs | append INT4 µs | append / attention |")
    print("|---|---|---|---|---|")
    for n in (1024, 4096, 16384):
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k_bar, v_bar = kv_reference.centers(k, v)
        attention = graph_ms(lambda: hf_qattn.qattn(q, k, v, is_causal=True)) * 1e3
        appends = []
        for int4 in (False, True):
            buf = kv_reference.allocate(1, 8, n, 128, "int4" if int4 else "int8", "cuda")
            appends.append(graph_ms(lambda: decode_launch.append(k, v, k_bar, v_bar, buf, 0)) * 1e3)
        print(f"| {n} | {attention:.1f} | {appends[0]:.1f} | {appends[1]:.1f} | {max(appends) / attention:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
