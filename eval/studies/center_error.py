"""Where does the Hopper kernel's zero-mean-V error that grows with length come from? (GPU study, issue 22.)

    bash eval/device_run.sh python3 eval/studies/center_error.py

Hypothesis: the smoothing centers come from 256 sampled tokens, so V − v̄ keeps an offset c (≈ σ_V / 16 a
channel). The output is Σ P̂(V − v̄) / l + v̄ with l summed from the unrounded P, so any bias b of
Σ P̂ against l (FP8 rounding of P, the FP8 wgmma's truncated sums) leaves b·c in the output: a fixed vector,
while attention's own output shrinks like 1/√N with zero-mean V. Exact centers (all tokens) remove it.
Runs eval/accuracy_length.py's inputs (zero-mean V) and reference with the centers from 256 sampled tokens
(shipped), 2048, or all tokens. Measured (eval/results/v-dither-*.md): exact centers do not help; the error
came from V̂'s rounding (eval/studies/operand_error.py), which the tile dither (kernels/formats.py) fixed.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "eval")
import accuracy_length as al  # noqa: E402
from hf_qattn.calibration.metrics import accuracy  # noqa: E402
from hf_qattn.kernels import tuning  # noqa: E402

SAMPLED = tuning.center_sample


def sampled(tokens):
    return lambda: tokens


def main() -> None:
    lengths = [4096, 32768, 75600, 131072, 262144]
    methods = {
        f"hopper, centers from {SAMPLED()} tokens (shipped)": (lambda q, k, v: al.hopper(q, k, v, None), SAMPLED),
        "hopper, centers from 2048 tokens": (lambda q, k, v: al.hopper(q, k, v, None), sampled(2048)),
        "hopper, exact centers": (lambda q, k, v: al.hopper(q, k, v, None), sampled(1 << 30)),
        f"portable, centers from {SAMPLED()} tokens": (al.portable, SAMPLED),
    }
    table = {}
    for v_kind in ("v-zero",):
        for n in lengths:
            q, k, v = al.inputs(n, v_kind)
            rows = torch.linspace(0, n - 1, al.ROWS, device=q.device).long()
            ref = al.reference_rows(q, k, v, rows)
            for name, (fn, centers) in methods.items():
                tuning.center_sample = centers
                try:
                    acc = accuracy(fn(q, k, v)[:, :, rows].float(), ref)
                finally:
                    tuning.center_sample = SAMPLED
                table[v_kind, name, n] = acc
                print(f"{v_kind} N={n} {name}: RelL1 {acc.rel_l1:.4f} cos {acc.cos_sim:.6f}", flush=True)
            del q, k, v, ref
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; cos to float32 (RelL1)\n")
    print("| v | method | " + " | ".join(f"{n}" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for v_kind in ("v-zero",):
        for name in methods:
            cells = [f"{table[v_kind, name, n].cos_sim:.6f} ({table[v_kind, name, n].rel_l1:.4f})"
                     if (v_kind, name, n) in table else "" for n in lengths]
            print(f"| {v_kind} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
