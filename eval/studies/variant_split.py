"""Where a call's GPU time goes: the smoothing centers, the K/V pass and the attention kernel, by the CUDA kernels
the profiler sees (why a short window or a short causal call does not reach the long-sequence speed-up); after each
case, the call's GPU time in a CUDA graph beside SDPA's cuDNN and flash kernels (the same causal mask, no window).

    bash eval/device_run.sh python3 eval/studies/variant_split.py [--causal]    (--causal: B4 H32 causal 2k–8k)
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import hf_qattn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import graph_ms  # noqa: E402

CASES = {  # name: (B, Hq, Hk, N, d, qattn keywords)
    "sliding 1024, 8k, H32, d128": (1, 32, 32, 8192, 128, dict(window=1024)),
    "causal, 8k, H32, d128": (1, 32, 32, 8192, 128, dict()),
    "gpt-oss sinks + window 128, 8k, 64/8, d64": (1, 64, 8, 8192, 64, dict(window=128, sinks=True)),
}
CAUSAL_CASES = {f"causal, {n // 1024}k, B4 H32, d{d}": (4, 32, 32, n, d, dict())
                for n, d in ((2048, 128), (4096, 128), (8192, 128), (4096, 64))}


def main() -> None:
    cases = CAUSAL_CASES if "--causal" in sys.argv[1:] else CASES
    print("| case | kernel | µs a call |\n|---|---|---|")
    for name, (b, hq, hk, n, d, keywords) in cases.items():
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        if keywords.get("sinks"):
            keywords = {**keywords, "sinks": torch.randn(hq, device="cuda")}

        def call():
            return hf_qattn.qattn(q, k, v, is_causal=True, **keywords)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        calls = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        total = 0.0
        for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if event.device_time_total <= 0:
                continue
            us = event.device_time_total / calls
            total += us
            print(f"| {name} | {event.key[:60]} | {us:.1f} |")
        print(f"| {name} | **all kernels** | **{total:.1f}** |")
        sdpa = {}
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel([backend]):
                sdpa[backend.name] = 1e3 * graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=hq != hk))
        print(f"| {name} | CUDA graph: qattn {1e3 * graph_ms(call):.1f}; SDPA cuDNN {sdpa['CUDNN_ATTENTION']:.1f}, "
              f"flash {sdpa['FLASH_ATTENTION']:.1f} | |")


if __name__ == "__main__":
    main()
