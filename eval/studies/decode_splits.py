"""Study: one decode step's GPU time by split count, against the split plan's own choice and SDPA (GPU).

    bash eval/device_run.sh python3 eval/studies/decode_splits.py [--splits 4,6,8,12,16,24,32,48,64]

Hq 32 / Hk 8, d128, bf16, one query token; B8 at 16k / 64k / 128k cached tokens and B1 at 64k / 128k; INT8 and INT4 K
caches. Each row: a CUDA graph of 20 decode calls replayed (``timing.graph_ms``), µs a call, GB/s of the cache's
bytes (scales included), × SDPA on the bf16 cache (graph-timed alike), the largest difference from the plan's own
output (splits only reorder the merge: float rounding). ``*`` marks the split count the plan
(``decode_launch.plan_launch``) picks. The table last: the plan's choice against the fastest count.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from bench_decode import fill_cache  # noqa: E402
from timing import graph_ms  # noqa: E402

from hf_qattn.kernels import decode_launch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="4,6,8,12,16,24,32,48,64", help="split counts at B8")
    parser.add_argument("--splits-b1", default="16,32,48,64,96,128", help="split counts at B1")
    args = parser.parse_args()
    torch.manual_seed(0)
    hq, hk, d = 32, 8, 128
    rows = []
    for b, n in [(8, 16384), (8, 65536), (8, 131072), (1, 65536), (1, 131072)]:
        k = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
             + 3 * torch.randn(1, hk, 1, d, device="cuda", dtype=torch.bfloat16))
        v = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        sdpa_us = 1e3 * graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        for precision in ("int8", "int4"):
            buf, _, v_bar, nbytes = fill_cache(k, v, precision, "cuda")
            out = torch.empty(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            planned = decode_launch.plan_decode(precision, q.shape, hk, n, q.device)[1]["num_splits"]
            mine = decode_launch.decode(q, buf, v_bar, n).float()
            counts = [int(s) for s in (args.splits if b == 8 else args.splits_b1).split(",")]
            times = {}
            for splits in sorted(set(counts) | {planned}):
                diff = (decode_launch.decode(q, buf, v_bar, n, num_splits=splits, out=out).float() - mine).abs().max()
                us = 1e3 * graph_ms(lambda: decode_launch.decode(q, buf, v_bar, n, num_splits=splits, out=out))
                times[splits] = us
                print(f"B{b} L{n} {precision} splits {splits}{'*' if splits == planned else ''}: {us:.1f} µs, "
                      f"{nbytes / us / 1e3:.0f} GB/s, ×{sdpa_us / us:.3f} SDPA, max diff {diff.item():.1e}", flush=True)
            best = min(times, key=times.get)
            rows.append((b, n, precision, sdpa_us, planned, times[planned], best, times[best]))
            del buf
        del k, v
    print("\n| B | L | K | SDPA µs | plan's splits | µs | × SDPA | fastest splits | µs | × SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, n, precision, sdpa_us, planned, planned_us, best, best_us in rows:
        print(f"| {b} | {n} | {precision} | {sdpa_us:.1f} | {planned} | {planned_us:.1f} | {sdpa_us / planned_us:.2f} "
              f"| {best} | {best_us:.1f} | {sdpa_us / best_us:.2f} |")


if __name__ == "__main__":
    main()
