"""Study: what two-level accumulation costs the Hopper kernel, by ``pv_tiles`` (GPU, kernel only).

    bash eval/device_run.sh python3 eval/studies/pv_tiles_sweep.py --tiles 1,2,4,8,16,100000

pv_tiles = key tiles whose P·V share one FP8 wgmma accumulator before it is added into the FP32 sum in
shared memory (100000: never, the kernel before two-level accumulation). B4 H32 fp16, the Gluon
kernel alone on one K/V pass's output, median of triton.testing.do_bench (``timing.bench_ms``);
TOPS = 4·B·H·N²·d / time (half for causal). Its accuracy by length is eval/accuracy_length.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hf_qattn.kernels import launch, tuning

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import bench_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default="1,2,4,8,16,100000")
    parser.add_argument("--shapes", default="128:0:4096,128:0:16384,128:1:4096,128:1:16384,64:0:4096,64:1:16384",
                        help="head_dim:causal:N, comma-separated")
    args = parser.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        d, causal, n = (int(x) for x in shape.split(":"))
        q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        config = tuning.hopper_config(d)
        kv = launch.quantize_kv(q, k, v, sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True,
                                smooth_v=True, kv_start=None, kv_end=None, block_n=config["BLOCK_N"],
                                k_token_scale=False, v_channel_scale=True, permute_v=True,
                                num_warps=config["KV_PASS_WARPS"])
        flops = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
        cells = []
        for t in tiles:
            ms = bench_ms(lambda t=t: launch.hopper_kernel_launch(
                q, 32, n, kv, out, is_causal=bool(causal), sm_scale=d ** -0.5, qk="int8", kv_end=None,
                return_lse=False, pv_tiles=t), warmup=50, rep=300)
            cells.append(flops / ms / 1e9)
        rows.append((f"d{d} {'causal' if causal else 'full'} N{n}", cells))
        print(rows[-1], flush=True)
    print(f"\n| shape (TOPS, kernel only) | " + " | ".join(f"pv_tiles={t}" for t in tiles) + " |")
    print("|---|" + "---|" * len(tiles))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
