"""Kernel benchmark on a CUDA GPU: correctness, accuracy and speed of qattn vs torch SDPA, one table.

    python eval/bench_kernels.py                 # full sweep, writes eval/results/kernels-<gpu>-<date>.md
    python eval/bench_kernels.py --quick         # a few shapes
    python eval/bench_kernels.py --tune          # also time tile configurations and print the best

Sections (all in one run, quantization included in qattn's time):
  1. check    — kernels vs the PyTorch reference with the same tiles, on small ragged shapes;
  2. accuracy — CosSim / RelL1 against FP32 attention on synthetic outlier inputs (eval/synthetic.py);
  3. speed    — TOPS = 4·B·H·Nq·Nk·d / time (half of that for causal), median of do_bench, for
                qattn-8b, qattn-4b, SDPA cuDNN, SDPA flash and, when installed, sageattention.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import triton

import hf_qattn
from hf_qattn import reference
from hf_qattn.kernels import launch, tuning
from hf_qattn.calibration.metrics import accuracy

from synthetic import outlier_qkv  # eval/synthetic.py
import report  # eval/report.py
from timing import bench_graph_ms, bench_ms  # eval/timing.py

SDPA = torch.nn.attention.SDPBackend

try:  # SageAttention: the 1.0.6 wheel (Triton), or SageAttention2 built from source (eval/build_sageattention.sh;
    # put .sage on PYTHONPATH), whose sm90 kernel is the method's own Hopper kernel
    import sageattention
    from sageattention import sageattn
    sage2_sm90 = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90", None)
except ImportError:  # optional peers
    sageattn = sage2_sm90 = None


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
def reference_settings_for(q, d, causal, qk):
    """(qk the call runs, reference keywords) that simulate the kernel ``qattn`` picks for this call."""
    from hf_qattn import support

    qk = support.effective_qk(q, qk)
    if support.select_path(q, "auto", qk, "fp8")[0] == support.HOPPER:
        return qk, tuning.hopper_reference_settings()
    config = tuning.attention_config(tuning.arch_of(q.device), d, causal, "fp8", qk)
    return qk, tuning.reference_settings(config)


def check(dtype):
    """Kernel vs reference (same tiles, same smoothing centers) on shapes that cut tiles raggedly."""
    rows = []
    cases = [
        dict(b=2, hq=4, hk=2, nq=300, nk=300, d=128, causal=False),
        dict(b=2, hq=4, hk=2, nq=300, nk=300, d=128, causal=True),
        dict(b=1, hq=8, hk=1, nq=77, nk=513, d=64, causal=True),
        dict(b=2, hq=2, hk=2, nq=1, nk=1000, d=128, causal=True),
        dict(b=1, hq=2, hk=2, nq=200, nk=200, d=96, causal=False),
        dict(b=1, hq=2, hk=1, nq=130, nk=130, d=256, causal=True),
    ]
    for case in cases:
        for qk in ("int8", "int4"):
            q, k, v = outlier_qkv(case["b"], case["hq"], max(case["nq"], case["nk"]), case["d"], kv_heads=case["hk"],
                                  seed=len(rows), dtype=dtype, device="cuda")
            q, k, v = q[:, :, :case["nq"]], k[:, :, :case["nk"]], v[:, :, :case["nk"]]
            hf_qattn.reset_fallback_stats()
            out, lse = hf_qattn.qattn(q, k, v, is_causal=case["causal"], qk=qk, return_lse=True)
            path = next(iter(hf_qattn.fallback_stats()["calls"]), "?")
            ran_qk, settings = reference_settings_for(q, case["d"], case["causal"], qk)
            ref, ref_lse = reference.quantized_attention(q, k, v, is_causal=case["causal"], qk=ran_qk,
                                                         return_lse=True, **settings)
            exact = reference.exact_attention(q, k, v, is_causal=case["causal"])
            diff = (out.float() - ref.float()).abs()
            tol = 0.02 * ref.float().abs().amax().item()  # a couple of FP8 steps of the largest output
            rows.append({
                **case, "qk": qk, "path": path, "ran": ran_qk, "max|kern-ref|": diff.max().item(),
                "frac>tol": (diff > tol).float().mean().item(), "max|lse diff|": (lse - ref_lse).abs().max().item(),
                "kern RelL1": accuracy(out, exact).rel_l1, "ref RelL1": accuracy(ref, exact).rel_l1,
            })
    return rows


def accuracy_rows(dtype, n=4096, heads=8):
    rows = []
    for d in (64, 128):
        q, k, v = outlier_qkv(1, heads, n, d, seed=d, dtype=dtype, device="cuda")
        for causal in (False, True):
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            methods = {
                "qattn-8b": lambda: hf_qattn.qattn(q, k, v, is_causal=causal, qk="int8"),
                "qattn-4b": lambda: hf_qattn.qattn(q, k, v, is_causal=causal, qk="int4"),
                "sdpa-" + str(dtype).split(".")[-1]: lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal),
            }
            if sageattn is not None:
                methods["sageattn"] = lambda: sageattn(q, k, v, is_causal=causal)
            for name, fn in methods.items():
                acc = accuracy(fn(), ref)
                rows.append({"d": d, "N": n, "causal": causal, "method": name,
                             "CosSim": acc.cos_sim, "RelL1": acc.rel_l1, "RMSE": acc.rmse})
    return rows


# ---------------------------------------------------------------------------------------------
def sdpa_with(backend, q, k, v, causal):
    def run():
        with torch.nn.attention.sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def time_ms(fn):
    try:
        return bench_ms(fn, warmup=50, rep=200)
    except Exception as exc:  # a backend that does not take this shape: report, keep going
        log(f"    ({type(exc).__name__}: {str(exc)[:120]})")
        return float("nan")


# (label, batch, heads, N, d) of the video/image models' attention (bf16)
MODEL_SHAPES = [("CogVideoX-5B-like", 2, 48, 17776, 64), ("Wan-14B-720p-like", 1, 40, 75600, 128),
                ("Flux-1024-like", 1, 24, 4608, 128)]


def speed_rows(shapes, batch=4, heads=32):
    """shapes: (label, dtype, d, causal, N[, batch, heads]) tuples; qattn includes its quantization passes."""
    rows = []
    for label, dtype, d, causal, n, *bh in shapes:
        b, h = bh if bh else (batch, heads)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        methods = {
            "qattn-8b": lambda: hf_qattn.qattn(q, k, v, is_causal=causal, qk="int8"),
            "qattn-4b": lambda: hf_qattn.qattn(q, k, v, is_causal=causal, qk="int4"),
            "cudnn": sdpa_with(SDPA.CUDNN_ATTENTION, q, k, v, causal),
            "flash": sdpa_with(SDPA.FLASH_ATTENTION, q, k, v, causal),
        }
        if sage2_sm90 is not None:  # its defaults: INT8 Q·Kᵀ per thread, FP8 P·V with two-level accumulation
            methods["sage2-sm90"] = lambda: sage2_sm90(q, k, v, tensor_layout="HND", is_causal=causal)
        elif sageattn is not None:
            methods["sage1"] = lambda: sageattn(q, k, v, is_causal=causal)
        row = {"shape": label or f"B{b} H{h}", "dtype": str(dtype).split(".")[-1], "d": d, "causal": causal, "N": n}
        for name, fn in methods.items():
            ms = time_ms(fn)
            row[name] = flops / (ms * 1e-3) / 1e12
        row["8b/cudnn"] = row["qattn-8b"] / row["cudnn"]
        extra = ["8b/cudnn"]
        if "sage2-sm90" in row:
            row["8b/sage2"] = row["qattn-8b"] / row["sage2-sm90"]
            extra.append("8b/sage2")
        rows.append(row)
        log("   ", fmt_row(row, list(methods) + extra))
        del q, k, v
    return rows


def hopper_rows(dtype, dims, lengths, batch=4, heads=32):
    """The sm90 Gluon kernel against cuDNN and the Triton kernel, with its two steps timed apart:
    the K/V pass (centers, V max, quantize: GB/s against a device-to-device copy of K and V) and
    the kernel alone on pre-quantized inputs."""
    rows = []
    for d in dims:
        for causal in (False, True):
            for n in lengths:
                q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
                out = torch.empty_like(q)
                flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
                common = dict(sm_scale=d ** -0.5, qk="int8", smooth_q=True, smooth_k=True, smooth_v=True)
                config = tuning.hopper_config(d)

                def prepass(num_warps=None):
                    return launch.quantize_kv(q, k, v, v_fp8=True, kv_start=None, kv_end=None,
                                              block_n=config["BLOCK_N"], k_token_scale=False, v_channel_scale=True,
                                              permute_v=True, num_warps=num_warps or config["KV_PASS_WARPS"],
                                              **common)
                kv = prepass()
                kv_bytes = 2 * k.numel() * k.element_size()
                copy_src, copy_dst = torch.cat([k, v]), torch.empty(2 * k.numel(), dtype=dtype, device="cuda")
                times = {
                    "cudnn": time_ms(sdpa_with(SDPA.CUDNN_ATTENTION, q, k, v, causal)),
                    "triton-8b": time_ms(lambda: launch.triton_attention(
                        q, k, v, out, is_causal=causal, v_fp8=True, kv_start=None, kv_end=None, return_lse=False,
                        **common)),
                    "gluon-8b": time_ms(lambda: launch.hopper_attention(
                        q, k, v, out, is_causal=causal, kv_start=None, kv_end=None, return_lse=False, **common)),
                    # the same call replayed from a CUDA graph: GPU time without Python and launch gaps
                    "gluon-8b-graph": bench_graph_ms(lambda: launch.hopper_attention(
                        q, k, v, out, is_causal=causal, kv_start=None, kv_end=None, return_lse=False, **common),
                        rep=100),
                    "gluon-kernel": time_ms(lambda: launch.hopper_kernel_launch(
                        q, heads, n, kv, out, is_causal=causal, sm_scale=d ** -0.5, qk="int8", kv_end=None,
                        return_lse=False)),
                    "prepass": time_ms(prepass),
                    "centers": time_ms(lambda: launch.smoothing_centers(q, k, v, True, True, True)),
                    **{f"prepass-w{w}": time_ms(lambda: prepass(w)) for w in (8, 16)},
                    "copy": time_ms(lambda: copy_dst.copy_(copy_src.view(-1))),
                }
                row = {"dtype": str(dtype).split(".")[-1], "d": d, "causal": causal, "N": n}
                row.update({name: flops / (times[name] * 1e-3) / 1e12 for name in
                            ("cudnn", "triton-8b", "gluon-8b", "gluon-8b-graph", "gluon-kernel")})
                row["gluon/cudnn"] = row["gluon-8b"] / row["cudnn"]
                row["kernel/cudnn"] = row["gluon-kernel"] / row["cudnn"]
                row["prepass_ms"] = times["prepass"]
                row["centers_ms"] = times["centers"]
                row.update({f"prepass-w{w}_ms": times[f"prepass-w{w}"] for w in (8, 16)})
                # the K/V pass reads K and V (V twice: max, then quantize) and writes 1 byte a value
                row["prepass GB/s"] = (kv_bytes * 1.5 + kv_bytes / 2) / (times["prepass"] * 1e-3) / 1e9
                row["copy GB/s"] = 2 * kv_bytes / (times["copy"] * 1e-3) / 1e9
                rows.append(row)
                log("   ", fmt_row(row, list(row)[4:]))
                del q, k, v, out, kv, copy_src, copy_dst
    return rows


def stage_times(dtype, d=128, n=8192, batch=4, heads=32, causal=False):
    """Split one qattn-8b call into its launches, to see where time goes."""
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
    centers = time_ms(lambda: launch.smoothing_centers(q, k, v, True, True, True))
    total = time_ms(lambda: hf_qattn.qattn(q, k, v, is_causal=causal))
    # the same call replayed from a CUDA graph: GPU time alone, without Python and launch overhead
    graphed = bench_graph_ms(lambda: hf_qattn.qattn(q, k, v, is_causal=causal), rep=200)
    cudnn_ms = time_ms(sdpa_with(SDPA.CUDNN_ATTENTION, q, k, v, causal))
    # the quantize kernel alone: time the launcher with an attention of zero query rows
    quant_only = time_ms(lambda: launch.triton_attention(
        q[:, :, :0], k, v, torch.empty_like(q[:, :, :0]), is_causal=causal, sm_scale=d ** -0.5, qk="int8",
        v_fp8=True, smooth_q=True, smooth_k=True, smooth_v=True, kv_start=None, kv_end=None, return_lse=False))
    return {"shape": f"B{batch} H{heads} N{n} d{d} causal={causal}", "centers_ms": centers,
            "centers+quantize_ms": quant_only, "total_ms": total, "attention_ms(est)": total - quant_only,
            "total_ms_cuda_graph": graphed, "cudnn_ms": cudnn_ms}


def tune(dtype, n=8192):
    """Time tile configurations of the attention kernel per (head dim, causal) at N=n; return the
    best as kernels.json rules (applied to this run's speed table too) and the top-3 rows."""
    candidates = []
    for block_m, warps in ((64, 4), (128, 8)):
        for block_n in (64, 128):
            for stages in (2, 3):
                candidates.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "Q_GROUP": 16,
                                   "K_TOKEN_SCALE": False, "num_warps": warps, "num_stages": stages})
    rules, rows = [], []
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=dtype) for _ in range(3))
            out = torch.empty_like(q)
            flops = 4 * 4 * 32 * n * n * d * (0.5 if causal else 1.0)
            timed = []
            for config in candidates:
                ms = time_ms(lambda: launch.triton_attention(
                    q, k, v, out, is_causal=causal, sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True,
                    smooth_k=True, smooth_v=True, kv_start=None, kv_end=None, return_lse=False, config=config))
                timed.append((flops / (ms * 1e-3) / 1e12 if ms == ms else 0.0, config))
            timed.sort(key=lambda t: -t[0])
            arch = tuning.arch_of(q.device)
            rules.append({"arch": arch, "head_dim": d, "causal": causal, **timed[0][1]})
            for tops, config in timed[:3]:
                rows.append({"d": d, "N": n, "causal": causal, "TOPS": tops, **config})
                log("    tune", d, n, causal, f"{tops:.0f}", config)
            del q, k, v, out
    return rules, rows


# ---------------------------------------------------------------------------------------------
def fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def fmt_row(row, keys):
    return " ".join(f"{key}={fmt(row[key])}" for key in ["shape", "dtype", "d", "causal", "N"] + keys if key in row)


def markdown(rows):
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_checks(sections, save):
    """The check and accuracy sections."""
    for title, section in (("Kernels vs reference (same tiles, ragged shapes)", check),
                           ("Accuracy vs FP32 attention, synthetic outlier inputs (eval/synthetic.py), B1 H8 N4096",
                            accuracy_rows)):
        log(f"== {title}")
        rows = section(torch.float16) + section(torch.bfloat16)
        for row in rows:
            log("   ", row)
        sections.append(f"## {title}\n\n" + markdown(rows))
        save()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--tune", action="store_true", help="also sweep tile configurations")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="only the speed table (no check, accuracy, sm90 steps)")
    parser.add_argument("--stages-only", action="store_true", help="only the per-stage times of one call")
    parser.add_argument("--hopper-only", action="store_true", help="only the sm90 Gluon kernel's table")
    parser.add_argument("--skip-hopper-table", action="store_true",
                        help="leave out the sm90 kernel's two-steps table (eval/profile_call.py splits a call faster)")
    parser.add_argument("--out", default=None, help="markdown file to write (default eval/results/kernels-<gpu>-<date>.md)")
    args = parser.parse_args()

    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out = report.result_path("kernels", args.out)

    def save():  # after every section, so a run cut short still leaves its tables
        report.write(out, "\n".join(sections))
    header = (f"GPU: {gpu} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), date {date}, "
              f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
              f"python {platform.python_version()}, hf_qattn {hf_qattn.__version__}, "
              f"sageattention {getattr(sageattention, '__version__', 'from source') if sageattn else 'not installed'}"
              + (" (SageAttention2 sm90 kernel: sageattn_qk_int8_pv_fp8_cuda_sm90)" if sage2_sm90 else ""))
    log(header)
    sections = [f"# Kernel benchmark — {gpu}\n\n{header}\n"]

    if args.hopper_only:
        lengths = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
        rows = hopper_rows(torch.float16, [64, 128], lengths)
        sections.append("## sm90 Gluon kernel (fp16, B4 H32; TOPS; causal counts half the FLOPs)\n\n" + markdown(rows))
        log("\n" + markdown(rows))
        save()
        return

    if args.stages_only:
        rows = [stage_times(dtype, d=d, n=n) for dtype in (torch.float16,) for d in (64, 128) for n in (1024, 8192)]
        for row in rows:
            log("   ", row)
        sections.append("## Where one call's time goes (fp16)\n\n" + markdown(rows))
        save()
        return

    if args.speed_only:
        args.skip_hopper_table = True
    else:
        run_checks(sections, save)
    if args.tune:
        log("== tile sweep (qattn-8b, fp16, N=8192); the winners are used for the rest of this run")
        rules, tune_rows = tune(torch.float16)
        tuning.table()["attention"]["rules"].extend(rules)
        tuning._attention_config.cache_clear()
        sections.append("## Tile sweep (top 3 per shape, qattn-8b fp16)\n\n" + markdown(tune_rows)
                        + "\nRules applied:\n\n```json\n" + json.dumps(rules, indent=1) + "\n```\n")
        log(json.dumps(rules))
        save()

    if not args.skip_speed and not args.skip_hopper_table and torch.cuda.get_device_capability() == (9, 0):
        log("== sm90 Gluon kernel: K/V pass and kernel apart")
        lengths = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
        hopper = hopper_rows(torch.float16, [64, 128], lengths)
        sections.append("## sm90 Gluon kernel: its two steps apart (fp16, B4 H32; TOPS; causal counts half)\n\n"
                        + markdown(hopper))
        save()
    if not args.skip_speed:
        log("== speed (TOPS)")
        if args.quick:
            shapes = [("", torch.float16, 128, False, n) for n in (1024, 8192)]
        else:
            shapes = [("", torch.float16, d, causal, n) for d in (64, 128) for causal in (False, True)
                      for n in (1024, 2048, 4096, 8192, 16384, 32768)]
            shapes += [("", torch.bfloat16, 128, causal, n) for causal in (False, True) for n in (1024, 8192, 32768)]
            shapes += [(label, torch.bfloat16, d, False, n, b, h) for label, b, h, n, d in MODEL_SHAPES]
        speed = speed_rows(shapes)
        sections.append("## Speed, TOPS (B4 H32; causal counts half the FLOPs; qattn includes quantization)\n\n"
                        + markdown(speed))
        log("\n" + markdown(speed))

    save()
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
