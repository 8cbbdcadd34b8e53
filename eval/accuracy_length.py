"""Does the Hopper kernel's error grow with the number of keys? (GPU; the prefill issue's accuracy target.)

    bash eval/device_run.sh python3 eval/accuracy_length.py --out eval/results/accuracy-length.md

Inputs (B1 H4 bf16, head dim ``--head-dim`` (128), fresh per length, seed = length): q, k ~ N(0, 1) with K's channels offset by
N(0, 2) (a bias that K's smoothing removes), and two kinds of V — "v-mean" with mean 0.3, and "v-zero"
with zero mean, where V's smoothing leaves little beside the part attention selects, so an accumulation
error shows at full size. Reference: float32 attention (torch SDPA on float32 inputs) for 2,048 query rows
spread over the sequence (rows are independent; with ``--causal`` row i sees keys ≤ i, which runs the
causal kernel's main loop split at the diagonal at these lengths). Reported: RelL1 of each method to
the reference; cos to the reference; for the Hopper path as shipped (SOLO CTAs where tuning picks them: one key
tile a P·V accumulator), for the warp-specialized CTA at each ``--pv-tiles`` (key tiles summed in one FP8 wgmma
accumulator before it is added into FP32; its configured value is in configs/kernels.json) and the portable
Triton kernel (two-level accumulation per tile), cuDNN bf16 as the yardstick.
Prints a table; with --check exits non-zero when the shipped kernel's RelL1 at the longest length exceeds
1.2× its value at the shortest, or its cos to float32 falls under 0.999 on zero-mean V.

``--cache`` adds the quantized KV cache's decode kernel (INT8 K and INT4 K, INT8 V per token: the cache filled with all
N tokens by its append kernel, then the last 64 positions decoded as one causal step of 64 queries); the
reference rows are then those last 64 (causal), for every method.
"""

from __future__ import annotations

import argparse
import datetime
import math
import pathlib
import sys

import torch
import triton

from hf_qattn.kernels import launch
from hf_qattn.calibration.metrics import accuracy
import report  # noqa: E402  (eval/report.py)

SDPA = torch.nn.attention.SDPBackend
ROWS = 2048


def inputs(n: int, v_kind: str, heads: int = 4, d: int = 128, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(n)
    q = torch.randn(1, heads, n, d, device=device, generator=gen)
    k = torch.randn(1, heads, n, d, device=device, generator=gen)
    k += 2.0 * torch.randn(1, heads, 1, d, device=device, generator=gen)
    v = torch.randn(1, heads, n, d, device=device, generator=gen)
    if v_kind == "v-mean":
        v += 0.3
    return (t.to(torch.bfloat16) for t in (q, k, v))


CAUSAL = {"on": False}  # --causal, read by the methods below


def reference_rows(q, k, v, rows):
    mask = torch.arange(k.shape[2], device=k.device)[None, :] <= rows[:, None] if CAUSAL["on"] else None
    with torch.nn.attention.sdpa_kernel([SDPA.EFFICIENT_ATTENTION, SDPA.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, rows].float(), k.float(), v.float(),
                                                                attn_mask=mask)


def _options(q):
    return dict(is_causal=CAUSAL["on"], sm_scale=q.shape[-1] ** -0.5, qk="int8", smooth_q=True, smooth_k=True,
                smooth_v=True, kv_start=None, kv_end=None, return_lse=False)


def hopper(q, k, v, pv_tiles):
    out = torch.empty_like(q)
    launch.hopper_attention(q, k, v, out, pv_tiles=pv_tiles, **_options(q))
    return out


def portable(q, k, v):
    out = torch.empty_like(q)
    launch.triton_attention(q, k, v, out, v_fp8=True, **_options(q))
    return out


def cache_decode(precision: str):
    """The cache's decode over all N keys for the query rows ``rows`` (the last ones, as a causal step)."""
    from hf_qattn.kernels import decode_launch
    from hf_qattn.kv_cache import reference as kv_reference

    def run(q, k, v, rows):
        b, h, n, d = k.shape
        k_bar, v_bar = kv_reference.centers(k, v)
        buffers = kv_reference.allocate(b, h, n, d, precision, k.device, k.dtype)
        kv_reference.set_equalizers(buffers, k, v, k_bar, v_bar)  # as a cache's first fill
        decode_launch.append(k, v, k_bar, v_bar, buffers, 0)
        return decode_launch.decode(q[:, :, rows], buffers, v_bar, n, causal=True).transpose(1, 2)
    return run


def cudnn(q, k, v):
    with torch.nn.attention.sdpa_kernel([SDPA.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=CAUSAL["on"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384,32768,75600,131072,262144")
    parser.add_argument("--pv-tiles", default="",
                        help="comma-separated pv_tiles of the warp-specialized CTA to compare beside the shipped path")
    parser.add_argument("--no-portable", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--cache", action="store_true", help="add the KV cache's decode (see above)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    CAUSAL["on"] = args.causal or args.cache
    tiles = sorted({int(t) for t in args.pv_tiles.split(",") if t})
    methods = {"qattn Hopper path (shipped)": lambda q, k, v: hopper(q, k, v, None)}
    methods.update({f"qattn warp-specialized, pv_tiles={t}": (lambda t: lambda q, k, v: hopper(q, k, v, t))(t)
                    for t in tiles})
    if not args.no_portable:
        methods["qattn portable Triton"] = portable
    methods["cuDNN bf16"] = cudnn
    methods = {name: (lambda fn: lambda q, k, v, rows: fn(q, k, v)[:, :, rows])(fn) for name, fn in methods.items()}
    if args.cache:
        methods.update({f"cache decode, {p.upper()} K": cache_decode(p) for p in ("int8", "int4")})
        methods["cache decode, int8g (8-bit K and V groups)"] = cache_decode("int8g")
    lengths = [int(n) for n in args.lengths.split(",")]
    results = {}  # (v_kind, method, n) -> Accuracy
    for v_kind in ("v-mean", "v-zero"):
        for n in lengths:
            q, k, v = inputs(n, v_kind, d=args.head_dim)
            rows = (torch.arange(n - 64, n, device=q.device) if args.cache
                    else torch.linspace(0, n - 1, ROWS, device=q.device).long())
            ref = reference_rows(q, k, v, rows)
            for name, fn in methods.items():
                out = fn(q, k, v, rows)
                results[v_kind, name, n] = accuracy(out.float(), ref)
                print(f"{v_kind} N={n} {name}: RelL1 {results[v_kind, name, n].rel_l1:.4f} "
                      f"cos {results[v_kind, name, n].cos_sim:.6f}", flush=True)
            del q, k, v, ref
            torch.cuda.empty_cache()
    lines = [f"# Accuracy against float32 attention by sequence length — {torch.cuda.get_device_name()}, "
             f"{datetime.date.today()}", "",
             f"torch {torch.__version__}, triton {triton.__version__}; `python3 eval/accuracy_length.py "
             f"{' '.join(sys.argv[1:])}`. Inputs and reference: see the script's docstring (B1 H4 d{args.head_dim} "
             f"bf16, {'causal, ' if CAUSAL['on'] else ''}{'the last 64' if args.cache else ROWS} reference rows).", ""]
    for v_kind in ("v-mean", "v-zero"):
        for metric in ("rel_l1", "cos_sim"):
            lines += [f"## {v_kind}: {'RelL1' if metric == 'rel_l1' else 'cos'} to float32", "",
                      "| method | " + " | ".join(f"{n / 1024:.1f}k" for n in lengths) + " |",
                      "|---|" + "---|" * len(lengths)]
            for name in methods:
                fmt = "{:.4f}" if metric == "rel_l1" else "{:.6f}"
                lines.append(f"| {name} | " + " | ".join(fmt.format(getattr(results[v_kind, name, n], metric))
                                                        for n in lengths) + " |")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        report.write(args.out, text)
    if args.check:
        name = next(m for m in methods if m.endswith("(shipped)"))
        growth = results["v-mean", name, lengths[-1]].rel_l1 / results["v-mean", name, lengths[0]].rel_l1
        worst_cos = min(results["v-zero", name, n].cos_sim for n in lengths)
        ok = growth <= 1.2 and worst_cos >= 0.999 and not math.isnan(growth)
        print(f"check: RelL1 growth {growth:.2f}x (<= 1.2), worst zero-mean-V cos {worst_cos:.6f} (>= 0.999): "
              f"{'pass' if ok else 'FAIL'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
