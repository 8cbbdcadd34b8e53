"""Study: the Hopper kernel alone run for seconds on end, per CTA shape, with the SM clock and board power
sampled beside it — does a faster build hit the power limit, or wait on something else? (GPU)

    python3 eval/studies/sustained_clock.py [--seconds 8] [--rounds 2] [--shapes B:H:N,...] [--ctas solo,warp_specialized]

For each shape (d128 full attention, fp16) and each CTA (SOLO or warp-specialized, its tuned stages), back-to-back
calls for ``--seconds`` (CUDA-event-timed, 2 s of rest before each phase), ``nvidia-smi --query-gpu=clocks.sm,
power.draw -lms 100`` in the background; one line a phase: TOPS (first calls, last calls, mean), SM clock (mean,
min), power (mean, max) over the phase less its first second.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import tempfile
import time

import torch

from hf_qattn.kernels import launch, tuning


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default="4:32:32768,1:40:75600", help="B:H:N, comma-separated (d128, full)")
    parser.add_argument("--ctas", default="solo,warp_specialized")
    args = parser.parse_args()
    log = tempfile.NamedTemporaryFile(mode="w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=log)
    d, phases = 128, []
    try:
        for shape in args.shapes.split(","):
            b, h, n = (int(x) for x in shape.split(":"))
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            kv = launch.hopper_quantize_kv(q, k, v, sm_scale=d ** -0.5)
            out = torch.empty_like(q)
            flops = 4 * b * h * n * n * d
            for rnd in range(args.rounds):
                for cta in args.ctas.split(","):
                    def call(solo=cta == "solo"):
                        launch.hopper_kernel_launch(q, h, n, kv, out, is_causal=False, sm_scale=d ** -0.5, qk="int8",
                                                    kv_end=None, return_lse=False, solo=solo,
                                                    stages=tuning.hopper_stages(d, solo))
                    call()
                    torch.cuda.synchronize()
                    time.sleep(2)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0, ms = time.time(), []
                    while time.time() - t0 < args.seconds:
                        start.record()
                        call()
                        end.record()
                        end.synchronize()
                        ms.append(start.elapsed_time(end))
                    phases.append((f"B{b} H{h} N{n}", cta, rnd, t0, time.time(),
                                   [flops / x / 1e9 for x in (sum(ms[:3]) / 3, sum(ms[-3:]) / 3, sum(ms) / len(ms))]))
            del q, k, v, kv, out
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(log.name):
        parts = [x.strip() for x in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):  # a header or a line cut by the termination
            continue
    os.unlink(log.name)
    print("| call | CTA | round | TOPS first / last / mean | SM MHz mean / min | W mean / max |")
    print("|---|---|---|---|---|---|")
    for label, cta, rnd, t0, t1, tops in phases:
        sel = [s for s in samples if t0 + 1 <= s[0] <= t1]
        clock = f"{sum(s[1] for s in sel) / len(sel):.0f} / {min(s[1] for s in sel):.0f}" if sel else "-"
        power = f"{sum(s[2] for s in sel) / len(sel):.0f} / {max(s[2] for s in sel):.0f}" if sel else "-"
        print(f"| {label} | {cta} | {rnd} | {' / '.join(f'{t:.0f}' for t in tops)} | {clock} | {power} |")


if __name__ == "__main__":
    main()
