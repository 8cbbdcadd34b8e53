"""Study: what a work item of the Hopper kernel costs besides its key tiles, by ablation (GPU).

    bash eval/device_run.sh python3 eval/studies/item_cost.py [--ablations 0,1,2,4,7,8] [--rounds 2]

Short items — a few key tiles each: windows, gpt-oss's window of 128, causal calls of 1k–4k — run below their
long-item speed. To see where an item's time goes, this copies the installed package to a temporary directory,
rewrites the kernel there with ablation switches (a bit mask, read at import from ``QATTN_ABLATE``), and times the
Gluon kernel alone (one K/V pass's output, ``timing.bench_ms``) once per ablation, each in its own process with its
own Triton cache, in alternating rounds (the best round each). The results are wrong by design; only time counts.

    1  Q rows from arithmetic instead of global memory (the prologue's load)
    2  the epilogue's global loads (v̄, V's range, the sink) replaced by arithmetic
    4  the output store predicated off (its memory traffic)
    8  no key tiles: every item does its prologue and epilogue only (what a CTA costs without a main loop)

The shipped kernel is untouched; a rewrite whose anchor text is gone fails loudly (update the anchors with it).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile

# (file under hf_qattn/kernels/hopper, anchor, replacement); each module gains _ABLATE from the environment
REWRITES = [
    ("mainloop.py",
     """    q = gl.load(base + rows.to(gl.int64)[:, None] * prob.stride_qn + cols[None, :] * prob.stride_qd, mask=inside,
                other=0.0).to(gl.float32)
""",
     """    if _ABLATE & 1:
        q = gl.where(inside, ((rows[:, None] * 7 + cols[None, :]) % 13).to(gl.float32) * 0.1 - 0.6, 0.0)
    else:
        q = gl.load(base + rows.to(gl.int64)[:, None] * prob.stride_qn + cols[None, :] * prob.stride_qd,
                    mask=inside, other=0.0).to(gl.float32)
"""),
    ("epilogue.py",
     "        sink = (gl.load(prob.SINK + h).to(gl.float32) - shift) * _LOG2E  # in the model's dtype (gpt-oss: bf16)\n",
     """        if _ABLATE & 2:
            sink = (0.5 - shift) * _LOG2E
        else:
            sink = (gl.load(prob.SINK + h).to(gl.float32) - shift) * _LOG2E
"""),
    ("epilogue.py",
     """    v_bar = gl.load(prob.V_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
    # V_SCALE holds V's range per channel (max V, max −V): max |V − v̄| as the K/V pass computed it
    v_absmax = gl.maximum(gl.load(prob.V_SCALE + bhk * 2 * cfg.D_PAD + cols) - v_bar,
                          v_bar + gl.load(prob.V_SCALE + (bhk * 2 + 1) * cfg.D_PAD + cols))
""",
     """    if _ABLATE & 2:
        v_bar = cols.to(gl.float32) * 0.001
        v_absmax = cols.to(gl.float32) * 0.01 + 1.0
    else:
        v_bar = gl.load(prob.V_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
        v_absmax = gl.maximum(gl.load(prob.V_SCALE + bhk * 2 * cfg.D_PAD + cols) - v_bar,
                              v_bar + gl.load(prob.V_SCALE + (bhk * 2 + 1) * cfg.D_PAD + cols))
"""),
    ("epilogue.py",
     "             out.to(prob.O.dtype.element_ty), mask=inside)\n",
     """             out.to(prob.O.dtype.element_ty),
             mask=inside & ((rows < prob.NQ - (1 << 30)) if _ABLATE & 4 else (rows >= -1))[:, None])
"""),
    ("scheduler.py",
     "    return first, end\n",
     """    if _ABLATE & 8:
        end = first
    return first, end
"""),
]
SWITCH = '\nimport os as _os\n_ABLATE = gl.constexpr(int(_os.environ.get("QATTN_ABLATE", "0")))\n'
# name, B, Hq, Hk, N, d, causal, window, sinks
SHAPES = [
    ("gpt-oss window 128 + sinks, 8k, 64/8, d64", 1, 64, 8, 8192, 64, True, 128, True),
    ("window 1024, 8k, H32, d128", 1, 32, 32, 8192, 128, True, 1024, False),
    ("causal 2k, B4 H32, d128", 4, 32, 32, 2048, 128, True, 0, False),
    ("causal 4k, B4 H32, d128", 4, 32, 32, 4096, 128, True, 0, False),
    ("causal 4k, B4 H32, d64", 4, 32, 32, 4096, 64, True, 0, False),
]


def rewritten_package(root: str) -> str:
    """A copy of the installed hf_qattn with the ablation switches, under ``root``; returns its sys.path entry."""
    import hf_qattn

    source = os.path.dirname(hf_qattn.__file__)
    target = os.path.join(root, "hf_qattn")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    hopper = os.path.join(target, "kernels", "hopper")
    texts = {}
    for name, anchor, replacement in REWRITES:
        path = os.path.join(hopper, name)
        text = texts.get(path) or open(path).read()
        if anchor not in text:
            raise SystemExit(f"item_cost: the anchor in {name} is gone (the kernel changed): {anchor[:60]!r}")
        texts[path] = text.replace(anchor, replacement, 1)
    for path, text in texts.items():
        head = "from .gluon_api import"
        at = text.index(head)
        line_end = text.index("\n", at)
        open(path, "w").write(text[:line_end + 1] + SWITCH + text[line_end + 1:])
    return root


def time_shapes(ablation: int) -> None:
    """One process: the kernel alone on every shape (prints ``ablation | shape | µs | items``)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
    from timing import bench_ms
    from hf_qattn.kernels import launch

    for name, b, hq, hk, n, d, causal, window, sinks in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + d)
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        sink = torch.randn(hq, device="cuda", generator=g) if sinks else None
        kv = launch.hopper_quantize_kv(q, k, v, sm_scale=d ** -0.5)
        out = torch.empty_like(q)

        def call():
            launch.hopper_kernel_launch(q, hk, n, kv, out, is_causal=causal, sm_scale=d ** -0.5, qk="int8",
                                        kv_end=None, return_lse=False, window=window, sinks=sink,
                                        stages=None)

        us = min(bench_ms(call, warmup=25, rep=150) for _ in range(3)) * 1e3
        print(f"{ablation} | {name} | {us:.1f} | {-(-n // 64) * b * hq}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ablations", default="0,1,2,4,7,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time", type=int, default=None, help=argparse.SUPPRESS)  # a child process's ablation
    args = parser.parse_args()
    if args.time is not None:
        time_shapes(args.time)
        return
    times, items = collections.defaultdict(list), {}
    with tempfile.TemporaryDirectory() as root:
        path = rewritten_package(root)
        for _ in range(args.rounds):
            for ablation in (int(a) for a in args.ablations.split(",")):
                env = {**os.environ, "QATTN_ABLATE": str(ablation), "TRITON_CACHE_DIR": os.path.join(root, f"tc{ablation}"),
                       "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--time", str(ablation)], env=env,
                                     capture_output=True, text=True, check=True)
                for line in run.stdout.splitlines():
                    ablation_text, name, us, count = (x.strip() for x in line.split("|"))
                    times[(name, int(ablation_text))].append(float(us))
                    items[name] = int(count)
                print(run.stdout, end="", flush=True)
    ablations = sorted({a for _, a in times})
    print("\n| shape | work items | " + " | ".join(f"ablation {a}: µs" for a in ablations) + " |")
    print("|---|---|" + "---|" * len(ablations))
    for name in dict.fromkeys(n for n, _ in times):
        print(f"| {name} | {items[name]} | " + " | ".join(f"{min(times[(name, a)]):.1f}" for a in ablations) + " |")


if __name__ == "__main__":
    main()
