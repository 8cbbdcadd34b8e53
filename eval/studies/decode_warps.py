"""The decode kernel's launch by warps, stages, tile and split count: µs a step and GB/s of the cache read.

    OPTS='{};{"num_warps": 1, "num_stages": 3, "maxnreg": 255, "num_splits": 8}' B=8 D=128 LENS=16384,65536 \\
        python3 eval/studies/decode_warps.py TAG [PRECISION]

One line per (length, options): the installed decode kernel over a cache of PRECISION (default int8), Hq32/Hk8,
batch B, head dim D, NQ query tokens (default 1; several: a speculative step's, causal among themselves); ``OPTS``: ``decode_launch.decode`` keywords, ';'-separated (``{}`` is the
default launch); CUDA events, median of 7 × 20 calls; ``err``: the largest difference to the default launch's
output (split counts move the merge's rounding only). TAG ``base`` also times SDPA on the bf16 cache. For an A/B of
kernel variants, run once per variant with ``KERNEL_VARIANT=decode:FILE`` (eval/kernel_variant.py).

    VARIANTS='one={"num_warps": 1}@34304,68096;two={"num_warps": 2}@35328,69120' ROUNDS=2 B=8 D=64 LENS=65536 \
        python3 eval/studies/decode_warps.py TAG int4

``VARIANTS``: launches of PRECISION to A/B in one process, in turns for ROUNDS rounds: each overrides kernels.json's
launch of the format in memory (its keys, as ``decode.default.launch``) and its 16-bit ``SHARED`` bytes of a step's
8-row tile at d64 / d128 (from ``eval/inspect_kernel.py --decode``), so that the split plan counts that launch's
programs, as the shipped launch's; the lines are tagged TAG/name and print the plan's split count.
Results: eval/results/decode-warps-NVIDIA-H200-2026-11-28.md.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import kernel_variant  # noqa: E402

kernel_variant.use_from_env()  # before hf_qattn: KERNEL_VARIANT=decode:FILE
from bench_decode import fill_cache  # noqa: E402
from timing import events_ms  # noqa: E402

from hf_qattn.kernels import decode_launch  # noqa: E402


def main(tag: str, precision: str = "int8") -> None:
    print(f"{tag}: decode kernel from {kernel_variant.loaded_from('decode')}", flush=True)
    b, hq, hk, d = int(os.environ.get("B", 8)), 32, 8, int(os.environ.get("D", 128))
    nq = int(os.environ.get("NQ", 1))
    all_opts = [json.loads(o) for o in os.environ.get("OPTS", "{}").split(";")]
    torch.manual_seed(0)
    for n in map(int, os.environ.get("LENS", "16384,65536").split(",")):
        k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
        buf, _, v_bar, nbytes = fill_cache(k, v, precision, "cuda")
        default = decode_launch.decode(q, buf, v_bar, n)
        for opts in all_opts:
            err = (decode_launch.decode(q, buf, v_bar, n, **opts).float() - default.float()).abs().max().item()
            ms = events_ms(lambda: decode_launch.decode(q, buf, v_bar, n, **opts), calls=20, repeats=7)
            sdpa = ""
            if tag == "base":
                sd = events_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               calls=20, repeats=7)
                sdpa = f" SDPA {sd * 1e3:.1f} µs"
            print(f"| {tag} B{b} d{d}{f' nq{nq}' if nq > 1 else ''} {opts} | {precision} | {n} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | "
                  f"{err:.1e} |{sdpa}", flush=True)
        del k, v, buf
        torch.cuda.empty_cache()


def variants(tag: str, precision: str = "int8") -> None:
    """``main`` once per VARIANTS entry, in turns (see the module docstring)."""
    import copy

    from hf_qattn.kernels import tuning

    config = tuning.decode_config(False)
    shipped = copy.deepcopy(config["launch"][precision])
    for _ in range(int(os.environ.get("ROUNDS", 1))):
        for spec in os.environ["VARIANTS"].split(";"):
            name, rest = spec.split("=", 1)
            launch, shared = rest.rsplit("@", 1)
            config["launch"][precision] = {**shipped, **json.loads(launch)}
            listed = config["SHARED"]["16-bit"][precision]
            config["SHARED"]["16-bit"][precision] = {dim: {**listed[dim], "8": int(step)}  # a step's 8-row tile
                                                     for dim, step in zip(("64", "128"), shared.split(","))}
            decode_launch._default_launch.cache_clear()
            decode_launch.default_shared_bytes.cache_clear()
            b, d = int(os.environ.get("B", 8)), int(os.environ.get("D", 128))
            for n in map(int, os.environ.get("LENS", "16384,65536").split(",")):
                _, plan = decode_launch.plan_decode(precision, (b, 32, 1, d), 8, n, torch.device("cuda"))
                print(f"{tag}/{name} {n}: {plan['num_splits']} splits", flush=True)
            main(f"{tag}/{name}", precision)


if __name__ == "__main__":
    (variants if os.environ.get("VARIANTS") else main)(*sys.argv[1:])
