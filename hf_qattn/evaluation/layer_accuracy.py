"""Per-layer attention accuracy on real inputs: the Q, K, V every attention layer of a transformers model
receives (captured inside transformers' attention interface: after RoPE, with the model's GQA heads,
causal where the model is), run through :func:`hf_qattn.qattn` per mode and compared with float64
attention on the same Q, K, V — CosSim, RelL1 and RMSE per layer, average and worst over the inputs.

Used by ``hf-qattn eval-attention`` and ``eval/kernel_accuracy.py --per-layer``.
"""

from __future__ import annotations

import torch

import hf_qattn

from .. import reference
from ..calibration.metrics import accuracy
from ..progress import track
from ..integrations.transformers.attention import causal_call, full_precision_attention, layer_index, model_variants

MODES = (("qattn-8b", "int8"), ("qattn-4b", "int4"))


def capture_attention_inputs(model, batches) -> list[dict]:
    """Run ``model`` on ``batches`` with SDPA and keep what each attention call receives.

    A temporary attention implementation records (layer, q, k, v, causal, scale, and the layer's attention
    variant: sliding window, chunk, sinks, soft-cap, as qattn's keywords) and then runs the model's full-precision
    attention (transformers' SDPA function, or the model's eager one where SDPA cannot express the call). A variant qattn cannot
    take is recorded as ``variant_error`` (the reason); such a call is not scored.
    """
    from transformers import AttentionInterface

    records: list[dict] = []
    order: dict[int, int] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, is_causal=None, **kwargs):
        layer = layer_index(module)
        if not isinstance(layer, int):
            layer = order.setdefault(id(module), len(order))
        variants, variant_error = model_variants(module, query, kwargs)
        records.append(dict(layer=layer, q=query.detach().float().clone(), k=key.detach().float().clone(),
                            v=value.detach().float().clone(), causal=causal_call(module, is_causal, query.shape[2]),
                            scale=scaling, variants=variants, variant_error=variant_error))
        return full_precision_attention(module, query, key, value, attention_mask, scaling=scaling,
                                        is_causal=is_causal, **kwargs)

    AttentionInterface.register("qattn_capture", capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation("qattn_capture")
    try:
        with torch.no_grad():
            for window, batch in enumerate(batches):
                start = len(records)
                model(**batch)
                for record in records[start:]:
                    record["window"] = window
    finally:
        model.set_attn_implementation(previous)
    return records


def per_layer_accuracy(records, modes=MODES) -> dict:
    """{mode: {layer: [Accuracy per window]}} of hf_qattn.qattn against float64 attention."""
    out: dict = {label: {} for label, _ in modes}
    for record in track(records, "per-layer accuracy", leave=False):
        if record.get("variant_error"):
            continue  # attention qattn does not compute: scoring it as plain attention would be wrong
        q, k, v = record["q"], record["k"], record["v"]
        variants = {name: value for name, value in record.get("variants", {}).items() if value is not None}
        if "sinks" in variants:
            variants["sinks"] = variants["sinks"].detach().float().flatten()
        exact = reference.exact_attention(q, k, v, is_causal=record["causal"], sm_scale=record["scale"], **variants)
        for label, qk in modes:
            result = hf_qattn.qattn(q, k, v, is_causal=record["causal"], sm_scale=record["scale"], qk=qk,
                                    **variants)
            out[label].setdefault(record["layer"], []).append(accuracy(result, exact))
    return out


def per_layer_table(title: str, note: str, results: dict) -> str:
    labels = list(results)
    head = "| layer | " + " | ".join(f"{m} CosSim avg | {m} CosSim worst | {m} RelL1 avg | {m} RelL1 worst | {m} RMSE avg"
                                      for m in labels) + " |"
    lines = [f"### {title}\n", note + "\n", head, "|" + "---|" * (1 + 5 * len(labels))]

    def cells(values):
        n = len(values)
        return (f"{sum(a.cos_sim for a in values) / n:.5f} | {min(a.cos_sim for a in values):.5f} | "
                f"{sum(a.rel_l1 for a in values) / n:.4f} | {max(a.rel_l1 for a in values):.4f} | "
                f"{sum(a.rmse for a in values) / n:.5f}")

    for layer in sorted(results[labels[0]]):
        lines.append(f"| {layer} | " + " | ".join(cells(results[m][layer]) for m in labels) + " |")
    lines.append("| **all** | " + " | ".join(cells([a for v in results[m].values() for a in v]) for m in labels) + " |")
    worst = {m: max(results[m], key=lambda layer: sum(a.rel_l1 for a in results[m][layer])) for m in labels}
    lines.append("\nWorst layer by average RelL1: " + ", ".join(f"{m}: layer {layer}" for m, layer in worst.items())
                 + ".\n")
    return "\n".join(lines) + "\n"


def text_windows(tokenizer, text_path: str, windows: int, tokens: int, words_per_window: int) -> list[dict]:
    """``windows`` consecutive stretches of ``words_per_window`` words of the file, tokenized to ≤ ``tokens``.
    ValueError when the file has fewer than ``windows × words_per_window`` words (a window would be cut
    short or empty: an empty one has no tokens to run)."""
    with open(text_path, encoding="utf-8") as f:
        words = f.read().split()
    if len(words) < windows * words_per_window:
        raise ValueError(f"{text_path} holds {len(words)} words; {windows} windows of {words_per_window} words "
                         f"need {windows * words_per_window}")
    batches = []
    for window in range(windows):
        text = " ".join(words[window * words_per_window:(window + 1) * words_per_window])
        batches.append(dict(tokenizer(text, return_tensors="pt", truncation=True, max_length=tokens)))
    return batches
