"""GPU accuracy check of the attention variants (issue 27) at the lengths users run them, on the kernel path.

    bash eval/device_run.sh python3 eval/check_variants.py --out $OUT       # ≈ 3 min on an H100; exits 1 on a failure
    python eval/check_variants.py --quick --out $OUT                       # the model-shaped cases at ≤ 32k
    python eval/check_variants.py --tiny                                   # CPU, tiny shapes, backend "reference"
    TRITON_INTERPRET=1 python eval/check_variants.py --tiny --backend triton   # CPU, the Triton kernel interpreted

Each case calls ``hf_qattn.qattn(..., is_causal=True, window=, chunk=, sinks=, softcap=, return_lse=True)`` and
compares it with softmax attention computed here in float64 (:func:`variant_reference`: query rows in blocks,
each block against only the keys its rows can see, so a 128k-token sliding window costs a few seconds and
fits in memory; an independent implementation of the rules of ``hf_qattn.qattn``'s docstring, not the
package's own reference). The cases are the layers of today's open models at user lengths:

  * sliding window 4096 at 128k tokens, d128 (Mistral-like, GQA 32/8) and d256 (Gemma-3-like, GQA 16/8);
  * chunked attention, chunk 8192, at 32k tokens (Llama 4 Scout: GQA 40/8, d128);
  * gpt-oss: sinks (one logit per head) with window 128, and sinks on a full causal layer, 32k, GQA 64/8, d64;
  * Gemma 2: soft-cap 50, d256, GQA 16/8, 32k, full causal and with window 4096;
  * combinations and edges: window and chunk together, sinks + soft-cap + window, a window not a multiple of
    any tile, a small window (16), Nq < Nk (a prompt continued after cached keys), NHD, float16, and the
    portable Triton kernel forced (``backend="triton"``) on head dims the Hopper kernel would otherwise take.

Inputs: eval/synthetic.py's recipe (channel spreads and offsets, outlier channels in Q and K, Q×2: peaked
attention, so a key wrongly in or out of a row's window changes that row), drawn on the device
(:func:`device_outlier_qkv`). Sinks are drawn around each head's median row log-sum-exp (± N(0, 1)), so the sink
takes a real share of every denominator: a sink dropped or counted twice moves the output and the lse by
tenths, far beyond the bounds.

A case passes when:
  * the call ran on a quantized kernel path (``hopper`` or ``triton``; ``reference`` on the CPU modes) — a
    full-precision fallback (``sdpa``/``eager``) is a FAIL and its reason is printed; a degraded quantized path
    (an sm90 call on the Triton kernel because the Hopper kernel does not serve the variant yet) passes but
    is named in the row with its counted reason;
  * every output is finite;
  * cos to the reference ≥ 0.999 (issue 27's bound; check_device.py asks 0.99 of plain attention);
  * RelL1 ≤ 0.03 (check_decode.py's bound against exact attention for INT8 K);
  * the lse (capped scores and the sink's term included) within ``LSE_TOL`` of the reference's, on average over
    rows (see LSE_TOL).
check_device.py's element bound (|err| > 2 % of max|ref| for ≤ 0.1 % of elements) and its lse bound (0.01) hold
against the simulated reference (the same quantized scores), which cannot run at 128k; against exact attention
the kernel's own rounding exceeds them on plain causal calls (the reference simulation at 1k tokens, d64–d256:
0.06–0.45 % of elements over, mean |Δlse| 0.03–0.055), so the fraction is reported, not bounded. Reported as
well: RelL2, max |out − ref|, the worst row's RelL2 (large where a sink takes most of a row's weight and the
row's output is small), the lse's largest gap, and the first call's seconds (compilation included). Prints the
table last; writes ``check-variants-<device>-<date>.md`` under ``--out``; exits 1 when any case fails.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time
import traceback

import torch

import hf_qattn

import report  # eval/report.py
from synthetic import outlier_qkv  # eval/synthetic.py

COS_MIN = 0.999
REL_L1_MAX = 0.03
ELEMENT_TOL = 0.02  # reported: the fraction of elements with |err| over this share of max|ref|
# Mean |lse − lse_ref| over rows. Against exact attention the INT8 score rounding itself moves the lse: the
# reference simulation of the kernels (hf_qattn.reference.quantized_attention) on these inputs, plain causal,
# 1k tokens, gives a mean of 0.036 (d128), 0.040 (d256), 0.054 (d64). A sink left out of the denominator (or
# counted twice) moves it by log(1 + e^(sink − lse)) ≈ 0.3–1.3 with these sinks, a cap not applied by more.
LSE_TOL = 0.1
KERNEL_PATHS = ("hopper", "triton")


# ---------------------------------------------------------------------------------------------------------
def device_outlier_qkv(batch, heads, kv_heads, tokens, head_dim, *, seed, dtype, device):
    """Q, K, V (HND) by eval/synthetic.py's recipe, the per-token noise drawn on ``device``."""
    return outlier_qkv(batch, heads, tokens, head_dim, kv_heads=kv_heads, seed=seed, dtype=dtype, device=device,
                       draw_on=device)


def variant_reference(q, k, v, *, sm_scale=None, window=None, chunk=None, sinks=None, softcap=None, rows=None,
                      dtype=torch.float64, block=512, budget_bytes=1 << 29):
    """Causal softmax attention with the variants, computed in ``dtype``; (out float32, lse float32), HND.

    The rules (``hf_qattn.qattn``'s contract): query row i sits at key position p = i + Nk − Nq and sees keys j
    with j ≤ p, and p − W < j (``window`` W), and j // C == p // C (``chunk`` C); scores s = sm_scale·q·k,
    capped to c·tanh(s / c) (``softcap`` c) before the softmax; ``sinks`` (Hq,) adds exp(sink) to each row's
    denominator, with no value. lse = log of that denominator. A row that sees nothing (p < 0) is zeros, its
    lse −inf (the sink's logit with sinks). Query rows go in blocks of ``block``, each against only the keys
    its rows can see ([lowest first key, highest p]), kv heads in groups sized so the scores of one step stay
    near ``budget_bytes``. ``rows``: a sorted 1-D tensor of query rows (default all); the outputs hold them.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    rows = torch.arange(nq, device=dev) if rows is None else rows.to(dev)
    out = torch.zeros(b, hq, rows.numel(), d, dtype=torch.float32, device=dev)
    lse = torch.full((b, hq, rows.numel()), -math.inf, dtype=torch.float32, device=dev)
    sink = None if sinks is None else sinks.to(dev, dtype).view(hk, g, 1)
    elt = torch.empty((), dtype=dtype).element_size()
    for start in range(0, rows.numel(), block):
        r = rows[start:start + block]
        p = r + (nk - nq)
        p_min, p_max = int(p.min()), int(p.max())
        hi = p_max + 1
        lo = 0
        if window is not None:
            lo = max(lo, p_min - window + 1)
        if chunk is not None:
            lo = max(lo, (p_min // chunk) * chunk)
        if hi <= lo:  # every row of the block sees nothing: zeros, lse −inf (or the sink)
            if sink is not None:
                lse[:, :, start:start + r.numel()] = sink.view(1, hq, 1).float()
            continue
        j = torch.arange(lo, hi, device=dev)
        seen = j[None, :] <= p[:, None]
        if window is not None:
            seen &= j[None, :] > p[:, None] - window
        if chunk is not None:
            seen &= (j[None, :] // chunk) == (p[:, None] // chunk)
        per_kv_head = 4 * b * g * r.numel() * (hi - lo) * elt  # scores, their exp, the mask's fill: a margin
        step = max(1, min(hk, budget_bytes // max(per_kv_head, 1)))
        for h0 in range(0, hk, step):
            hs = min(step, hk - h0)
            qh = q[:, h0 * g:(h0 + hs) * g][:, :, r].to(dtype).view(b, hs, g * r.numel(), d)
            kh = k[:, h0:h0 + hs, lo:hi].to(dtype)
            vh = v[:, h0:h0 + hs, lo:hi].to(dtype)
            s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale)
            if softcap is not None:
                s = s.div_(softcap).tanh_().mul_(softcap)
            s = s.view(b, hs, g, r.numel(), hi - lo).masked_fill_(~seen, -math.inf)
            row_lse = torch.logsumexp(s, dim=-1)  # (b, hs, g, R)
            if sink is not None:
                row_lse = torch.logaddexp(row_lse, sink[h0:h0 + hs].expand_as(row_lse))
            finite = torch.isfinite(row_lse)
            w = torch.exp(s - torch.where(finite, row_lse, 0.0)[..., None])
            o = torch.matmul(w.view(b, hs, g * r.numel(), hi - lo), vh).view(b, hs, g, r.numel(), d)
            o = torch.where(finite[..., None], o, 0.0)
            out[:, h0 * g:(h0 + hs) * g, start:start + r.numel()] = o.reshape(b, hs * g, r.numel(), d).float()
            lse[:, h0 * g:(h0 + hs) * g, start:start + r.numel()] = row_lse.reshape(b, hs * g, r.numel()).float()
            del s, w, o
    return out, lse


def sinks_for(q, k, v, *, sm_scale=None, window=None, chunk=None, softcap=None, seed=0, rows=256):
    """One sink logit per query head near that head's median row lse (± N(0, 1)): the sink then takes a real
    share of each denominator, the hardest test of its term. The lse of ``rows`` query rows spread over the
    sequence, without sinks, by :func:`variant_reference`."""
    nq = q.shape[2]
    picked = torch.linspace(0, nq - 1, min(rows, nq), device=q.device).long().unique()
    _, lse = variant_reference(q, k, v, sm_scale=sm_scale, window=window, chunk=chunk, softcap=softcap,
                               rows=picked, dtype=torch.float32, block=32)
    median = lse.flatten(2).transpose(0, 1).reshape(q.shape[1], -1).median(dim=1).values
    gen = torch.Generator().manual_seed(seed)
    return (median.cpu() + torch.randn(q.shape[1], generator=gen)).to(q.device, torch.float32)


def compare(out, ref):
    """Errors of ``out`` against ``ref`` (same shape, HND), head by head in float64 (a 128k-token output in
    float64 at once would take gigabytes): cos, RelL1, RelL2, max|out − ref|, the fraction of elements over
    ELEMENT_TOL·max|ref|, the worst row's RelL2, finite."""
    finite = bool(torch.isfinite(out).all())
    tol = ELEMENT_TOL * ref.abs().amax().item()
    dot = oo = rr = l1 = r1 = d2 = 0.0
    worst_row = max_abs = 0.0
    over = 0
    for h in range(out.shape[1]):
        o, r = out[:, h].double(), ref[:, h].double()
        diff = o - r
        dot += (o * r).sum().item()
        oo += (o * o).sum().item()
        rr += (r * r).sum().item()
        l1 += diff.abs().sum().item()
        r1 += r.abs().sum().item()
        d2 += (diff * diff).sum().item()
        max_abs = max(max_abs, diff.abs().max().item())
        over += int((diff.abs() > tol).sum())
        row = diff.norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
        worst_row = max(worst_row, row.max().item())
    if not finite:
        nan = float("nan")
        return dict(cos=nan, rel_l1=nan, rel_l2=nan, max_abs=nan, frac_over=nan, worst_row_l2=nan, finite=False)
    return dict(cos=dot / math.sqrt(oo * rr) if oo * rr > 0 else float(oo == rr), rel_l1=l1 / max(r1, 1e-300),
                rel_l2=math.sqrt(d2 / max(rr, 1e-300)), max_abs=max_abs, frac_over=over / out.numel(),
                worst_row_l2=worst_row, finite=True)


def served_by():
    """(path, reasons): where the counted calls since the last reset went, and the fallback / degradation
    reasons counted with them (hf_qattn.fallback_stats)."""
    stats = hf_qattn.fallback_stats()
    return "+".join(sorted(stats["calls"])) or "?", dict(stats["fallbacks"])


# ---------------------------------------------------------------------------------------------------------
# (name, shape and variants); b, hq, hk, nq, nk, d, window, chunk, sinks, softcap, dtype, layout, backend
BASE = dict(b=1, hq=8, hk=2, nq=8192, nk=8192, d=128, window=None, chunk=None, sinks=False, softcap=None,
            dtype=torch.bfloat16, layout="HND", backend=None)


def cases(quick: bool, tiny: bool) -> list[tuple[str, dict]]:
    if tiny:  # CPU: shapes that cut tiles raggedly, every variant and a few combinations
        n = 300
        return [(name, {**BASE, "hq": 4, "hk": 2, "nq": n, "nk": n, "d": 32, **over}) for name, over in (
            ("window 64", dict(window=64)),
            ("window 100, d64, NHD", dict(window=100, d=64, layout="NHD")),
            ("chunk 128", dict(chunk=128)),
            ("window 50 + chunk 128", dict(window=50, chunk=128)),
            ("sinks + window 16, GQA 4/1", dict(sinks=True, window=16, hq=4, hk=1)),
            ("sinks, causal", dict(sinks=True)),
            ("softcap 5", dict(softcap=5.0)),
            ("softcap 5 + window 64 + sinks, fp16", dict(softcap=5.0, window=64, sinks=True, dtype=torch.float16)),
            ("window 64, Nq 77 < Nk", dict(window=64, nq=77)),
            ("chunk 128, Nq 77 < Nk", dict(chunk=128, nq=77)),
        )]
    k128 = 131072
    model = [
        ("Mistral-like sliding: window 4096, 128k, d128, GQA 32/8",
         dict(hq=32, hk=8, nq=k128, nk=k128, d=128, window=4096)),
        ("Gemma-3-like sliding: window 4096, 128k, d256, GQA 16/8",
         dict(hq=16, hk=8, nq=k128, nk=k128, d=256, window=4096)),
        ("Llama-4 chunked: chunk 8192, 32k, d128, GQA 40/8", dict(hq=40, hk=8, nq=32768, nk=32768, chunk=8192)),
        ("gpt-oss sliding: sinks + window 128, 32k, d64, GQA 64/8",
         dict(hq=64, hk=8, nq=32768, nk=32768, d=64, sinks=True, window=128)),
        ("gpt-oss full: sinks, causal 32k, d64, GQA 64/8", dict(hq=64, hk=8, nq=32768, nk=32768, d=64, sinks=True)),
        ("Gemma-2 global: softcap 50, causal 32k, d256, GQA 16/8",
         dict(hq=16, hk=8, nq=32768, nk=32768, d=256, softcap=50.0)),
        ("Gemma-2 sliding: softcap 50 + window 4096, 32k, d256, GQA 16/8",
         dict(hq=16, hk=8, nq=32768, nk=32768, d=256, softcap=50.0, window=4096)),
    ]
    if quick:  # the same layers at 32k
        model = [(name.replace("128k", "32k"), {**over, "nq": min(over["nq"], 32768), "nk": min(over["nk"], 32768)})
                 for name, over in model]
        edges = []
    else:
        edges = [
            ("window 3000 + chunk 8192, 32k", dict(nq=32768, nk=32768, window=3000, chunk=8192)),
            ("sinks + softcap 30 + window 1000, d128, float16", dict(sinks=True, softcap=30.0, window=1000,
                                                                    dtype=torch.float16)),
            ("window 16, d128", dict(window=16)),
            ("window 1000 (no tile multiple), Nq 1000 after 32k keys", dict(nq=1000, nk=32768, window=1000)),
            ("chunk 8192, Nq 3000 across a chunk edge (queries at keys 15000–17999, the edge at 16384)",
             dict(nq=3000, nk=18000, chunk=8192)),
            ("window 4096, NHD, 16k, GQA 8/1", dict(nq=16384, nk=16384, hk=1, window=4096, layout="NHD")),
            ("Triton kernel forced: sinks + window 128, d64, GQA 64/8, 8k",
             dict(hq=64, hk=8, d=64, sinks=True, window=128, backend="triton")),
            ("Triton kernel forced: chunk 2048 + softcap 50, d128, 8k", dict(chunk=2048, softcap=50.0,
                                                                            backend="triton")),
        ]
    return [(name, {**BASE, **over}) for name, over in model + edges]


def run_case(case: dict, *, device: str, backend: str, seed: int, ref_dtype: torch.dtype):
    b, hq, hk, nq, nk, d = (case[x] for x in ("b", "hq", "hk", "nq", "nk", "d"))
    q, k, v = device_outlier_qkv(b, hq, hk, max(nq, nk), d, seed=seed, dtype=case["dtype"], device=device)
    q, k, v = q[:, :, max(nq, nk) - nq:], k[:, :, :nk], v[:, :, :nk]  # the last Nq tokens query all Nk keys
    variants = dict(window=case["window"], chunk=case["chunk"], softcap=case["softcap"])
    sinks = sinks_for(q, k, v, seed=seed, **variants) if case["sinks"] else None
    ref, ref_lse = variant_reference(q, k, v, sinks=sinks, dtype=ref_dtype, **variants)
    if case["layout"] == "NHD":  # a real NHD tensor
        args = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    else:
        args = [q, k, v]
    hf_qattn.reset_fallback_stats()
    t0 = time.perf_counter()
    out, lse = hf_qattn.qattn(*args, is_causal=True, sinks=sinks, return_lse=True, layout=case["layout"],
                              backend=case["backend"] or backend, **variants)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0  # the first call: compilation included
    path, reasons = served_by()
    if case["layout"] == "NHD":
        out = out.transpose(1, 2)
    errors = compare(out, ref)
    gap = (lse.float() - ref_lse).abs()
    both_inf = torch.isinf(lse) & torch.isinf(ref_lse) & (lse.sign() == ref_lse.sign())
    gap = torch.where(both_inf, 0.0, gap)
    lse_mean, lse_max = gap.mean().item(), gap.max().item()
    allowed = KERNEL_PATHS if device == "cuda" else KERNEL_PATHS + ("reference",)
    on_kernel = path in allowed
    ok = (on_kernel and errors["finite"] and errors["cos"] >= COS_MIN and errors["rel_l1"] <= REL_L1_MAX
          and lse_mean <= LSE_TOL)
    detail = {"path": path + ("" if on_kernel else " (FALLBACK: not a quantized kernel)")}
    if reasons:
        detail["counted reasons"] = "; ".join(f"{reason} ×{n}" for reason, n in reasons.items())
    detail.update(cos=errors["cos"], rel_l1=errors["rel_l1"], rel_l2=errors["rel_l2"], max_abs=errors["max_abs"],
                  frac_over=errors["frac_over"], worst_row_l2=errors["worst_row_l2"], lse_mean=lse_mean,
                  lse_max=lse_max, first_call_s=seconds)
    return ok, detail


def describe(name: str, case: dict) -> str:
    extra = [str(case["dtype"]).split(".")[-1]]
    if case["backend"]:
        extra.append(f"backend={case['backend']}")
    return f"{name} (B{case['b']} Hq{case['hq']} Hk{case['hk']} Nq{case['nq']} Nk{case['nk']} d{case['d']}, " \
           f"{', '.join(extra)})"


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6f}" if 0.99 < value < 1.0 else f"{value:.4g}"
    return str(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="folder for check-variants-<device>-<date>.md (default: print only)")
    p.add_argument("--quick", action="store_true", help="the model-shaped cases only, at 32k")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (the script's logic; backend reference)")
    p.add_argument("--backend", default=None, choices=["auto", "hopper", "triton", "reference"],
                   help="qattn's backend (default: auto on a GPU, reference for --tiny)")
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    p.add_argument("--list", action="store_true", help="print the cases this run would check, and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32-reference", action="store_true", help="the reference in float32 (default float64)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, case in cases(args.quick, args.tiny):
            if args.only in name:
                print(describe(name, case))
        return 0
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        print("no CUDA device: run with --tiny (CPU) or on the GPU machine", file=sys.stderr)
        return 2
    backend = args.backend or ("reference" if device == "cpu" and not os.environ.get("TRITON_INTERPRET") else "auto")
    ref_dtype = torch.float32 if args.fp32_reference else torch.float64
    rows = []
    started = time.perf_counter()
    for i, (name, case) in enumerate(cases(args.quick, args.tiny)):
        if args.only and args.only not in name:
            continue
        if device == "cpu" and case["backend"] == "triton" and not os.environ.get("TRITON_INTERPRET"):
            case = {**case, "backend": None}  # the forced-Triton rows need the interpreter on the CPU
        try:
            ok, detail = run_case(case, device=device, backend=backend, seed=args.seed + i, ref_dtype=ref_dtype)
        except Exception as error:  # a crash is a failed case, reported with the rest
            traceback.print_exc()
            ok, detail = False, {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append((describe(name, case), ok, ", ".join(f"{k}={fmt(v)}" for k, v in detail.items())))
        print("PASS" if ok else "FAIL", rows[-1][0], rows[-1][2], flush=True)
    print(f"total {time.perf_counter() - started:.1f} s", flush=True)
    bounds = (f"bounds: quantized kernel path, finite, cos ≥ {COS_MIN}, RelL1 ≤ {REL_L1_MAX}, mean |Δlse| ≤ {LSE_TOL} "
              f"(frac_over: elements with |err| > {ELEMENT_TOL:g}·max|ref|, reported); reference in "
              f"{str(ref_dtype).split('.')[-1]}; backend {backend}; inputs: eval/synthetic.py's recipe on the device")
    command = "python eval/check_variants.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return report.finish("Attention variants: accuracy at user lengths",
                         f"{report.versions('transformers')}\n\n{bounds}\n\n`{command.strip()}`",
                         rows, args.out, "check-variants")


if __name__ == "__main__":
    sys.exit(main())
