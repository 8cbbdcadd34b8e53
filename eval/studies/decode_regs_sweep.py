"""Decode kernel: register cap × pipeline stages × waves, at B8 Hq32/Hk8 d128 (one GPU run).

    bash eval/device_run.sh python3 eval/studies/decode_regs_sweep.py [PRECISIONS [MAXNREGS]]
    (defaults: int8,int4 and 0,128,104,88)

Nsight Compute (eval/results/ncu/ncu-decode-*.txt) shows the kernel at 144 registers a thread, so 3
programs of 4 warps an SM (18.75 % occupancy) and 64 % (INT8) / 38 % (INT4) of DRAM bandwidth at L64k:
too few bytes in flight. ``maxnreg`` caps the registers (spills, if any, are printed) so more programs
fit an SM (0: no cap); waves: rounds of those programs the split count fills. Prints µs a step per
configuration, with the compiled kernel's registers and spills.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

from hf_qattn.kernels import decode_launch
from hf_qattn.kernels.decode import decode_kernel
from hf_qattn.kernels.fast_launch import fast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from bench_decode import fill_cache  # noqa: E402
from timing import events_ms  # noqa: E402


def main(precisions: str = "int8,int4", caps: str = "0,128,104,88") -> None:
    torch.manual_seed(0)
    b, hq, hk, d = 8, 32, 8, 128
    print("| L | K | stages | maxnreg | waves | µs | regs | spills |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (16384, 65536):
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        for precision in precisions.split(","):
            buf, _, v_bar, _ = fill_cache(k, v, precision, "cuda")
            for stages, maxnreg, waves in itertools.product((2, 3), [int(c) for c in caps.split(",")], (1, 2)):
                def run():
                    decode_launch.decode(q, buf, v_bar, n, num_stages=stages, maxnreg=maxnreg, waves=waves)
                try:
                    us = events_ms(run, calls=20, repeats=7) * 1e3
                    kernels = [entry[0] for entry in fast(decode_kernel).kernels.values()]
                    last = kernels[-1]
                    regs, spills = getattr(last, "n_regs", "?"), getattr(last, "n_spills", "?")
                except Exception as error:  # noqa: BLE001
                    us, regs, spills = float("nan"), f"{type(error).__name__}: {error}"[:80], "-"
                print(f"| {n} | {precision} | {stages} | {maxnreg} | {waves} | {us:.1f} | {regs} | {spills} |",
                      flush=True)
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
