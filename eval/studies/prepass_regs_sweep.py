"""The K/V pre-pass of the Hopper path (centers launch + K/V pass): register caps, GPU time (CUDA graph).

    bash eval/device_run.sh python3 eval/studies/prepass_regs_sweep.py

Nsight Compute (eval/results/ncu/ncu-prefill-1k-*.txt, B4 H32 N1k d128) shows the centers launch at 155
registers a thread and the K/V pass at 210 (12.5–18.75 % occupancy), moving 49 % / 57 % of the DRAM
peak. Times ``launch.quantize_kv`` as the Hopper path calls it with register caps (centers, pass);
0 is no cap. Prints GPU µs a pass per shape, and the copy of K and V as the ceiling.
"""

from __future__ import annotations

import os
import sys

import torch

from hf_qattn.kernels import launch, tuning
from hf_qattn.kernels.fast_launch import fast
from hf_qattn.kernels.quantize import centers_kernel, quantize_kv_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import graph_ms  # noqa: E402

SHAPES = [("B4 H32 N1k d128", 4, 32, 1024, 128, torch.float16), ("B4 H32 N2k d128", 4, 32, 2048, 128, torch.float16),
          ("B4 H32 N8k d128", 4, 32, 8192, 128, torch.float16), ("B4 H32 N1k d64", 4, 32, 1024, 64, torch.float16),
          ("Flux-1024-like", 1, 24, 4608, 128, torch.bfloat16)]
CAPS = [(0, 0), (128, 0), (96, 0), (0, 168), (0, 128), (128, 128), (96, 128)]


def regs(jit_fn, cap: int) -> str:
    """Registers / spills of the compiled ``jit_fn`` launched with this cap (the last such launch)."""
    for key, (kernel, _) in reversed(list(fast(jit_fn).kernels.items())):
        if dict(key[2]).get("maxnreg", 0) == cap:
            return f"{getattr(kernel, 'n_regs', '?')}/{getattr(kernel, 'n_spills', '?')}"
    return "?"


def main() -> None:
    torch.manual_seed(0)
    print("| shape | centers cap | pass cap | µs | centers regs/spills | pass regs/spills | copy K+V µs |")
    print("|---|---|---|---|---|---|---|")
    for label, b, h, n, d, dtype in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        config = tuning.hopper_config(d)
        src = torch.cat([k, v])
        dst = torch.empty_like(src)
        copy = graph_ms(lambda: dst.copy_(src)) * 1e3
        for caps in CAPS:
            def run(c=caps):
                launch.quantize_kv(q, k, v, sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True,
                                   smooth_v=True, kv_start=None, kv_end=None, block_n=config["BLOCK_N"],
                                   k_token_scale=False, v_channel_scale=True, permute_v=True,
                                   num_warps=config["KV_PASS_WARPS"], maxnreg=c)
            try:
                us = f"{graph_ms(run) * 1e3:.1f}"
                r = (regs(centers_kernel, caps[0]), regs(quantize_kv_kernel, caps[1]))
            except Exception as error:  # noqa: BLE001
                us, r = f"failed: {type(error).__name__}: {error}"[:90], ("-", "-")
            print(f"| {label} | {caps[0]} | {caps[1]} | {us} | {r[0]} | {r[1]} | {copy:.1f} |", flush=True)
        del q, k, v, src, dst
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
