"""Study (CPU, issue 23): does the quantized cache's FP8 V make its greedy continuations diverge?

    python eval/studies/cache_v_format.py VARIANT      # VARIANT: base | vint8 | vexact

Runs eval/cache_accuracy.py's greedy agreement (SmolLM2-135M-Instruct, 20 WikiText-2 prompts × 256 greedy tokens
against the float32-cache run) with the cache's V stored three ways, K as shipped (INT8 per token):
``base`` FP8 E4M3 per token (shipped), ``vint8`` INT8 per token (max |V − v̄| / 127: the same bytes), ``vexact``
V − v̄ unrounded. The cache's storage dtype for V is swapped for float32 in this process only (its
``torch.float8_e4m3fn`` name), so the CPU path reads the values as they are written. Writes
cache-accuracy-smollm2-cpu-<date><variant>.md under eval/results/.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/
from hf_qattn.kv_cache import cache, reference  # noqa: E402
from hf_qattn.quant import SCALE_FLOOR, reciprocal  # noqa: E402


class _Float32ForFp8:
    """torch, but its float8_e4m3fn is float32: the cache module allocates V in it."""

    def __getattr__(self, name):
        return torch.float32 if name == "float8_e4m3fn" else getattr(torch, name)


def main() -> None:
    variant = sys.argv[1]
    if variant not in ("base", "vint8", "vexact"):
        raise SystemExit(f"VARIANT must be base, vint8 or vexact; got {variant!r}")
    if variant != "base":
        shipped = reference.quantize_tokens
        cache.torch = _Float32ForFp8()

        def quantize_tokens(k, v, k_bar, v_bar, precision):
            kq, ks, _, _ = shipped(k, v, k_bar, v_bar, precision)
            vc = v.float() - v_bar[:, :, None, :]
            if variant == "vint8":
                vs = vc.abs().amax(-1).clamp_min(SCALE_FLOOR) / 127
                return kq, ks, torch.round(vc * reciprocal(vs)[..., None]).clamp_(-127, 127), vs
            return kq, ks, vc, torch.ones(vc.shape[:-1])

        reference.quantize_tokens = quantize_tokens
    import cache_accuracy

    cache_accuracy.main(["--skip-perplexity", "--greedy-modes", "int8", "--suffix", f"-v-{variant}", *sys.argv[2:]])


if __name__ == "__main__":
    main()
