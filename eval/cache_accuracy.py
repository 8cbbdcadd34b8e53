"""Accuracy of generation through the quantized KV cache on a real model (issue 10, item 7).

    python eval/cache_accuracy.py --out eval/results            # SmolLM2-135M-Instruct, CPU, ≈ 15 min

1. Perplexity through the cache: WikiText-2 *test* windows fed in chunks of ``--chunk`` tokens, each
   chunk attending to the cache of everything before it. The NLL counts the tokens predicted by every
   chunk but the first (those attend to cached tokens only through the cache; the first chunk is the
   prefill). Modes: transformers' DynamicCache with SDPA (full-precision cache, the reference) and
   ``hf_qattn.QAttnCache`` with ``attn_implementation="qattn"``, INT8 K or INT4 K in every layer (INT8 V per token, equalized).
2. Greedy agreement: ``--prompts`` prompts of ``--prompt-len`` tokens from WikiText-2 test, ``--new``
   greedy tokens each, with the float32 cache as the reference: QAttnCache INT8 + qattn, and (the
   yardstick of an ordinary perturbation) the float32 cache with K and V rounded to bf16; the fraction
   of positions where the tokens agree, and how many tokens each run generates before the first
   difference.

The model runs in float32 on the CPU, so the reference cache is float32 (a bf16 cache rounds K and V to
8 bits of mantissa; the quantized cache's error is far larger). On a CPU without the Triton
interpreter, qattn runs the PyTorch reference of the kernels' math (the decode kernel's: K/V quantized
per token exactly as stored, attention in float32). The prefill chunk of the qattn modes runs qattn's
prefill path (INT8 Q·Kᵀ, FP8 P·V), so part 2 measures the whole qattn pipeline, part 1 mostly the cache.
Writes ``cache-accuracy-<device>-<date>.md`` (and .json) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import transformers
from hf_qattn.kv_cache.captured import cache_argument
from wikitext import DATA, DEFAULT_MODEL, windows  # eval/wikitext.py

EXACT_PREFILL = "qattn, prefill unquantized"  # a mode's attention: see use() in main
CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default="eval/results")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--greedy-modes", default="bf16,int8",
                   help="runs compared with the float32-cache run: bf16, int8, int4, int8g, int8g-exact-prefill and "
                        "int8-exact-prefill (the model's plan unquantized: an exact prefill, the decode steps over "
                        "the cache, which they read exactly: the format alone), qattn-dynamic (qattn attention "
                        "over transformers' DynamicCache: the pipeline without the quantized cache)")
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--suffix", default="", help="appended to the output file names")
    return p.parse_args(argv)


def chunked_nll(model, ids, make_cache, chunk: int) -> tuple[float, int]:
    """Summed next-token NLL of the tokens predicted by chunks 2.., feeding ``ids`` (1, L) chunk by chunk."""
    import torch

    cache = make_cache()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, chunk):
            piece = ids[:, start: start + chunk]
            logits = model(piece, **{CACHE_KW: cache}, use_cache=True).logits.float()
            target = ids[:, start + 1: start + 1 + piece.shape[1]]
            logits = logits[:, : target.shape[1]]
            if start > 0:
                loss = torch.nn.functional.cross_entropy(logits[0], target[0], reduction="sum")
                nll += float(loss)
                count += target.shape[1]
    return nll, count


def chunked_perplexity(model, texts, make_cache, chunk: int) -> tuple[float, int]:
    """(token perplexity, tokens counted) over the windows ``texts`` (1-D id tensors), each fed by ``chunked_nll``
    into a fresh ``make_cache()``."""
    nll = count = 0
    for row in texts:
        a, b = chunked_nll(model, row[None], make_cache, chunk)
        nll, count = nll + a, count + b
    return math.exp(nll / count), count


def greedy(model, prompt, make_cache, new: int):
    import torch

    with torch.no_grad():
        out = model.generate(prompt, **{CACHE_KW: make_cache()}, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers as tf

    import hf_qattn

    torch.manual_seed(0)
    tokenizer = tf.AutoTokenizer.from_pretrained(args.model)
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    test_path = os.path.join(DATA, "test.txt")
    class Bf16Cache(tf.DynamicCache):
        """A DynamicCache whose K and V are rounded to bfloat16: what a bf16 model's cache loses."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.bfloat16().float(), value_states.bfloat16().float(), layer_idx,
                                  *args, **kwargs)

    modes = {
        "DynamicCache + SDPA (float32 cache)": ("sdpa", lambda: tf.DynamicCache(config=model.config)),
        "DynamicCache + SDPA, K/V rounded to bf16": ("sdpa", lambda: Bf16Cache(config=model.config)),
        "QAttnCache INT8 K + V, qattn": ("qattn", lambda: hf_qattn.QAttnCache(model, plan="int8")),
        "QAttnCache INT4 K + INT8 V, qattn": ("qattn", lambda: hf_qattn.QAttnCache(model, plan="int4")),
        "QAttnCache 8-bit K and V per channel over 64-token groups (int8g), qattn":
            ("qattn", lambda: hf_qattn.QAttnCache(model, plan="int8", int8_layout="groups")),
        "DynamicCache + qattn (no quantized cache)": ("qattn", lambda: tf.DynamicCache(config=model.config)),
        "QAttnCache int8g, prefill unquantized by the model's plan (the cache format alone)":
            (EXACT_PREFILL, lambda: hf_qattn.QAttnCache(model, plan="int8", int8_layout="groups")),
        "QAttnCache INT8 K + V, prefill unquantized by the model's plan (the cache format alone)":
            (EXACT_PREFILL, lambda: hf_qattn.QAttnCache(model, plan="int8")),
    }
    short = {"fp32": "DynamicCache + SDPA (float32 cache)", "bf16": "DynamicCache + SDPA, K/V rounded to bf16",
             "int8": "QAttnCache INT8 K + V, qattn", "int4": "QAttnCache INT4 K + INT8 V, qattn",
             "int8g": "QAttnCache 8-bit K and V per channel over 64-token groups (int8g), qattn",
             "qattn-dynamic": "DynamicCache + qattn (no quantized cache)",
             "int8g-exact-prefill":
                 "QAttnCache int8g, prefill unquantized by the model's plan (the cache format alone)",
             "int8-exact-prefill":
                 "QAttnCache INT8 K + V, prefill unquantized by the model's plan (the cache format alone)"}
    def use(impl: str) -> None:
        """Attention ``impl`` for a mode; EXACT_PREFILL: qattn with every layer unquantized by the model's plan (a
        prefill in full precision; a QAttnCache is still read by its decode)."""
        model.config.qattn_plan = (hf_qattn.QAttnPlan(default="unquantized").to_dict() if impl == EXACT_PREFILL
                                   else None)
        model.set_attn_implementation("qattn" if impl == EXACT_PREFILL else impl)

    report = {"model": args.model, "args": vars(args), "perplexity": {}, "greedy": {}}
    texts = windows(tokenizer, test_path, args.windows, args.length)
    for name, (impl, make_cache) in modes.items():
        if args.skip_perplexity or name in (short["qattn-dynamic"], short["int8g-exact-prefill"],
                                            short["int8-exact-prefill"]):
            continue
        use(impl)
        started = time.perf_counter()
        ppl, count = chunked_perplexity(model, texts, make_cache, args.chunk)
        report["perplexity"][name] = {"ppl": ppl, "tokens": count,
                                      "seconds": time.perf_counter() - started}
        print(name, report["perplexity"][name], flush=True)
    base_ppl = report["perplexity"].get(short["fp32"], {}).get("ppl", float("nan"))

    prompts = windows(tokenizer, test_path, args.prompts, args.prompt_len)
    runs = {}
    greedy_modes = [short["fp32"]] + [short[m.strip()] for m in args.greedy_modes.split(",") if m.strip()]
    for name in greedy_modes:
        impl, make_cache = modes[name]
        use(impl)
        started = time.perf_counter()
        runs[name] = [greedy(model, p[None], make_cache, args.new) for p in prompts]
        print(name, "greedy done in", round(time.perf_counter() - started), "s", flush=True)
    ref = runs[greedy_modes[0]]
    for name in greedy_modes[1:]:
        got = runs[name]
        agree = [float((a == b).float().mean()) for a, b in zip(ref, got)]
        first = [int((a != b).nonzero()[0]) if bool((a != b).any()) else args.new for a, b in zip(ref, got)]
        report["greedy"][name] = {"agreement_mean": statistics.mean(agree),
                                  "identical": sum(f == args.new for f in first),
                                  "first_difference_median": statistics.median(first), "first_difference": first,
                                  "agreement": agree}
        print(name, report["greedy"][name], flush=True)
    report["tokens"] = {name: [t.tolist() for t in seqs] for name, seqs in runs.items()}

    date = datetime.date.today().isoformat()
    lines = [f"# Generation through the quantized KV cache — SmolLM2-135M-Instruct, CPU, {date}", "",
             f"torch {torch.__version__}, transformers {tf.__version__}, hf_qattn {hf_qattn.__version__}, "
             f"{platform.processor() or platform.machine()}; float32 model; command: "
             f"`python eval/cache_accuracy.py {' '.join(sys.argv[1:])}`", ""]
    if report["perplexity"]:
        lines += [f"## Perplexity through the cache: {args.windows} WikiText-2 test windows of {args.length} tokens, "
                  f"fed {args.chunk} tokens at a time (NLL of the tokens predicted by every chunk but the first)", "",
                  "| cache | token perplexity | vs full-precision cache | tokens | s |", "|---|---|---|---|---|"]
    for name, r in report["perplexity"].items():
        lines.append(f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] / base_ppl - 1):+.2f} % | {r['tokens']} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"## Greedy agreement with the float32-cache run: {args.prompts} prompts of {args.prompt_len} "
              f"WikiText-2 test tokens, {args.new} new tokens each", "",
              "Once one token differs the continuations part ways, so the positions that agree mostly count the "
              "tokens before the first difference; the bf16-rounded cache is the yardstick of an ordinary "
              "perturbation.", "",
              "| run | positions that agree | identical continuations | tokens before the first difference: "
              "median | per prompt |", "|---|---|---|---|---|"]
    for name, g in report["greedy"].items():
        lines.append(f"| {name} | {100 * g['agreement_mean']:.1f} % | {g['identical']} of {args.prompts} | "
                     f"{g['first_difference_median']} | {g['first_difference']} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cache-accuracy-smollm2-cpu-{date}{args.suffix}")
    with open(path + ".md", "w") as f:
        f.write(text)
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print("written:", path + ".md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
