"""Where one qattn call's time goes on the GPU, and how much of it is the host's.

    bash eval/device_run.sh python3 eval/profile_call.py --out eval/results/

Per shape (the Hopper path, quantization included), side by side with cuDNN in the same run:

- ``graph_ms``: GPU time a call, from a CUDA graph of 20 calls replayed (no Python, no launch gaps);
- ``eager_ms``: 30 back-to-back calls timed with events, median of 5 (what a loop of calls sees: the
  GPU waits whenever the host is slower than it);
- ``host_us``: the host's time to issue one call, measured while the GPU is held busy by a sleep
  kernel (so it is pure Python, allocation and launch cost);
- the GPU time of each kernel of the call (torch.profiler), in µs;
- the K/V pass's variants (each a graph-timed ``quantize_kv``): as shipped, ΔS as its own step,
  without the key relabelling of V, per-tile V scales (no V max pass), other warp counts; and a
  device-to-device copy of K and V for the bandwidth ceiling.
"""

from __future__ import annotations

import argparse
import datetime
from collections import defaultdict

import torch
import triton

import hf_qattn
from hf_qattn.kernels import launch, tuning

from timing import events_ms, graph_ms, host_us  # eval/timing.py
import report  # noqa: E402  (eval/report.py)

SDPA = torch.nn.attention.SDPBackend

# (label, batch, heads, N, d, dtype)
SHAPES = [("B4 H32 N1k d128", 4, 32, 1024, 128, torch.float16), ("B4 H32 N2k d128", 4, 32, 2048, 128, torch.float16),
          ("B4 H32 N8k d128", 4, 32, 8192, 128, torch.float16), ("B4 H32 N1k d64", 4, 32, 1024, 64, torch.float16),
          ("Flux-1024-like", 1, 24, 4608, 128, torch.bfloat16)]


def kernel_us(fn, calls: int = 20) -> dict[str, float]:
    """GPU µs a call of each kernel ``fn`` launches (torch.profiler, summed by kernel name)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us:
            totals[event.key[:40]] += device_us / calls
    return dict(totals)


def stages_sweep(args):
    """GPU µs of the Hopper kernel alone (CUDA graph) per ring depth, next to the shipped depth."""
    lines = [f"# Hopper kernel ring stages — {torch.cuda.get_device_name()}, {datetime.date.today()}", "",
             "| d | N | causal | " + " | ".join(f"{s} stages µs" for s in (2, 3, 4)) + " | shipped |", "|" + "---|" * 7]
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
                config = tuning.hopper_config(d)
                kv = launch.quantize_kv(q, k, v, sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True,
                                        smooth_k=True, smooth_v=True, kv_start=None, kv_end=None,
                                        block_n=config["BLOCK_N"], k_token_scale=False, v_channel_scale=True,
                                        permute_v=True, num_warps=config["KV_PASS_WARPS"])
                out = torch.empty_like(q)
                cells = []
                for stages in (2, 3, 4):
                    try:
                        cells.append(f"{graph_ms(lambda s=stages: launch.hopper_kernel_launch(q, 32, n, kv, out, is_causal=causal, sm_scale=d ** -0.5, qk='int8', kv_end=None, return_lse=False, stages=s)) * 1e3:.1f}")  # noqa: E501
                    except Exception as error:  # noqa: BLE001  (a depth that does not fit shared memory)
                        cells.append(f"failed: {type(error).__name__}")
                tuned = tuning.hopper_stages(d, tuning.hopper_solo(d, persistent=False))  # the launch's CTA's
                lines.append(f"| {d} | {n} | {causal} | " + " | ".join(cells) + f" | {tuned} |")
                print(lines[-1], flush=True)
                del q, k, v, kv, out
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        report.write(report.result_path("stages", args.out), text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for the markdown file")
    parser.add_argument("--stages-sweep", action="store_true",
                        help="only time the Hopper kernel alone at 2, 3 and 4 ring stages (B4 H32 fp16, d64 and d128)")
    args = parser.parse_args()
    if args.stages_sweep:
        return stages_sweep(args)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    lines = [f"# Where a qattn call's time goes — {name}, {datetime.date.today()}",
             f"torch {torch.__version__}, triton {triton.__version__}", "",
             "GPU ms per call from CUDA-graph replay (graph), back-to-back eager calls (eager), host µs to issue "
             "one call with the GPU busy (host), and per-kernel GPU µs (profiler).", ""]
    summary = ["| shape | qattn graph ms | qattn eager ms | host µs | cudnn graph ms | cudnn eager ms | "
               "graph ratio | eager ratio |", "|---|---|---|---|---|---|---|---|"]
    details = []
    passes = ["| shape | shipped | no V relabel | per-tile V scale | w8 | w16 | copy K+V | pass GB/s | "
              "copy GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    centers = ["| shape | rows 64, 4 warps | rows 128, 4 warps | rows 256, 8 warps |", "|---|---|---|---|"]
    persistence = ["| shape | kernel, a CTA per item | kernel, persistent | whole call, a CTA per item | "
               "whole call, persistent | cuDNN |", "|---|---|---|---|---|---|"]
    host = ["| shape | qattn | hopper_attention | quantize_kv | smoothing_centers | hopper kernel launch | "
            "torch.empty | validate+decide |", "|---|---|---|---|---|---|---|---|"]
    for label, b, h, n, d, dtype in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        call = lambda: hf_qattn.qattn(q, k, v)  # noqa: E731
        cudnn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
        with torch.nn.attention.sdpa_kernel(SDPA.CUDNN_ATTENTION):
            c_graph, c_eager = graph_ms(cudnn), events_ms(cudnn, calls=30)
        row = dict(graph=graph_ms(call), eager=events_ms(call, calls=30), host=host_us(call), c_graph=c_graph,
                   c_eager=c_eager)
        summary.append(f"| {label} | {row['graph']:.4f} | {row['eager']:.4f} | {row['host']:.0f} | {c_graph:.4f} | "
                       f"{c_eager:.4f} | {c_graph / row['graph']:.3f} | {c_eager / row['eager']:.3f} |")
        kernels = kernel_us(call)
        details.append(f"- {label}: " + ", ".join(f"{k_} {us:.1f}" for k_, us in sorted(kernels.items(),
                                                                                    key=lambda kv: -kv[1])))
        config = tuning.hopper_config(d)
        base = dict(sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True, smooth_v=True,
                    kv_start=None, kv_end=None, block_n=config["BLOCK_N"], k_token_scale=False, v_channel_scale=True,
                    permute_v=True, num_warps=config["KV_PASS_WARPS"])
        variants = {"shipped": {}, "no V relabel": dict(permute_v=False),
                    "per-tile V scale": dict(v_channel_scale=False), "w8": dict(num_warps=8),
                    "w16": dict(num_warps=16)}
        times = {key: graph_ms(lambda o=opts: launch.quantize_kv(q, k, v, **{**base, **o}))
                 for key, opts in variants.items()}
        src = torch.cat([k, v])
        dst = torch.empty_like(src)
        times["copy"] = graph_ms(lambda: dst.copy_(src))
        kv_bytes = 2 * k.numel() * k.element_size()
        pass_gbs = (kv_bytes * 1.5 + kv_bytes / 2) / (times["shipped"] * 1e-3) / 1e9  # V read twice, 1 B/value out
        copy_gbs = 2 * kv_bytes / (times["copy"] * 1e-3) / 1e9
        passes.append(f"| {label} | " + " | ".join(f"{times[key]:.4f}" for key in [*variants, "copy"])
                      + f" | {pass_gbs:.0f} | {copy_gbs:.0f} |")
        centers.append(f"| {label} | " + " | ".join(
            f"{graph_ms(lambda r=r, w=w: launch.smoothing_centers(q, k, v, True, True, True, MEAN_ROWS=r, num_warps=w)) * 1e3:.1f} µs"
            for r, w in ((64, 4), (128, 4), (256, 8))) + " |")
        kv = launch.quantize_kv(q, k, v, **base)
        out = torch.empty_like(q)

        def kernel_alone(persistent):
            return launch.hopper_kernel_launch(q, h, n, kv, out, is_causal=False, sm_scale=d ** -0.5, qk="int8",
                                               kv_end=None, return_lse=False,
                                               persistent=persistent)

        def whole(persistent):
            return launch.hopper_attention(q, k, v, out, is_causal=False, sm_scale=d ** -0.5, qk="int8",
                                           smooth_q=True, smooth_k=True, smooth_v=True, kv_start=None, kv_end=None,
                                           return_lse=False, persistent=persistent)
        persistence.append(f"| {label} | " + " | ".join(f"{graph_ms(fn) * 1e3:.1f} µs" for fn in (
            lambda: kernel_alone(False), lambda: kernel_alone(True), lambda: whole(False), lambda: whole(True)))
            + f" | {c_graph * 1e3:.1f} µs |")
        pieces = {
            "qattn": call,
            "hopper_attention": lambda: launch.hopper_attention(
                q, k, v, out, is_causal=False, sm_scale=d ** -0.5, qk="int8", smooth_q=True, smooth_k=True,
                smooth_v=True, kv_start=None, kv_end=None, return_lse=False),
            "quantize_kv": lambda: launch.quantize_kv(q, k, v, **base),
            "smoothing_centers": lambda: launch.smoothing_centers(q, k, v, True, True, True),
            "hopper kernel launch": lambda: launch.hopper_kernel_launch(
                q, h, n, kv, out, is_causal=False, sm_scale=d ** -0.5, qk="int8", kv_end=None, return_lse=False),
            "torch.empty": lambda: torch.empty(b * h * n, d, device="cuda", dtype=torch.int8),
            "validate+decide": lambda: (hf_qattn.api._validate(q, k, v, "HND", "int8", "fp8", "auto", None, None),
                                        hf_qattn.api._decide("cuda", 0, d, "auto", "int8", "fp8", None)),
        }
        host.append(f"| {label} | " + " | ".join(f"{host_us(fn):.0f}" for fn in pieces.values()) + " |")
        print(summary[-1], "\n", details[-1], "\n", passes[-1], "\n", centers[-1], "\n", persistence[-1], "\n", host[-1],
              flush=True)
        del q, k, v, src, dst, kv, out
    lines += ["## One call", "", *summary, "", "## GPU µs a call, by kernel (profiler)", "", *details, "",
              "## The K/V pass (centers + V max + quantize), GPU ms a call (CUDA graph)", "", *passes, "",
              "## The centers kernel, GPU time a call (CUDA graph)", "", *centers, "",
              "## The Hopper kernel: a CTA per work item or persistent, GPU time a call (CUDA graph)", "", *persistence,
              "",
              "## Host µs to issue each piece (GPU held busy)", "", *host, ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        path = report.write(report.result_path("profile", args.out), text)
        print("wrote", path)


if __name__ == "__main__":
    main()
