"""Device check: shards of the keys merged by qattn's LSE equal one call (what ring attention relies on).

    bash eval/device_run.sh python3 eval/check_lse_merge.py --out eval/results/      # one H100 (Hopper path)
    python eval/check_lse_merge.py --cpu-smoke                                       # CI-sized, on the CPU

For each shape, ``qattn(q, k, v, return_lse=True)`` over all keys is compared with the same call over each of
``--shards`` equal key shards, merged by their natural-log LSE the way diffusers' ring attention merges them
(out = Σ_i exp(lse_i − lse) · out_i, lse = logsumexp_i lse_i). The shards' keys have different means, so
each shard's kernel subtracts a different smoothing centre k̄: the merge is right only if every shard's LSE
carries its own sm_scale·q·k̄ term. Both results are scored against float32 exact attention on a sample of
query rows (all heads). PASS when the merge is as close to exact as one call (relative L2 error at most
1.25× one call's + 0.002), its LSE within 0.1 of the exact one, and every call ran on the expected path
(``hopper`` on sm90, else what ``support`` picks) with no fallback.

Shapes: Wan-like B1 H40 d128 up to 75,600 tokens (Wan 2.1 14B, 720p, 81 frames), Flux-like B1 H24 d128 at
4,608 and 16,896 tokens (1024² and 2048² images with 512 text tokens). ``--cpu-smoke``: small shapes on the
reference path (and the Triton interpreter's when TRITON_INTERPRET=1), no GPU needed.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch

import hf_qattn
from hf_qattn import support
from hf_qattn.kernels import tuning
from hf_qattn.reference import exact_attention

from report import finish, versions  # eval/report.py

GPU_SHAPES = [  # (name, heads, tokens)
    ("wan", 40, 4096), ("wan", 40, 16384), ("wan", 40, 32760), ("wan", 40, 75600),
    ("flux", 24, 4608), ("flux", 24, 16896),
]
CPU_SHAPES = [("wan", 4, 256), ("flux", 3, 200)]
HEAD_DIM = 128


def merge(parts):
    """[(out, lse)] over disjoint key sets → (out, lse) of the attention over all of them, in float32."""
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = sum(torch.exp(part_lse - lse)[..., None] * out.float() for out, part_lse in parts)
    return out, lse


def inputs(heads: int, tokens: int, shards: int, device, dtype, generator):
    """q, k, v (B1, heads, tokens, 128) with a different key mean in every shard, plus a common query mean."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)

    q, k, v = randn(1, heads, tokens, HEAD_DIM), randn(1, heads, tokens, HEAD_DIM), randn(1, heads, tokens, HEAD_DIM)
    direction = randn(1, heads, 1, HEAD_DIM)
    for index, part in enumerate(torch.arange(tokens, device=device).chunk(shards)):
        k[:, :, part] += (2.0 * (index + 1) / shards - 1.0) * 2 * direction  # −…+: a different k̄ per shard
    q += 0.5 * direction
    return q.to(dtype), k.to(dtype), v.to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name: str, heads: int, tokens: int, *, shards: int, device, dtype, backend: str, sample: int,
          qk: str, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = inputs(heads, tokens, shards, device, dtype, generator)
    hf_qattn.reset_fallback_stats()
    one, one_lse = hf_qattn.qattn(q, k, v, qk=qk, return_lse=True, backend=backend)
    parts = [hf_qattn.qattn(q, k[:, :, part], v[:, :, part], qk=qk, return_lse=True, backend=backend)
             for part in torch.arange(tokens, device=device).chunk(shards)]
    counts = hf_qattn.fallback_stats()
    merged, merged_lse = merge(parts)
    del parts
    rows = torch.randperm(tokens, generator=generator, device=device)[:sample].sort().values
    exact, exact_lse = exact_attention(q[:, :, rows], k, v, return_lse=True, dtype=torch.float32)
    one_err, merged_err = rel(one[:, :, rows], exact), rel(merged[:, :, rows], exact)
    lse_err = (merged_lse[:, :, rows] - exact_lse).abs().max().item()
    one_lse_err = (one_lse[:, :, rows] - exact_lse).abs().max().item()
    paths = sorted(counts["calls"])
    expected = support.HOPPER if (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9) else None
    path_ok = not counts["fallbacks"] and sum(counts["calls"].values()) == shards + 1 and (
        expected is None or paths == [expected])
    ok = (merged_err <= 1.25 * one_err + 0.002 and lse_err < 0.1 and path_ok
          and all(math.isfinite(x) for x in (one_err, merged_err, lse_err)))
    detail = (f"{qk}, {shards} shards, path {'/'.join(paths) or '-'}{' FALLBACK ' + str(counts['fallbacks']) if counts['fallbacks'] else ''}: "
              f"rel L2 to exact one call {one_err:.4f}, merged {merged_err:.4f}, merged vs one {rel(merged, one):.4f}; "
              f"max |lse − exact| one {one_lse_err:.4f}, merged {lse_err:.4f}")
    print(f"{name} H{heads} N{tokens}: {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
    return (f"{name}-like B1 H{heads} d{HEAD_DIM} N={tokens}", ok, detail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="small shapes on the CPU (reference path)")
    parser.add_argument("--shards", type=int, default=2, help="key shards merged by LSE (the ring degree)")
    parser.add_argument("--max-tokens", type=int, default=None, help="skip longer shapes")
    parser.add_argument("--sample", type=int, default=512, help="query rows scored against exact attention")
    parser.add_argument("--qk", default="int8", choices=["int8", "int4"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the markdown result")
    args = parser.parse_args(argv)
    if args.shards < 2:
        parser.error("--shards must be at least 2")
    if args.cpu_smoke:
        device, dtype, shapes = torch.device("cpu"), torch.float32, CPU_SHAPES
        backends = ["reference"] + (["triton"] if tuning.interpreting() else [])
    else:
        if not torch.cuda.is_available():
            parser.error("no GPU: use --cpu-smoke")
        device, dtype, shapes, backends = torch.device("cuda"), torch.bfloat16, GPU_SHAPES, ["auto"]
    rows = []
    for backend in backends:
        for name, heads, tokens in shapes:
            if args.max_tokens and tokens > args.max_tokens:
                continue
            label, ok, detail = check(name, heads, tokens, shards=args.shards, device=device, dtype=dtype,
                                      backend=backend, sample=min(args.sample, tokens), qk=args.qk, seed=args.seed)
            rows.append((f"{label} ({backend})" if len(backends) > 1 else label, ok, detail))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return finish("LSE merge of key shards vs one call", versions(), rows, args.out, "lse-merge")


if __name__ == "__main__":
    sys.exit(main())
