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
from .common import plain_text


def add_eval_attention_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval-attention", help="per-layer accuracy of qattn-8b/-4b on the Q, K, V a model sees on real text",
        description=plain_text(__doc__.split("\n\n")[1]))
    parser.add_argument("model_dir", type=Path, help="a transformers model folder (config.json, weights, tokenizer)")
    parser.add_argument("--text", type=Path, required=True, help="a UTF-8 text file (e.g. WikiText-2)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--windows", type=positive_int, default=2,
                        help="consecutive stretches of --text the model runs on, 2 × --tokens words each, or an "
                             "equal share of a shorter text (default 2)")
    parser.add_argument("--tokens", type=positive_int, default=512, help="tokens per window at most (default 512)")
    parser.set_defaults(func=run_eval_attention)


def run_eval_attention(args) -> int:
    import torch

    from .. import __version__
    from ..evaluation.layer_accuracy import capture_attention_inputs, per_layer_accuracy, per_layer_table, text_windows
    from .common import default_device, load_config, load_model, load_tokenizer, model_class, quiet_transformers

    config = load_config(args.model_dir)
    words = len(read_text(args.text, "--text").split())
    if not words:
        raise CLIError(f"--text: {args.text} holds no words")
    words_per_window = min(2 * args.tokens, words // args.windows)
    if words_per_window == 0:
        raise CLIError(f"--windows {args.windows}: {args.text} holds only {words} word(s), fewer than one a window")
    check_out_dir(args.out)
    quiet_transformers()
    device = default_device()
    tokenizer = load_tokenizer(args.model_dir, "--text")
    if words_per_window < 2 * args.tokens:
        print(f"note: {args.text} holds {words} words, so each of the {args.windows} windows takes {words_per_window} "
              f"of them (a full window is {2 * args.tokens} words, cut to --tokens {args.tokens} tokens)")
    batches = [{key: value.to(device) for key, value in batch.items()}
               for batch in text_windows(tokenizer, str(args.text), args.windows, args.tokens, words_per_window)]
    if any(batch["input_ids"].shape[-1] == 0 for batch in batches):
        raise CLIError(f"--text: the tokenizer of {args.model_dir} turns a window of {args.text} into no tokens")
    model = load_model(model_class(args.model_dir, config), args.model_dir, config=config, attn_implementation="sdpa",
                       dtype=torch.float32).to(device).eval()
    records = capture_attention_inputs(model, batches)
    if not records:
        raise CLIError(f"{args.model_dir}: no attention call went through transformers' attention interface")
    first = records[0]
    results = per_layer_accuracy(records)
    note = (f"{len(set(r['layer'] for r in records))} layers, {len(batches)} windows of up to {args.tokens} tokens "
            f"({words_per_window} words each) of {args.text}; q {tuple(first['q'].shape)}, "
            f"k/v {tuple(first['k'].shape)}; "
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
