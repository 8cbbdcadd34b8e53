"""``hf-qattn eval-attention MODEL_DIR --text FILE``: per-layer attention accuracy of qattn on a model's real inputs.

Runs the model with SDPA on windows of ``--text``, captures the Q, K, V every attention layer receives
and runs them through ``hf_qattn.qattn`` as qattn-8b and qattn-4b (the kernels on a GPU, their
reference on a CPU), against float64 attention on the same Q, K, V (:mod:`hf_qattn.evaluation.layer_accuracy`).
Prints the table (CosSim, RelL1, RMSE per layer: average and worst over the windows) and writes
``attention-accuracy.md`` and ``attention-accuracy.json`` into ``--out``.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from .args import CLIError, check_out_dir, positive_int, read_text


def add_eval_attention_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval-attention", help="per-layer accuracy of qattn-8b/-4b on the Q, K, V a model sees on real text",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("model_dir", type=Path, help="a transformers model folder (config.json, weights, tokenizer)")
    parser.add_argument("--text", type=Path, required=True, help="a UTF-8 text file (e.g. WikiText-2)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--windows", type=positive_int, default=2, help="text windows (default 2)")
    parser.add_argument("--tokens", type=positive_int, default=512, help="tokens per window at most (default 512)")
    parser.set_defaults(func=run_eval_attention)


def run_eval_attention(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from .. import __version__
    from ..evaluation.layer_accuracy import capture_attention_inputs, per_layer_accuracy, per_layer_table, text_windows
    from .common import default_device, model_class, quiet_transformers

    if not (args.model_dir / "config.json").is_file():
        raise CLIError(f"MODEL_DIR {args.model_dir} is not a transformers model folder (no config.json)")
    if not read_text(args.text, "--text").split():
        raise CLIError(f"--text: {args.text} holds no words")
    check_out_dir(args.out)
    quiet_transformers()
    device = default_device()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = model_class(args.model_dir).from_pretrained(args.model_dir, attn_implementation="sdpa",
                                                        dtype=torch.float32).to(device).eval()
    batches = [{key: value.to(device) for key, value in batch.items()}
               for batch in text_windows(tokenizer, str(args.text), args.windows, args.tokens, 2 * args.tokens)]
    records = capture_attention_inputs(model, batches)
    if not records:
        raise CLIError(f"{args.model_dir}: no attention call went through transformers' attention interface")
    first = records[0]
    results = per_layer_accuracy(records)
    note = (f"{len(set(r['layer'] for r in records))} layers, {len(batches)} windows of up to {args.tokens} tokens "
            f"of {args.text}; q {tuple(first['q'].shape)}, k/v {tuple(first['k'].shape)}; "
            f"{'causal' if first['causal'] else 'bidirectional'}; {device}; hf_qattn {__version__}, "
            f"{datetime.date.today()}. avg / worst over the windows, against float64 attention.")
    table = per_layer_table(args.model_dir.name, note, results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention-accuracy.md").write_text(table, encoding="utf-8")
    record = {"model": str(args.model_dir), "text": str(args.text), "windows": len(batches), "tokens": args.tokens,
              "device": str(device), "date": datetime.date.today().isoformat(), "hf_qattn": __version__,
              "layers": {mode: {str(layer): [{"cos_sim": a.cos_sim, "rel_l1": a.rel_l1, "rmse": a.rmse}
                                             for a in values] for layer, values in per_mode.items()}
                         for mode, per_mode in results.items()}}
    (args.out / "attention-accuracy.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(f"wrote {args.out / 'attention-accuracy.md'} and attention-accuracy.json")
    return 0
