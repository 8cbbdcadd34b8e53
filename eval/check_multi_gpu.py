"""Device check for more than one GPU (run on the `nvidia-h200-x2` kind):

    bash eval/device_run.sh python3 eval/check_multi_gpu.py --out eval/results/

1. ``qattn`` on tensors on the last GPU while the current device is cuda:0 matches SDPA there.
2. A Llama-shaped model (random weights, bf16) split over every GPU with ``device_map="auto"``
   gives finite logits with ``attn_implementation="qattn"``, close to SDPA's, and every call of the
   attention reached the kernels (no fallback counted).
Prints one line per check and a PASS/FAIL table; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F

import hf_qattn
from hf_qattn.reference import exact_attention

from report import finish  # eval/report.py

# this checks the kernels, at lengths where the transformers integration would otherwise hand calls to SDPA
# (hf_qattn.support.below_break_even)
os.environ.setdefault("HF_QATTN_BREAK_EVEN", "0")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def check_other_device(rows: list) -> None:
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 8, 1000, 128, device=last, dtype=torch.float16) for _ in range(3))
        hf_qattn.reset_fallback_stats()
        out = hf_qattn.qattn(q, k, v, is_causal=causal)
        torch.cuda.synchronize(last)
        ref = exact_attention(q, k, v, is_causal=causal, dtype=torch.float32)
        cos = cosine(out, ref)
        ok = out.device == last and bool(torch.isfinite(out).all()) and cos > 0.999
        rows.append((f"qattn on {last} (current cuda:0), causal={causal}", f"cos={cos:.6f}", ok))


def check_device_map(rows: list) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        del model
        n = torch.cuda.device_count()
        # a memory cap per GPU forces "auto" to spread the layers over all of them
        budget = {i: "150MiB" for i in range(n - 1)} | {n - 1: "40GiB"}
        logits = {}
        for impl in ("sdpa", "qattn"):
            m = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, device_map="auto",
                                                     max_memory=budget, attn_implementation=impl)
            devices = sorted({str(p.device) for p in m.parameters()})
            ids = torch.randint(0, config.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(1))
            hf_qattn.reset_fallback_stats()
            with torch.no_grad():
                logits[impl] = m(ids.to(m.device)).logits.float().cpu()
            stats = hf_qattn.fallback_stats()
            del m
            torch.cuda.empty_cache()
        finite = bool(torch.isfinite(logits["qattn"]).all())
        cos = cosine(logits["qattn"], logits["sdpa"])
        ok = finite and cos > 0.99 and not stats["fallbacks"] and len(devices) > 1
        rows.append((f"Llama-shaped, device_map=auto over {devices}", f"finite={finite} cos={cos:.5f} "
                     f"calls={stats['calls']} fallbacks={stats['fallbacks']}", ok))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the markdown result")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs at least 2 GPUs; found", torch.cuda.device_count())
        return 2
    rows: list = []
    for check in (check_other_device, check_device_map):
        try:
            check(rows)
        except Exception as error:  # a crash is a failed check, reported with the rest
            rows.append((check.__name__, f"{type(error).__name__}: {error}", False))
    return finish("Multi-GPU check", f"torch {torch.__version__}, hf_qattn {hf_qattn.__version__}",
                  [(name, ok, detail) for name, detail, ok in rows], args.out, "multi-gpu",
                  f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}")

if __name__ == "__main__":
    sys.exit(main())
