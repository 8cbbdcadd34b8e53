"""Zero-mean V at user lengths for the variants whose rows see every earlier key (sinks on full causal layers,
soft-capping): the case where an error that grows with the number of key tiles would show (a window bounds it).

    bash eval/device_run.sh python3 eval/studies/variant_zero_mean_v.py

Inputs: eval/synthetic.py's recipe with V's channel offsets removed (zero mean), B1, the last 512 query rows scored
against float64 attention (eval/check_variants.py's reference, over only the keys each row sees).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers

import hf_qattn  # noqa: E402
from check_variants import compare, device_outlier_qkv, sinks_for, variant_reference  # noqa: E402

CASES = [  # name, (Hq, Hk, d, N), qattn keywords
    ("gpt-oss full causal + sinks, d64, 128k", (64, 8, 64, 131072), dict(sinks=True)),
    ("Gemma-2 global soft-cap 50, d256, 64k", (16, 8, 256, 65536), dict(softcap=50.0)),
    ("plain causal, d128, 128k (for comparison)", (32, 8, 128, 131072), dict()),
]


def main() -> None:
    print("| case | cos | rel_l1 | path |\n|---|---|---|---|")
    for name, (hq, hk, d, n), keywords in CASES:
        q, k, v = device_outlier_qkv(1, hq, hk, n, d, seed=0, dtype=torch.bfloat16, device="cuda")
        v = (v.float() - v.float().mean(dim=2, keepdim=True)).to(torch.bfloat16)  # zero-mean V
        rows = torch.arange(n - 512, n, device="cuda")
        call = dict(keywords)
        if call.get("sinks"):
            call["sinks"] = sinks_for(q, k, v)
        hf_qattn.reset_fallback_stats()
        out = hf_qattn.qattn(q, k, v, is_causal=True, **call)
        ref, _ = variant_reference(q, k, v, rows=rows, **call)
        metrics = compare(out[:, :, rows].float(), ref)
        print(f"| {name} | {metrics['cos']:.6f} | {metrics['rel_l1']:.4f} | {hf_qattn.fallback_stats()['calls']} |",
              flush=True)
        del q, k, v, out, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
