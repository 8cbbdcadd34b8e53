"""Study: one setting of the Hopper kernel (a key of kernels.json's ``hopper`` entry) A/B, kernel alone (GPU).

    bash eval/device_run.sh python3 eval/studies/hopper_switch_ab.py --set SOLO=false

The Gluon kernel alone on one K/V pass's output, B4 H32 fp16 (``--batch``, ``--heads``; a sliding ``--window``
and ``--sinks`` for every shape): the tuned settings (A) against the same with ``--set`` applied (B), in
alternating rounds in one process so that the host's and the clock's drift falls on both alike. ``STAGES`` in
``--set`` is forced on every build through the launch's arguments (A runs what tuning picks), and ``SOLO=true`` /
``false`` launches the one-warpgroup CTA
(hopper/mainloop.attend_solo) or the warp-specialized one; other keys replace kernels.json's. The best round's median of
``triton.testing.do_bench`` (``timing.bench_ms``) each; TOPS = 4·B·H·d·(keys each query sees: N, or i + 1 for
causal row i, at most the window) / time. Every shape first compares A's and B's outputs: ``--same-output``
requires them bit for bit (a setting that only reorders work), else their largest difference is shown.
``--whole-calls``: time ``hf_qattn.qattn`` instead (its K/V pass included, eager, the launch's own CTA shape),
beside cuDNN's SDPA in the same rounds (full and causal shapes; no window or sinks there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from hf_qattn.kernels import launch, tuning

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import bench_ms  # noqa: E402

_tuned = tuning.hopper_config


def use(overrides: dict):
    """Make every later launch read the tuned settings with ``overrides`` (the launch asks per call)."""
    tuning.hopper_config = lambda head_dim: {**_tuned(head_dim), **overrides}


def inputs(args, shape: str):
    """(d, causal, n, b, hq, hk, q, k, v) of one ``head_dim:causal:N`` shape: random fp16, HND."""
    d, causal, n = (int(x) for x in shape.split(":"))
    b, (hq, hk) = args.batch, (int(x) for x in (args.heads + "/" + args.heads).split("/")[:2])
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
    return d, causal, n, b, hq, hk, q, k, v


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True,
                        help='KEY=JSON_VALUE[,KEY=JSON_VALUE]: setting B (e.g. SOLO_REGISTERS={"plain":128,"variants":168})')
    parser.add_argument("--shapes", default="128:0:2048,128:0:4096,128:0:16384,128:1:2048,128:1:4096,128:1:8192,"
                                            "128:1:16384,64:0:4096,64:0:16384,64:1:4096,64:1:16384",
                        help="head_dim:causal:N, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", default="32", help="query heads, or HQ/HK for grouped K/V heads")
    parser.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    parser.add_argument("--sinks", action="store_true", help="a sink logit per query head (gpt-oss)")
    parser.add_argument("--same-output", action="store_true", help="require bit-identical outputs of A and B")
    parser.add_argument("--whole-calls", action="store_true",
                        help="time hf_qattn.qattn (K/V pass included) and cuDNN, not the kernel alone")
    args = parser.parse_args()
    # KEY=VALUE items split at a comma that starts the next KEY= (a JSON value may hold commas itself)
    overrides = {key: json.loads(value) for key, value in
                 (item.split("=", 1) for item in re.split(r",(?=[A-Z_0-9]+=)", args.set))}
    if args.whole_calls:
        return whole_calls(args, overrides)
    rows, failed = [], []
    for shape in args.shapes.split(","):
        d, causal, n, b, hq, hk, q, k, v = inputs(args, shape)
        sinks = torch.randn(hq, device="cuda") if args.sinks else None
        config = _tuned(d)
        kv = launch.quantize_kv(q, k, v, sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True,
                                smooth_v=True, kv_start=None, kv_end=None, block_n=config["BLOCK_N"],
                                k_token_scale=False, v_channel_scale=True, permute_v=True,
                                num_warps=config["KV_PASS_WARPS"], v_dither=tuning.v_dither(False))
        outs = {"A": torch.empty_like(q), "B": torch.empty_like(q)}

        def call(side):
            use({} if side == "A" else overrides)
            forced = {} if side == "A" else overrides  # the CTA shape, forced on every build (else tuning's)
            return lambda: launch.hopper_kernel_launch(q, hk, n, kv, outs[side], is_causal=bool(causal),
                                                       sm_scale=d ** -0.5, qk="int8", kv_end=None, return_lse=False,
                                                       window=args.window, sinks=sinks,
                                                       stages=forced.get("STAGES"), solo=forced.get("SOLO"))

        for side in "AB":
            call(side)()
        torch.cuda.synchronize()
        diff = (outs["A"].float() - outs["B"].float()).abs().max().item()
        if args.same_output and diff != 0:
            failed.append(shape)
        keys_seen = torch.arange(1, n + 1, dtype=torch.float64) if causal else torch.full((n,), float(n))
        if args.window:
            keys_seen = keys_seen.clamp(max=args.window)
        flops = 4 * b * hq * d * keys_seen.double().sum().item()
        best = {"A": float("inf"), "B": float("inf")}
        for _ in range(args.rounds):
            for side in "AB":
                best[side] = min(best[side], bench_ms(call(side), warmup=25, rep=150))
        rows.append((f"d{d} {'causal' if causal else 'full'} N{n}", flops / best["A"] / 1e9, flops / best["B"] / 1e9,
                     diff))
        print(rows[-1], flush=True)
    use({})
    print(f"\n| shape (TOPS, kernel only) | tuned | {args.set} | B / A | max |out A − out B| |")
    print("|---|---|---|---|---|")
    for name, a, b, diff in rows:
        print(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.3f} | {diff:.3g} |")
    if failed:
        print("outputs differ:", ", ".join(failed))
        sys.exit(1)


def whole_calls(args, overrides: dict) -> None:
    """``hf_qattn.qattn`` with the tuned settings (A) and with ``overrides`` (B), and cuDNN's SDPA, in turns."""
    import hf_qattn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if args.window or args.sinks:
        raise SystemExit("--whole-calls: full and causal shapes only (no --window, --sinks)")
    print(f"| call (TOPS, K/V pass included) | cuDNN | tuned | {args.set} | tuned / cuDNN | B / cuDNN | B / A |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        d, causal, n, b, hq, hk, q, k, v = inputs(args, shape)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                        enable_gqa=hq != hk)

        def call(side):
            use({} if side == "A" else overrides)
            return lambda: hf_qattn.qattn(q, k, v, is_causal=bool(causal))

        for side in "AB":
            call(side)()
        best = {"cuDNN": float("inf"), "A": float("inf"), "B": float("inf")}
        for _ in range(args.rounds):
            best["cuDNN"] = min(best["cuDNN"], bench_ms(cudnn, warmup=25, rep=100))
            for side in "AB":
                best[side] = min(best[side], bench_ms(call(side), warmup=25, rep=100))
        use({})
        gflop = 4 * b * hq * d * n * n * (0.5 if causal else 1.0) / 1e9
        c, a, bb = (gflop / best[side] for side in ("cuDNN", "A", "B"))
        print(f"| d{d} {'causal' if causal else 'full'} N{n} | {c:.0f} | {a:.0f} | {bb:.0f} | {a / c:.3f} | "
              f"{bb / c:.3f} | {bb / a:.3f} |", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
