"""Study: the attention kernel alone and the call's other kernels, by sequence length — qattn's sm90 kernel
beside SageAttention2's (GPU, SageAttention built by eval/build_sageattention.sh and on PYTHONPATH).

    PYTHONPATH=$PWD/.sage bash eval/device_run.sh python3 eval/studies/kernel_alone_by_length.py [--warp-specialized]

Why: in eval/bench_kernels.py's whole calls SageAttention2 keeps gaining with length (d128 full: 718 → 769 → 813
TOPS at 16k / 32k / Wan-like 75.6k) where qattn stays near 740. A whole call's TOPS mixes the O(N) passes with the
O(N²) kernel; this splits them. Each call's kernels are timed by torch.profiler (20 calls, GPU µs a call by
kernel name); "kernel" is the longest one (the attention kernel), "rest" the others (quantization passes, copies).
``--warp-specialized``: qattn's calls on the warp-specialized CTA (two consumer warpgroups and a loader warp) instead
of the SOLO CTAs the launch picks up to head dim 128.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from profile_call import kernel_us  # noqa: E402

import hf_qattn  # noqa: E402
from hf_qattn.kernels import tuning  # noqa: E402

# (label, batch, heads, N, d, dtype)
SHAPES = [("B4 H32 8k d128", 4, 32, 8192, 128, torch.float16), ("B4 H32 16k d128", 4, 32, 16384, 128, torch.float16),
          ("B4 H32 32k d128", 4, 32, 32768, 128, torch.float16), ("B1 H40 64k d128", 1, 40, 65536, 128, torch.bfloat16),
          ("Wan-like B1 H40 75.6k d128", 1, 40, 75600, 128, torch.bfloat16),
          ("B4 H32 16k d64", 4, 32, 16384, 64, torch.float16), ("CogVideoX-like B2 H48 17.8k d64", 2, 48, 17776, 64,
                                                                torch.bfloat16)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warp-specialized", action="store_true", help="qattn on the warp-specialized CTA, not SOLO")
    parser.add_argument("--shapes", default="", help="labels' first words to keep, comma-separated (default all)")
    args = parser.parse_args()
    if args.warp_specialized:
        tuned = tuning.hopper_config
        tuning.hopper_config = lambda head_dim: {**tuned(head_dim), "SOLO": False}
    try:
        from sageattention import sageattn_qk_int8_pv_fp8_cuda_sm90 as sage2
    except ImportError:
        sage2 = None
        print("SageAttention2 not importable: qattn only")
    rows = []
    for label, b, h, n, d, dtype in SHAPES:
        if args.shapes and not any(label.startswith(s) for s in args.shapes.split(",")):
            continue
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * b * h * n * n * d
        methods = {"qattn-8b": lambda: hf_qattn.qattn(q, k, v)}
        if sage2 is not None:
            methods["sage2-sm90"] = lambda: sage2(q, k, v, tensor_layout="HND")
        row = [label]
        for name, fn in methods.items():
            per_kernel = kernel_us(fn)
            kernel_name, kernel = max(per_kernel.items(), key=lambda item: item[1])
            rest = sum(per_kernel.values()) - kernel
            row += [flops / kernel / 1e6, kernel, rest, flops / (kernel + rest) / 1e6]
            print(f"{label} {name}: kernel {kernel_name!r} {kernel:.0f} µs, rest {rest:.0f} µs "
                  f"({len(per_kernel) - 1} kernels)", flush=True)
        rows.append(row)
    names = list(methods)
    print("\n| shape | " + " | ".join(f"{m} kernel TOPS | {m} kernel µs | {m} rest µs | {m} call TOPS" for m in names)
          + (" | kernel qattn / sage2 |" if len(names) == 2 else " |"))
    print("|---" * (1 + 4 * len(names) + (len(names) == 2)) + "|")
    for row in rows:
        cells = [row[0]] + [f"{x:.0f}" for x in row[1:]]
        if len(names) == 2:
            cells.append(f"{row[1] / row[5]:.3f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
