"""Study (CPU): does equalizing K's channels fix the INT4 cache's perplexity? (issue 23, item 3)

    python eval/studies/cache_k_equalize.py int4:0 int4:0.5 int4:1 int8:0 int8:0.5 [--chunk 16]

The quantized cache stores K − k̄ per token (one scale a token: INT4's 15 levels are set by the token's
largest channel). SmoothQuant-style equalization divides channel c by σ_c = (max_t |K_c − k̄_c|)^α over the
first fill (normalized to max 1) before the per-token quantization and multiplies q by σ, which leaves q·k
unchanged: channels of small range get more of the levels. Each ``precision:alpha`` runs eval/cache_accuracy.py's
perplexity (8 WikiText-2 test windows of 512 tokens fed ``--chunk`` tokens at a time, SmolLM2, float32) with
the cache's reference math patched (the CPU path: the kernels are not touched); alpha 0 is the shipped cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import cache_accuracy  # noqa: E402
from wikitext import DATA, DEFAULT_MODEL, windows  # noqa: E402

import hf_qattn  # noqa: E402
from hf_qattn.kv_cache import reference  # noqa: E402

ALPHA = {"value": 0.0}
_centers, _quantize, _decode = reference.centers, reference.quantize_tokens, reference.decode_attention


def centers(k, v, sample=256):
    """The shipped centers, with σ (the equalizer) attached to k̄ as an attribute for the calls below."""
    k_bar, v_bar = _centers(k, v, sample)
    if ALPHA["value"]:
        gain = (k.float() - k_bar[:, :, None]).abs().amax(2).clamp_min(1e-6) ** ALPHA["value"]
        k_bar.k_gain = gain / gain.amax(-1, keepdim=True)
    return k_bar, v_bar


def quantize_tokens(k, v, k_bar, v_bar, precision):
    gain = getattr(k_bar, "k_gain", None)
    if gain is not None:  # stored: (K − k̄) / σ, per token
        k = k_bar[:, :, None] + (k.float() - k_bar[:, :, None]) / gain[:, :, None]
    return _quantize(k, v, k_bar, v_bar, precision)


def decode_attention(q, *args, k_bar=None, **kwargs):
    gain = getattr(k_bar, "k_gain", None)
    if gain is not None:  # q·σ against the stored (K − k̄) / σ
        q = (q.float() * gain.repeat_interleave(q.shape[1] // gain.shape[1], 1)[:, :, None]).to(q.dtype)
    return _decode(q, *args, k_bar=k_bar, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="precision:alpha, e.g. int4:0.5")
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    reference.centers, reference.quantize_tokens, reference.decode_attention = centers, quantize_tokens, decode_attention
    torch.manual_seed(0)
    tokenizer = tf.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = tf.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    texts = windows(tokenizer, os.path.join(DATA, "test.txt"), args.windows, 512)

    def perplexity(impl, make_cache):
        model.set_attn_implementation(impl)
        return cache_accuracy.chunked_perplexity(model, texts, make_cache, args.chunk)[0]

    base = perplexity("sdpa", lambda: tf.DynamicCache(config=model.config))
    print(f"| cache | alpha | perplexity | vs float32 cache ({base:.4f}) |\n|---|---|---|---|")
    for run in args.runs:
        precision, alpha = run.split(":")
        ALPHA["value"] = float(alpha)
        ppl = perplexity("qattn", lambda: hf_qattn.QAttnCache(model, plan=precision))
        print(f"| {precision} | {alpha} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)


if __name__ == "__main__":
    main()
