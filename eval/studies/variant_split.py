"""Where a variant call's GPU time goes: the smoothing centers, the K/V pass and the attention kernel, by the
CUDA kernels the profiler sees (why a short window does not reach the long-sequence speed-up).

    bash eval/device_run.sh python3 eval/studies/variant_split.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import hf_qattn

CASES = {  # name: (Hq, Hk, N, d, qattn keywords)
    "sliding 1024, 8k, H32, d128": (32, 32, 8192, 128, dict(window=1024)),
    "causal, 8k, H32, d128": (32, 32, 8192, 128, dict()),
    "gpt-oss sinks + window 128, 8k, 64/8, d64": (64, 8, 8192, 64, dict(window=128, sinks=True)),
}


def main() -> None:
    print("| case | kernel | µs a call |\n|---|---|---|")
    for name, (hq, hk, n, d, keywords) in CASES.items():
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16)
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


if __name__ == "__main__":
    main()
