"""Attention variants (issue 27) on a GPU: qattn against FlexAttention, transformers' default paths and dense SDPA.

    bash eval/device_run.sh python3 eval/bench_variants.py --out $OUT      # ≈ 3–4 min on an H100
    python eval/bench_variants.py --quick --out $OUT                      # the two target layers only
    python eval/bench_variants.py --tiny                                  # CPU, tiny shapes (the script's logic)

One process, one table, each layer's inputs shared by every method (eval/synthetic.py's recipe drawn on the
device, bf16, B1; qattn's time includes its quantization passes). The layers (``--cases`` picks by key):

  sliding-d128 / sliding-d256   window 1024, 8k causal prompt, 32 heads (Gemma 3 / Mistral sliding layers);
                                targets: qattn ≥ 1.2× Flex, ≥ 3× transformers' SDPA path
  gpt-oss-sliding               sinks (one logit per head) + window 128, 8k, GQA 64/8, d64; target ≥ 1.2× Flex
  gpt-oss-full                  sinks on a full causal layer, 8k, GQA 64/8, d64
  llama4-chunked                chunk 8192 on a 16k prompt (the real chunk size: an 8k prompt would be one
                                chunk, i.e. plain causal), GQA 40/8, d128 (Llama 4 Scout)
  gemma2-sliding                soft-cap 50 + window 4096, 8k, GQA 16/8, d256 (Gemma 2 9B's sliding layers)

Methods (each built once outside the timing, as a user's model would: masks and block masks included):
  * qattn: ``hf_qattn.qattn(q, k, v, is_causal=True, window=, chunk=, sinks=, softcap=)``, eager;
  * Flex: ``torch.compile``'d ``flex_attention`` with the layer's block mask (``create_block_mask`` once) and,
    for soft-capping, a ``score_mod``. Sinks cannot be a ``score_mod`` (a sink adds a term to the denominator,
    with no value): Flex runs without them and returns its lse L (natural log), and the output is rescaled by
    e^L / (e^L + e^sink) = sigmoid(L − sink) — exactly Σ e^s v / (Σ e^s + e^sink). That rescale is compiled in
    the same function, so inductor fuses it (transformers' flex path does the same renormalization);
  * transformers' SDPA path: ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` with the
    layer's full boolean mask (B, 1, N, N) materialized, as transformers' sdpa integration hands it for a
    sliding or chunked layer (a mask also turns off its GQA and causal shortcuts: the same here);
  * SDPA causal: ``scaled_dot_product_attention(is_causal=True)`` with no window — dense attention, the floor
    a sliding layer costs without a window-aware kernel;
  * eager: the model's own ``eager_attention_forward`` from transformers (gpt-oss, Gemma 2: their default, as
    SDPA takes neither sinks nor soft-caps) with the additive mask transformers builds (the full score matrix:
    at 8k, 64 heads, gigabytes — a method out of memory says so in its cell).
Time: the median of ``triton.testing.do_bench`` (eval/timing.py ``bench_ms``); ratios are the baseline's ms over
qattn's (> 1: qattn faster). qattn and Flex are also timed from a CUDA graph of 10 calls (``graph_ms``: GPU time
alone, the columns ``GPU ms`` and ``qattn × flex GPU``), since an eager call of a few hundred µs is host-bound.
Each method's output is also compared (cos) with float32 attention of the same layer
(eval/check_variants.py's ``variant_reference``), so a speed never hides a wrong answer. A method that fails
(Flex cannot compile a shape, out of memory) gets a note in its cell and the run goes on.
Writes ``bench-variants-<device>-<date>.md`` (``--out``: a folder or a .md file; default eval/results/).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
import types

import torch

import hf_qattn

import report  # eval/report.py
from check_variants import device_outlier_qkv, sinks_for, variant_reference  # eval/check_variants.py
from timing import bench_ms, events_ms, graph_ms  # eval/timing.py

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: its cells say so
    flex_attention = create_block_mask = None
try:  # torch ≥ 2.9: return_aux=AuxRequest(lse=True); return_lse=True before (deprecated since)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

FLEX_TARGET, SDPA_TARGET = 1.2, 3.0


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------------------
# key: (label, shape and variants, methods, targets as (method, minimum speed-up of qattn over it))
CASES = {
    "sliding-d128": ("sliding window 1024, 8k, H32, d128 (Gemma 3 / Mistral)",
                     dict(hq=32, hk=32, n=8192, d=128, window=1024),
                     ("qattn", "flex", "sdpa-mask", "sdpa-causal"), (("flex", FLEX_TARGET), ("sdpa-mask", SDPA_TARGET))),
    "sliding-d256": ("sliding window 1024, 8k, H32, d256 (Gemma 3)",
                     dict(hq=32, hk=32, n=8192, d=256, window=1024),
                     ("qattn", "flex", "sdpa-mask", "sdpa-causal"), (("flex", FLEX_TARGET), ("sdpa-mask", SDPA_TARGET))),
    "gpt-oss-sliding": ("gpt-oss sliding: sinks + window 128, 8k, GQA 64/8, d64",
                        dict(hq=64, hk=8, n=8192, d=64, window=128, sinks=True, eager="gpt-oss"),
                        ("qattn", "flex", "eager"), (("flex", FLEX_TARGET),)),
    "gpt-oss-full": ("gpt-oss full: sinks, causal 8k, GQA 64/8, d64",
                     dict(hq=64, hk=8, n=8192, d=64, sinks=True, eager="gpt-oss"),
                     ("qattn", "flex", "eager", "sdpa-causal"), ()),
    "llama4-chunked": ("Llama 4 chunked: chunk 8192, 16k, GQA 40/8, d128", dict(hq=40, hk=8, n=16384, d=128, chunk=8192),
                       ("qattn", "flex", "sdpa-mask", "sdpa-causal"), ()),
    "gemma2-sliding": ("Gemma 2 sliding: softcap 50 + window 4096, 8k, GQA 16/8, d256",
                       dict(hq=16, hk=8, n=8192, d=256, window=4096, softcap=50.0, eager="gemma2"),
                       ("qattn", "flex", "eager", "sdpa-causal"), ()),
}
QUICK = ("sliding-d128", "gpt-oss-sliding")
TINY = dict(n=384, window=64, chunk=128)  # --tiny: every case at this length, window / chunk shrunk to fit


# ---------------------------------------------------------------------------------------------------------
def visible(n, window=None, chunk=None, device="cpu"):
    """(N, N) bool, True where query i sees key j: the rules of ``hf_qattn.qattn`` with Nq = Nk."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    if chunk is not None:
        keep &= (j // chunk) == (i // chunk)
    return keep


def flex_mask_mod(window, chunk):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (kv_idx > q_idx - window)
        if chunk is not None:
            keep = keep & ((kv_idx // chunk) == (q_idx // chunk))
        return keep
    return mask_mod


def flex_softcap(cap):
    def score_mod(score, b, h, q_idx, kv_idx):  # score = scale·q·k already
        return cap * torch.tanh(score / cap)
    return score_mod


def _flex_with_sinks(q, k, v, sinks, block_mask, score_mod, enable_gqa):
    """FlexAttention with one sink logit per query head: out · sigmoid(lse − sink) (see the docstring)."""
    if AuxRequest is not None:
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                  return_aux=AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                  return_lse=True)
    return (out.float() * torch.sigmoid(lse.float() - sinks.float()[None, :, None])[..., None]).to(q.dtype)


def _flex_plain(q, k, v, block_mask, score_mod, enable_gqa):
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)


_compiled = {}


def compiled(fn, flex_mode: str | None):
    """``fn`` compiled once in ``torch.compile`` mode ``flex_mode`` (each shape then compiles its own graph), or
    as is when ``flex_mode`` is None."""
    if flex_mode is None:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False, mode=None if flex_mode == "default" else flex_mode)
    return _compiled[fn]


def build(method, q, k, v, spec, sinks, scale, flex_mode):
    """(zero-argument call, its output → HND) for ``method`` on this layer; masks built here, once."""
    window, chunk, softcap = spec.get("window"), spec.get("chunk"), spec.get("softcap")
    hq, hk, n = q.shape[1], k.shape[1], q.shape[2]
    same = lambda out: out  # noqa: E731
    from_nhd = lambda out: out.transpose(1, 2)  # noqa: E731  (transformers' functions return B, N, H, D)
    if method == "qattn":
        return (lambda: hf_qattn.qattn(q, k, v, is_causal=True, sm_scale=scale, window=window, chunk=chunk,
                                       sinks=sinks, softcap=softcap)), same
    if method == "flex":
        if flex_attention is None:
            raise RuntimeError("this torch has no torch.nn.attention.flex_attention")
        block_mask = create_block_mask(flex_mask_mod(window, chunk), None, None, n, n, device=q.device)
        score_mod = flex_softcap(softcap) if softcap is not None else None
        if sinks is not None:
            fn = compiled(_flex_with_sinks, flex_mode)
            return (lambda: fn(q, k, v, sinks, block_mask, score_mod, hq != hk)), same
        fn = compiled(_flex_plain, flex_mode)
        return (lambda: fn(q, k, v, block_mask, score_mod, hq != hk)), same
    if method == "sdpa-mask":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = visible(n, window, chunk, q.device)[None, None]  # transformers' sdpa mask: bool, True = attend
        module = types.SimpleNamespace(is_causal=True, num_key_value_groups=hq // hk, training=False)
        return (lambda: sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale)[0]), from_nhd
    if method == "sdpa-causal":
        return (lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hk)), same
    if method == "eager":  # the model's own eager attention (spec["eager"]: gpt-oss or gemma2)
        keep = visible(n, window, chunk, q.device)[None, None]
        additive = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, torch.finfo(q.dtype).min)
        del keep
        if spec["eager"] == "gpt-oss":
            from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

            module = types.SimpleNamespace(num_key_value_groups=hq // hk, training=False, sinks=sinks.to(q.dtype))
            return (lambda: gpt_oss_eager(module, q, k, v, additive, scaling=scale, dropout=0.0)[0]), from_nhd
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager

        module = types.SimpleNamespace(num_key_value_groups=hq // hk, training=False, head_dim=q.shape[-1])
        return (lambda: gemma2_eager(module, q, k, v, additive, dropout=0.0, scaling=scale,
                                                softcap=softcap)[0]), from_nhd
    raise ValueError(f"unknown method {method!r}")


def time_ms(fn, device):
    if device == "cuda":
        return bench_ms(fn, warmup=25, rep=100)
    return events_ms(fn, calls=1, repeats=3)


def short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"failed: {type(error).__name__}" + (f": {text[:90]}" if text else "")


def cos_to(out, ref) -> float:
    o, r = out.double().flatten(), ref.double().flatten()
    if not torch.isfinite(o).all():
        return float("nan")
    return (o @ r / (o.norm() * r.norm())).item()


def run_case(key, *, device, flex_mode, tiny, seed):
    label, spec, methods, targets = CASES[key]
    spec = dict(spec)
    if tiny:
        spec.update(n=TINY["n"], hq=max(spec["hq"] // 8, 2), hk=max(spec["hk"] // 8, 1), d=min(spec["d"], 64))
        spec["window"] = spec.get("window") and min(spec["window"], TINY["window"])
        spec["chunk"] = spec.get("chunk") and TINY["chunk"]
        label += f" [tiny: N{spec['n']} H{spec['hq']}/{spec['hk']} d{spec['d']}]"
    hq, hk, n, d = spec["hq"], spec["hk"], spec["n"], spec["d"]
    q, k, v = device_outlier_qkv(1, hq, hk, n, d, seed=seed, dtype=torch.bfloat16, device=device)
    variants = dict(window=spec.get("window"), chunk=spec.get("chunk"), softcap=spec.get("softcap"))
    sinks = sinks_for(q, k, v, seed=seed, **variants) if spec.get("sinks") else None
    scale = d ** -0.5
    ref, _ = variant_reference(q, k, v, sinks=sinks, dtype=torch.float32, **variants)
    row = {"layer": label}
    ms = {}
    for method in methods:
        t0 = time.perf_counter()
        try:
            if method == "qattn":
                hf_qattn.reset_fallback_stats()
            fn, to_hnd = build(method, q, k, v, spec, sinks, scale, flex_mode)
            out = fn()  # the first call: compilation, autotuning; also the output the cosine reads
            if device == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            if method == "qattn":
                stats = hf_qattn.fallback_stats()
                row["qattn path"] = "+".join(sorted(stats["calls"])) + "".join(
                    f" ({reason})" for reason in stats["fallbacks"])
            if method != "sdpa-causal":  # dense causal is another attention: no cosine to this layer's
                row[f"{method} cos"] = cos_to(to_hnd(out), ref)
            del out
            ms[method] = time_ms(fn, device)
            row[f"{method} ms"] = ms[method]
            if device == "cuda" and method in GRAPHED:
                try:  # GPU time alone: an eager call of a few hundred µs is bound by the host's Python and launches
                    row[f"{method} GPU ms"] = graph_ms(fn, calls=10, replays=5)
                except Exception as error:  # noqa: BLE001  (a method that cannot be captured says so in its cell)
                    row[f"{method} GPU ms"] = short(error)
            cos = f", cos {fmt(row[f'{method} cos'])}" if f"{method} cos" in row else ""
            log(f"    {method}: {ms[method]:.3f} ms{cos}, first call {first_s:.1f} s")
        except Exception as error:  # one baseline failing must not stop the others
            traceback.print_exc()
            row[f"{method} ms"] = short(error)
            log(f"    {method}: {row[f'{method} ms']}")
        finally:
            fn = None
            if device == "cuda":
                torch.cuda.empty_cache()
    for method in methods[1:]:
        if "qattn" in ms and method in ms:
            row[f"qattn × {method}"] = ms[method] / ms["qattn"]
        if isinstance(row.get("qattn GPU ms"), float) and isinstance(row.get(f"{method} GPU ms"), float):
            row[f"qattn × {method} GPU"] = row[f"{method} GPU ms"] / row["qattn GPU ms"]
    verdicts = []
    for method, minimum in targets:
        got = row.get(f"qattn × {method}")
        verdicts.append(f"×{method} ≥ {minimum}: " + ("n/a" if got is None else ("met" if got >= minimum else "MISSED")))
    row["targets"] = "; ".join(verdicts) or "—"
    return row


# ---------------------------------------------------------------------------------------------------------
def fmt(value):
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.6f}" if 0.99 < value < 1.0 else (f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}")
    return str(value)


METHODS = ("qattn", "flex", "sdpa-mask", "sdpa-causal", "eager")
GRAPHED = ("qattn", "flex")  # also timed from a CUDA graph (GPU time alone)
COLUMNS = (["layer", "qattn path"] + [f"{m} ms" for m in METHODS] + [f"qattn × {m}" for m in METHODS[1:]]
           + [f"{m} GPU ms" for m in GRAPHED] + ["qattn × flex GPU"]
           + [f"{m} cos" for m in METHODS if m != "sdpa-causal"] + ["targets"])


def markdown(rows):
    """One table, COLUMNS in order (those no row has left out); a cell a row lacks is '—'."""
    keys = [key for key in COLUMNS if any(key in row for row in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(key, "—")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def short_table(rows):
    """The line a run prints last: per layer qattn's ms and its speed-ups."""
    lines = []
    for row in rows:
        ratios = ", ".join(f"{key.split(' × ')[1]} {value:.2f}×" for key, value in row.items()
                           if key.startswith("qattn × ") and isinstance(value, float))
        qattn = row.get("qattn ms")
        lines.append(f"{row['layer']}: qattn {fmt(qattn)} ms, cos {fmt(row.get('qattn cos', float('nan')))}; "
                     f"{ratios or 'no ratios'}; {row['targets']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="", help=f"comma-separated keys of {', '.join(CASES)} (default: all)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes: the script's logic (backend reference)")
    p.add_argument("--no-compile", action="store_true", help="Flex uncompiled (its math path; for --tiny checks)")
    p.add_argument("--flex-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode for Flex (max-autotune: minutes of tuning a shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder or .md file (default eval/results/)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    keys = [key for key in args.cases.split(",") if key] or (list(QUICK) if args.quick else list(CASES))
    unknown = [key for key in keys if key not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        print("no CUDA device: run with --tiny (CPU) or on the GPU machine", file=sys.stderr)
        return 2
    if hasattr(torch._dynamo.config, "recompile_limit"):  # each layer's shapes are a graph of their own
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if hasattr(torch._dynamo.config, "cache_size_limit"):
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out = report.result_path("bench-variants", args.out)
    command = "python eval/bench_variants.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [f"# Attention variants: qattn against FlexAttention, transformers' paths and SDPA — "
              f"{report.device_name()}, {report.today()}", "",
              report.versions("transformers"), "", f"`{command.strip()}`", "",
              "B1, bf16, inputs by eval/synthetic.py's recipe; ms: median of triton's do_bench (host clock on the "
              "CPU); qattn includes its quantization passes; `qattn × M` = M's ms / qattn's ms; `cos`: against "
              "float32 attention of the same layer. Methods: see the script's docstring. Flex "
              + ("uncompiled (--no-compile)" if args.no_compile else f"compiled with torch.compile (mode {args.flex_mode})")
              + ".", ""]
    rows = []
    started = time.perf_counter()
    for i, key in enumerate(keys):
        log(f"== {CASES[key][0]}")
        try:
            rows.append(run_case(key, device=device, flex_mode=None if args.no_compile else args.flex_mode,
                                 tiny=args.tiny, seed=args.seed + i))
        except Exception as error:  # inputs or the reference failed: the layer's row says so
            traceback.print_exc()
            rows.append({"layer": CASES[key][0], "targets": short(error)})
        report.write(out, "\n".join(header + [markdown(rows)]))  # after every layer: a cut run keeps its rows
    log(f"total {time.perf_counter() - started:.0f} s; wrote {out}")
    log("\n" + markdown(rows) + "\n\n" + short_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
