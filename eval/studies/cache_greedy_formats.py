"""Study (CPU): what makes greedy continuations through the quantized cache part from the float32 cache's? (issue 23,
item 4)

    python eval/studies/cache_greedy_formats.py none:none bf16:bf16 tok8:fp8 tok8:none g8-64:fp8 g8-64:none
    python eval/studies/cache_greedy_formats.py --perplexity tok8:fp8 tok8eq:tok8eq

Each argument is ``K_FORMAT:V_FORMAT``. Fake quantization, not the cache's code: a transformers attention function
rounds the whole cached K and V (around centers fixed at the first fill, as the cache fixes them) by the named
formats before SDPA — on decode calls only, so the prefill is exact and only the cache's formats differ from the
float32 run. Greedy agreement as eval/cache_accuracy.py measures it (SmolLM2, 20 WikiText-2 test prompts of 64
tokens, 256 greedy tokens each, against the float32-cache run). Formats:

- ``none``: unrounded; ``bf16``: rounded to bfloat16 (the yardstick of an ordinary perturbation);
- K ``tok8``: INT8 per token (±127 of the token's largest |K − k̄|): the shipped INT8 cache's K;
- K ``tok4``: INT4 per token (±7);
- K ``g8-G`` / ``g4-G``: 8-bit / 4-bit per channel over groups of G tokens (256 / 16 levels between the group's min
  and max; the newest incomplete group unrounded), ``g4-64`` the INT4 cache's K layout;
- K ``blk8-G``: INT8 over blocks of G tokens, one scale a block (a decode tile's K scale a scalar; the newest
  incomplete block unrounded);
- V ``fp8``: FP8 E4M3 per token (the shipped V); ``tok8``: INT8 per token;
- ``tok8eq``, ``fp8eq`` (K or V): channel c divided by σ_c, its largest |x_c| over the first fill, before the per-token
  rounding, and multiplied back after (the decode kernel could fold σ into q once, and into the output once:
  no work a tile); ``tok8sq``: the same with √σ_c; ``tok8eqR`` (e.g. ``tok8eq16``): σ_c at least 1/R of the head's
  largest σ;
- either, with ``+rG`` (e.g. ``tok8+r64``): the newest tokens from the last whole group of G on unrounded.

A row of the fake ``tok8:fp8`` reproduces the shipped INT8 cache's 5 of 20 (eval/results/cache-accuracy-*).

``--perplexity``: instead, perplexity as eval/cache_accuracy.py measures it (8 WikiText-2 test windows of 512 tokens
fed 16 at a time; the first chunk of each window is the first fill, exact, and fixes its centers and σ).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

import torch
import transformers as tf
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import cache_accuracy  # noqa: E402
from wikitext import DATA, DEFAULT_MODEL, windows  # noqa: E402

STATE = {"k": "none", "v": "none", "centers": {}}


def _per_token(x, levels):
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / levels
    return torch.round(x / scale).clamp(-levels, levels) * scale


def _per_channel_groups(x, group, levels):
    """Per channel over each whole group of ``group`` tokens, ``levels`` + 1 values from its min to its max."""
    b, h, n, d = x.shape
    whole = n // group * group
    out = x.clone()
    if whole:
        g = x[:, :, :whole].reshape(b, h, whole // group, group, d)
        low, high = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
        scale = (high - low).clamp_min(1e-8) / levels
        out[:, :, :whole] = (torch.round((g - low) / scale).clamp(0, levels) * scale + low).reshape(b, h, whole, d)
    return out


def _per_block(x, group, levels):
    """Symmetric over each whole block of ``group`` tokens: one scale a block (its largest |x| over tokens and
    channels); the newest incomplete block unrounded."""
    b, h, n, d = x.shape
    whole = n // group * group
    out = x.clone()
    if whole:
        g = x[:, :, :whole].reshape(b, h, whole // group, group * d)
        scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-8) / levels
        out[:, :, :whole] = (torch.round(g / scale).clamp(-levels, levels) * scale).reshape(b, h, whole, d)
    return out


def _fp8_per_token(x):
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 448
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


# the formats by name (K: none, bf16, tok8, tok4, g8-G, g4-G, blk8-G; V: none, bf16, fp8, tok8), on K − k̄ or V − v̄
ROUNDINGS = {"none": lambda x: x, "bf16": lambda x: x.bfloat16().float(), "tok8": lambda x: _per_token(x, 127),
             "tok4": lambda x: _per_token(x, 7), "fp8": _fp8_per_token}


def rounded(x, fmt, sigma=None):
    """``x`` (B, H, N, D) as the format ``fmt`` would store it; ``FORMAT+rG``: the newest tokens from the last whole
    group of G on (fewer than G) kept unrounded, as a cache that holds its open group in full precision. ``sigma``
    (B, H, 1, D): each channel's largest |x| over the first fill, for the equalized formats."""
    if "+r" in fmt:
        fmt, group = fmt.split("+r")
        whole = x.shape[2] // int(group) * int(group)
        return torch.cat([rounded(x[:, :, :whole], fmt, sigma), x[:, :, whole:]], dim=2)
    floor = re.fullmatch(r"(.+eq)(\d+)", fmt)
    if floor:  # ``eqR``: σ kept at or above 1/R of the head's largest (the cache's formats.KV_EQ_FLOOR)
        s = torch.maximum(sigma, sigma.amax(-1, keepdim=True) / int(floor.group(2))).clamp_min(1e-6)
        return rounded(x / s, floor.group(1)[:-2]) * s
    for suffix, power in (("eq", 1.0), ("sq", 0.5)):
        if fmt.endswith(suffix):
            s = sigma.clamp_min(1e-6) ** power
            return rounded(x / s, fmt[: -len(suffix)]) * s
    if fmt.startswith("blk8-"):
        return _per_block(x, int(fmt[5:]), 127)
    if fmt.startswith(("g8-", "g4-")):
        return _per_channel_groups(x, int(fmt[3:]), 255 if fmt.startswith("g8-") else 15)
    if fmt not in ROUNDINGS:
        raise ValueError(f"format {fmt!r}: one of {sorted(ROUNDINGS)} or g8-<group> / g4-<group> / blk8-<group>")
    return ROUNDINGS[fmt](x)


def attention(module, query, key, value, attention_mask, **kwargs):
    layer = module.layer_idx
    if layer not in STATE["centers"]:  # the first fill (the prefill): exact, and it fixes the centers (and σ)
        k_bar, v_bar = key.mean(2, keepdim=True), value.mean(2, keepdim=True)
        STATE["centers"][layer] = (k_bar, v_bar, (key - k_bar).abs().amax(2, keepdim=True),
                                   (value - v_bar).abs().amax(2, keepdim=True))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    k_bar, v_bar, k_sigma, v_sigma = STATE["centers"][layer]
    key = rounded(key - k_bar, STATE["k"], k_sigma) + k_bar
    value = rounded(value - v_bar, STATE["v"], v_sigma) + v_bar
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def main():
    tf.AttentionInterface.register("fake_quant_cache", attention)
    AttentionMaskInterface.register("fake_quant_cache", sdpa_mask)
    tokenizer = tf.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = tf.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    prompts = windows(tokenizer, os.path.join(DATA, "test.txt"), 20, 64)

    def run(impl):
        model.set_attn_implementation(impl)
        outs = []
        for prompt in prompts:
            STATE["centers"] = {}
            outs.append(cache_accuracy.greedy(model, prompt[None], lambda: tf.DynamicCache(config=model.config), 256))
        return outs

    specs = [a for a in sys.argv[1:] if a != "--perplexity"]
    if "--perplexity" in sys.argv[1:]:
        texts = windows(tokenizer, os.path.join(DATA, "test.txt"), 8, 512)

        def perplexity(impl):
            model.set_attn_implementation(impl)

            def fresh_cache():  # a window's first fill fixes its centers anew
                STATE["centers"] = {}
                return tf.DynamicCache(config=model.config)

            return cache_accuracy.chunked_perplexity(model, texts, fresh_cache, 16)[0]

        base = perplexity("sdpa")
        print(f"| K:V | perplexity | vs float32 cache ({base:.4f}) |\n|---|---|---|", flush=True)
        for spec in specs:
            STATE["k"], STATE["v"] = spec.split(":")
            ppl = perplexity("fake_quant_cache")
            print(f"| {spec} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)
        return
    reference = run("sdpa")
    print("| K:V | identical continuations | tokens before the first difference: median | per prompt |\n"
          "|---|---|---|---|", flush=True)
    for spec in specs:
        STATE["k"], STATE["v"] = spec.split(":")
        started = time.perf_counter()
        got = run("fake_quant_cache")
        first = [int((a != b).nonzero()[0]) if bool((a != b).any()) else 256 for a, b in zip(reference, got)]
        print(f"| {spec} | {sum(f == 256 for f in first)} of 20 | {statistics.median(first)} | {first} |"
              f" <!-- {time.perf_counter() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
