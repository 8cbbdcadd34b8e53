"""Study: the prepasses of a Hopper call (centers launch, K/V pass) by their launch shape, and whole calls A/B (GPU).

    bash eval/device_run.sh python3 eval/studies/prepass_sweep.py centers      # centers launch shapes
    python3 eval/studies/prepass_sweep.py pass-warps                            # the K/V pass alone by warps
    python3 eval/studies/prepass_sweep.py calls LABEL [KEY=VALUE ...]           # whole calls of this tree

``centers``: ``launch.smoothing_centers`` with V's range (as the Hopper path calls it) for each candidate of
kernels.json's ``centers`` keys (MEAN_ROWS, RANGE_ROWS, CHUNK_ROWS, num_warps), the shape before the keys existed
first (range programs of one attention key tile: 128 keys, 64 at d256); the best three per shape last.
``pass-warps``: ``launch.quantize_kv`` with the centers launch taken out (its result cached), 4 / 8 / 16 warps.
``calls``: GPU time of whole ``hf_qattn.qattn`` calls (windows, sinks, soft-cap, full and causal, d64–d256), with
hopper settings KEY=VALUE over kernels.json; run it alternately from two installs (PYTHONPATH) for an A/B; it
saves a slice of each output to $OUT/outs_LABEL.pt so the two trees' results can be compared bit for bit.
All times: ``timing.bench_graph_ms`` (a CUDA graph's replay: GPU time alone), µs or ms as labelled.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

import hf_qattn
from hf_qattn.kernels import launch, tuning

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import bench_graph_ms  # noqa: E402
from hopper_switch_ab import use  # noqa: E402  (eval/studies/: the tuned hopper settings with overrides)

PREPASS_SHAPES = [  # label, B, Hq, Hk, N, d
    ("8k H32 d256", 1, 32, 32, 8192, 256), ("8k H32 d128", 1, 32, 32, 8192, 128),
    ("1k B4 H32 d128", 4, 32, 32, 1024, 128), ("16k B4 H32 d128", 4, 32, 32, 16384, 128),
    ("8k 64/8 d64", 1, 64, 8, 8192, 64), ("4k B4 H32 d64", 4, 32, 32, 4096, 64),
    ("75k H40 d128", 1, 40, 40, 75600, 128),
]
CALLS = [  # label, B, Hq, Hk, N, d, causal, qattn keywords
    ("window 1024 8k H32 d128", 1, 32, 32, 8192, 128, True, dict(window=1024)),
    ("window 1024 8k H32 d256", 1, 32, 32, 8192, 256, True, dict(window=1024)),
    ("gpt-oss sinks+window 128 8k 64/8 d64", 1, 64, 8, 8192, 64, True, dict(window=128, sinks=True)),
    ("Gemma2 softcap 50 + window 4096 8k 16/8 d256", 1, 16, 8, 8192, 256, True, dict(window=4096, softcap=50.0)),
    ("full 1k B4 H32 d128", 4, 32, 32, 1024, 128, False, {}),
    ("full 2k B4 H32 d128", 4, 32, 32, 2048, 128, False, {}),
    ("full 16k B4 H32 d128", 4, 32, 32, 16384, 128, False, {}),
    ("causal 4k B4 H32 d128", 4, 32, 32, 4096, 128, True, {}),
    ("full 4k B4 H32 d64", 4, 32, 32, 4096, 64, False, {}),
    ("causal 4k B4 H32 d256", 4, 32, 32, 4096, 256, True, {}),
    ("Wan-like 75.6k H40 d128", 1, 40, 40, 75600, 128, False, {}),
]


def qkv(b, hq, hk, n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v + 0.3


def centers_sweep():
    best = []
    print("| shape | mean rows | range rows | chunk rows | warps | µs | V TB/s |\n|---|---|---|---|---|---|---|")
    for label, b, hq, hk, n, d in PREPASS_SHAPES:
        q, k, v = qkv(b, hq, hk, n, d)
        v_range = torch.full((b * hk, 2, tuning.padded_head_dim(d)), float("-inf"), device="cuda")
        key_tile = tuning.hopper_config(d)["BLOCK_N"]
        candidates = [(64, key_tile, key_tile, 4)]  # the shape before the keys existed
        for rows, chunk, warps in itertools.product((128, 256, 512, 1024), (8192 // d, 16384 // d), (4, 8)):
            candidates += [(mean, rows, chunk, warps) for mean in sorted({64, chunk}) if chunk <= rows]
        results = []
        for mean, rows, chunk, warps in candidates:
            us = bench_graph_ms(lambda: launch.smoothing_centers(
                q, k, v, True, True, True, v_range=v_range, MEAN_ROWS=mean, RANGE_ROWS=rows, CHUNK_ROWS=chunk,
                num_warps=warps), rep=40) * 1000
            results.append((us, mean, rows, chunk, warps))
            print(f"| {label} | {mean} | {rows} | {chunk} | {warps} | {us:.1f} | {v.numel() * 2 / us / 1e6:.2f} |",
                  flush=True)
        best.append((label, results[0], sorted(results)[:3]))
        del q, k, v
        torch.cuda.empty_cache()
    print("\n| shape | before (µs) | best 3 (µs mean/range/chunk/warps) |\n|---|---|---|")
    for label, before, top in best:
        best_three = "; ".join(f"{us:.1f} {m}/{r}/{c}/{w}" for us, m, r, c, w in top)
        print(f"| {label} | {before[0]:.1f} | {best_three} |")


def pass_warps():
    print("| shape | warps | K/V pass µs (centers excluded) | TB/s |\n|---|---|---|---|")
    centers = launch.smoothing_centers
    for label, b, hq, hk, n, d in PREPASS_SHAPES:
        q, k, v = qkv(b, hq, hk, n, d)
        config = tuning.hopper_config(d)
        keywords = dict(sm_scale=d ** -0.5, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True, smooth_v=True,
                        kv_start=None, kv_end=None, block_n=config["BLOCK_N"], k_token_scale=False,
                        v_channel_scale=True, permute_v=True, v_dither=True)
        cached = centers(q, k, v, True, True, True,
                         v_range=torch.full((b * hk, 2, tuning.padded_head_dim(d)), float("-inf"), device="cuda"))
        launch.smoothing_centers = lambda *args, **kwargs: cached
        try:
            for warps in (4, 8, 16):
                us = bench_graph_ms(lambda: launch.quantize_kv(q, k, v, num_warps=warps, **keywords), rep=50) * 1000
                moved = 3 * k.numel() * 2 + b * hq * n * 4  # K, V read (bf16); K̂, V̂ written (1 B); ΔS
                print(f"| {label} | {warps} | {us:.1f} | {moved / us / 1e6:.2f} |", flush=True)
        finally:
            launch.smoothing_centers = centers
        del q, k, v
        torch.cuda.empty_cache()


def calls(label, overrides):
    if overrides:
        use(overrides)
    outputs = {}
    for name, b, hq, hk, n, d, causal, keywords in CALLS:
        q, k, v = qkv(b, hq, hk, n, d, seed=n * 7 + d + hq)
        if keywords.get("sinks"):
            sinks = torch.randn(hq, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
            keywords = {**keywords, "sinks": sinks}
        call = lambda: hf_qattn.qattn(q, k, v, is_causal=causal, **keywords)  # noqa: E731
        outputs[name] = call()[:, :2].float().cpu()
        print(f"{label} | {name} | {bench_graph_ms(call, rep=60):.4f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    torch.save(outputs, os.path.join(os.environ.get("OUT", "/tmp"), f"outs_{label}.pt"))


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "centers"
    if mode == "centers":
        centers_sweep()
    elif mode == "pass-warps":
        pass_warps()
    elif mode == "calls":
        calls(sys.argv[2], {key: int(value) for key, value in (item.split("=") for item in sys.argv[3:])})
    else:
        sys.exit(f"mode: centers, pass-warps or calls, not {mode!r}")
