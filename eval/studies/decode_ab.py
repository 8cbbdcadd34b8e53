"""The installed decode kernel, one configuration per row: µs a step at B8 Hq32/Hk8 d128 bf16, 16k and 64k cached tokens.

    python3 eval/studies/decode_ab.py TAG [PRECISIONS [STAGES:MAXNREG[:WARPS],...]]   e.g. base int8g,int8 0:0,2:168,3:128:8

For an A/B of kernel variants in one device call, run once per variant of ``kernels/decode.py`` with
``KERNEL_VARIANT=decode:FILE`` (eval/kernel_variant.py; Triton keys its cache by the source). ``0:0`` is the
launcher's own choice of stages and register cap (and warps, unless a third number names them). Per row: µs a
step (CUDA events, median of 7 × 20 calls), GB/s of the cache's bytes (scales included), relL1 to float32
attention over the unquantized K/V (K with per-channel offsets), relL1 to the PyTorch reference of the format
(kv_cache.reference; a wrong kernel shows here), and SDPA's µs on the bf16 cache (GQA, for the first TAG only:
``base``).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import kernel_variant  # noqa: E402

kernel_variant.use_from_env()  # before hf_qattn: KERNEL_VARIANT=decode:FILE
from bench_decode import fill_cache  # noqa: E402
from timing import events_ms  # noqa: E402

from hf_qattn.kernels import decode_launch  # noqa: E402
from hf_qattn.kv_cache import reference as kv_reference  # noqa: E402


def rel_l1(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.float() - exact.float()).abs().sum() / exact.float().abs().sum()).item()


def main(tag: str, precisions: str = "int8g", configs: str = "0:0") -> None:
    print(f"{tag}: decode kernel from {kernel_variant.loaded_from('decode')}", flush=True)
    torch.manual_seed(0)
    b, hq, hk, d = 8, 32, 8, 128
    cases = [(tuple(map(int, c.split(":"))) + (0,))[:3] for c in configs.split(",")]
    print("| variant stages:maxnreg:warps | K | L | µs | GB/s | relL1 to fp32 | relL1 to reference | SDPA µs |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (16384, 65536):
        offsets = 3 * torch.randn(1, hk, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) + offsets
        v = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        sdpa_ms = float("nan")
        if tag == "base":
            sdpa_ms = events_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                calls=20, repeats=7)
        for precision in precisions.split(","):
            buf, _, v_bar, nbytes = fill_cache(k, v, precision, "cuda")
            out = decode_launch.decode(q, buf, v_bar, n).transpose(1, 2)  # (B, Hq, 1, D)
            ref = kv_reference.decode_attention(q, buf, v_bar, n)
            ref = ref if ref.shape == out.shape else ref.transpose(1, 2)
            for stages, maxnreg, warps in cases:
                options = {} if stages == 0 else dict(num_stages=stages, maxnreg=maxnreg)
                if warps:
                    options["num_warps"] = warps
                ms = events_ms(lambda: decode_launch.decode(q, buf, v_bar, n, **options), calls=20, repeats=7)
                print(f"| {tag} {stages}:{maxnreg}:{warps} | {precision} | {n} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | "
                      f"{rel_l1(out, exact):.5f} | {rel_l1(out, ref):.6f} | {sdpa_ms * 1e3:.1f} |", flush=True)
            del buf


if __name__ == "__main__":
    main(*sys.argv[1:])
