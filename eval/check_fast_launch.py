"""GPU check and timing of ``kernels/fast_launch.py``: the same results as Triton's launch, less host time.

    bash eval/device_run.sh bash -c 'python3 eval/check_fast_launch.py --out $OUT'

1. Correctness: a list of qattn calls (Hopper and portable kernels: head dims 64/96/128/256, causal,
   GQA, Nq = 1, N not a multiple of any tile, kv ranges, NHD, bf16, return_lse) and decode-cache
   calls (append + decode, INT8/INT4, q_len 1 and 5, several lengths) runs three times, in shuffled
   order: through Triton's launch (``HF_QATTN_FAST_LAUNCH=0``), then twice with the fast launch in
   ``check`` mode (the first fills its cache through Triton, the second launches directly; ``check``
   also asserts that Triton's binder agrees with every cached key). All three must be equal bit for bit.
2. Host time: µs to issue one call with the GPU held busy, Triton's launch vs the fast one; and
   back-to-back eager ms a call at B4 H32 N1k d128 next to cuDNN; medians of 10 alternating rounds.
Exits non-zero on a mismatch; writes the table to <out>/fast-launch-<gpu>-<date>.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import torch

import hf_qattn
from hf_qattn.kernels import decode_launch, fast_launch
from hf_qattn.kv_cache import reference as kv_reference

import report  # eval/report.py
from timing import events_ms, host_us  # eval/timing.py

PREFILL = [  # b, hq, hk, nq, nk, d, causal, dtype, layout, kv range, lse
    (2, 8, 8, 1000, 1000, 128, False, torch.float16, "HND", False, False),
    (2, 8, 2, 1000, 1000, 128, True, torch.bfloat16, "NHD", False, True),
    (1, 4, 1, 1, 777, 128, True, torch.float16, "HND", False, False),
    (3, 6, 3, 300, 513, 64, True, torch.bfloat16, "HND", True, True),
    (1, 2, 2, 200, 200, 96, False, torch.float16, "HND", False, False),
    (1, 2, 1, 130, 130, 256, True, torch.bfloat16, "HND", False, False),
    (1, 32, 32, 1024, 1024, 128, False, torch.float16, "HND", False, False),
    (2, 16, 16, 48, 2048, 128, False, torch.float16, "NHD", True, False),
]
DECODE = [  # b, hq, hk, nq, L, d, int4
    (1, 32, 8, 1, 4096, 128, False), (2, 32, 8, 1, 1000, 128, True), (1, 9, 3, 5, 777, 64, False),
    (4, 16, 4, 1, 16384, 128, False), (1, 8, 1, 2, 33, 256, True),
]


def prefill_call(case, seed):
    b, hq, hk, nq, nk, d, causal, dtype, layout, ranged, lse = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda h, n: (b, h, n, d)) if layout == "HND" else (lambda h, n: (b, n, h, d))
    q = torch.randn(shape(hq, nq), device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(shape(hk, nk), device="cuda", dtype=dtype, generator=g) for _ in range(2))
    extra = {}
    if ranged:
        extra = dict(kv_start=torch.randint(0, nk // 4, (b,), device="cuda", generator=g),
                     kv_end=torch.randint(nk // 2, nk + 1, (b,), device="cuda", generator=g))

    def run():
        out = hf_qattn.qattn(q, k, v, is_causal=causal, layout=layout, return_lse=lse, **extra)
        return out if isinstance(out, tuple) else (out,)
    return run


def decode_call(case, seed):
    b, hq, hk, nq, length, d, int4 = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(b, hk, length, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k_bar, v_bar = k.float().mean(2), v.float().mean(2)

    def run():
        buf = kv_reference.allocate(b, hk, length, d, "int4" if int4 else "int8", "cuda")
        decode_launch.append(k, v, k_bar, v_bar, buf, 0)
        out = decode_launch.decode(q, buf, v_bar, length)
        return buf.kq, buf.ks, buf.vq.view(torch.uint8), buf.vs, out
    return run


def run_all(calls, mode: str, order):
    os.environ["HF_QATTN_FAST_LAUNCH"] = mode
    results = {}
    for i in order:
        results[i] = [t.clone() for t in calls[i]()]
    torch.cuda.synchronize()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    calls = [prefill_call(c, i) for i, c in enumerate(PREFILL)] + [decode_call(c, 100 + i) for i, c in enumerate(DECODE)]
    names = [f"qattn {c}" for c in PREFILL] + [f"decode {c}" for c in DECODE]
    rng = random.Random(0)
    orders = [rng.sample(range(len(calls)), len(calls)) for _ in range(3)]
    slow = run_all(calls, "0", orders[0])
    first = run_all(calls, "check", orders[1])
    before = fast_launch.direct_launches()
    second = run_all(calls, "check", orders[2])
    direct = fast_launch.direct_launches() - before
    failed = int(direct == 0)  # the second round must have launched directly
    lines = [f"Direct launches in the second round: {direct}.", "",
             "| call | fast = Triton launch (first, cached) |", "|---|---|"]
    for i, name in enumerate(names):
        same = [all(torch.equal(a, b) for a, b in zip(slow[i], run[i])) for run in (first, second)]
        failed += not all(same)
        name = name.replace("torch.", "")
        lines.append(f"| {name} | {'yes' if same[0] else 'NO'}, {'yes' if same[1] else 'NO'} |")

    timing = ["| what | Triton launch | fast launch |", "|---|---|---|"]
    q, k, v = (torch.randn(4, 32, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    call = lambda: hf_qattn.qattn(q, k, v)  # noqa: E731
    decode = decode_call(DECODE[0], 7)
    _ = decode()
    b, hq, hk, nq, length, d, int4 = DECODE[0]
    buf = kv_reference.allocate(b, hk, length, d, "int8", "cuda")
    k1, v1 = (torch.randn(b, hk, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qd = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    bar = torch.zeros(b, hk, d, device="cuda")

    def step():
        decode_launch.append(k1, v1, bar, bar, buf, length - 1)
        decode_launch.decode(qd, buf, bar, length)

    def eager_ms(fn):
        return events_ms(fn, calls=20, repeats=5, warmup=3)

    # The host's speed drifts by ±30 % between measurements here: alternate the modes, 10 rounds each.
    samples = {"0": [], "1": []}
    for _ in range(10):
        for mode in ("0", "1"):
            os.environ["HF_QATTN_FAST_LAUNCH"] = mode
            samples[mode].append((host_us(call), host_us(step), eager_ms(call)))
    results = {mode: [statistics.median(s[j] for s in rows) for j in range(3)] for mode, rows in samples.items()}
    cudnn = eager_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    for j, what in enumerate(["host µs, qattn B4 H32 N1k d128", "host µs, decode step (append + decode) B1 L4k",
                              "eager ms a call, qattn B4 H32 N1k d128"]):
        digits = 3 if what.startswith("eager") else 1
        timing.append(f"| {what} | {results['0'][j]:.{digits}f} | {results['1'][j]:.{digits}f} |")
    timing.append(f"| eager ms a call, cuDNN SDPA same shape | {cudnn:.4f} | |")
    timing.append(f"| qattn / cuDNN eager time | {results['0'][2] / cudnn:.2f} | {results['1'][2] / cudnn:.2f} |")

    text = "\n".join([f"# Fast launch — {report.device_name()}, {report.today()}", "",
                      f"{report.versions()}. Command: `python3 eval/check_fast_launch.py`", "",
                      "## Same results, bit for bit", "", *lines, "", "## Host time", "", *timing, ""])
    print(text)
    if args.out:
        report.write(report.result_path("fast-launch", args.out), text)
    print("FAILED" if failed else "all equal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
