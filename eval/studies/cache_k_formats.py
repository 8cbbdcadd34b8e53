"""Study (CPU): which K format would make a 4-bit KV cache usable? (issue 23, item 3)

    python eval/studies/cache_k_formats.py token4 kivi32 kivi128 token4+r64 kivi32+r64 token8

Fake quantization, not the cache's code: a transformers attention function quantizes the whole cached K and V
(transformers' DynamicCache, float32) by the named format before SDPA, on every call, so a format is judged by
the perplexity it gives before anything is built. Perplexity as eval/cache_accuracy.py measures it (SmolLM2,
8 WikiText-2 test windows of 512 tokens fed 16 at a time). V is FP8 E4M3 per token around v̄ in every format,
as the shipped cache stores it; k̄ and v̄ are fixed at the first fill, as the cache fixes them. K formats:

- ``token4`` / ``token8``: K − k̄ per token, symmetric INT4 (±7) / INT8 (±127): the shipped cache's formats.
- ``kivi<G>``: KIVI's K — per channel over groups of G tokens, asymmetric 4-bit (min/max, 16 levels); tokens
  past the last whole group stay in full precision (KIVI's residual; at most G − 1 of them).
- ``kivisym<G>``: the same groups, symmetric INT4 (±7) around k̄ (one scale per channel and group, no zero point).
- ``+r<R>``: besides, the newest R tokens stay in full precision.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers as tf
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import cache_accuracy  # noqa: E402
from wikitext import DATA, DEFAULT_MODEL, windows  # noqa: E402

STATE = {"format": "token4", "centers": {}}


def _token_int(x, levels):
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / levels
    return torch.round(x / scale).clamp(-levels, levels) * scale


def _group_channel_asym(x, group):
    """Per channel over groups of ``group`` tokens, 16 levels between the group's min and max (KIVI)."""
    b, h, n, d = x.shape
    g = x.reshape(b, h, n // group, group, d)
    lo, hi = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
    scale = (hi - lo).clamp_min(1e-8) / 15
    return (torch.round((g - lo) / scale).clamp(0, 15) * scale + lo).reshape(b, h, n, d)


def _group_channel_sym(x, group):
    """Per channel over groups of ``group`` tokens, symmetric ±7 around 0 (x is K − k̄)."""
    b, h, n, d = x.shape
    g = x.reshape(b, h, n // group, group, d)
    scale = g.abs().amax(3, keepdim=True).clamp_min(1e-8) / 7
    return (torch.round(g / scale).clamp(-7, 7) * scale).reshape(b, h, n, d)


def fake_k(kc, fmt):
    """K − k̄ (B, H, N, D) as the format would store it."""
    base, _, recent = fmt.partition("+r")
    keep = int(recent) if recent else 0
    n = kc.shape[2]
    out = kc.clone()
    if base.startswith("kivi"):
        symmetric = base.startswith("kivisym")
        group = int(base[7 if symmetric else 4:])
        whole = (n // group) * group
        if whole:
            out[:, :, :whole] = (_group_channel_sym if symmetric else _group_channel_asym)(kc[:, :, :whole], group)
    else:
        out = _token_int(kc, 7 if base == "token4" else 127)
    if keep:
        out[:, :, max(n - keep, 0):] = kc[:, :, max(n - keep, 0):]
    return out


def fake_v(vc):
    scale = vc.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 448
    return (vc / scale).to(torch.float8_e4m3fn).float() * scale


def attention(module, query, key, value, attention_mask, **kwargs):
    layer = module.layer_idx
    if layer not in STATE["centers"]:  # the first fill fixes the centers
        STATE["centers"][layer] = (key.mean(2, keepdim=True), value.mean(2, keepdim=True))
    k_bar, v_bar = STATE["centers"][layer]
    key = fake_k(key - k_bar, STATE["format"]) + k_bar
    value = fake_v(value - v_bar) + v_bar
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def main():
    tf.AttentionInterface.register("fake_quant_cache", attention)
    AttentionMaskInterface.register("fake_quant_cache", sdpa_mask)  # SDPA's masks (a chunk over a cache is not top-left)
    tokenizer = tf.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = tf.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    texts = windows(tokenizer, os.path.join(DATA, "test.txt"), 8, 512)

    def fresh_cache():  # a window's first fill fixes its centers anew
        STATE["centers"] = {}
        return tf.DynamicCache(config=model.config)

    def perplexity(impl):
        model.set_attn_implementation(impl)
        return cache_accuracy.chunked_perplexity(model, texts, fresh_cache, 16)[0]

    base = perplexity("sdpa")
    print(f"| K format (V: FP8 per token) | perplexity | vs float32 cache ({base:.4f}) |\n|---|---|---|", flush=True)
    for fmt in sys.argv[1:]:
        STATE["format"] = fmt
        ppl = perplexity("fake_quant_cache")
        print(f"| {fmt} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)


if __name__ == "__main__":
    main()
