"""``hf-qattn calibrate MODEL_DIR --ratio 0.3 --text FILE --out OUT_DIR``: calibrate a transformers model on text."""

from __future__ import annotations

import json
from pathlib import Path

from .args import CLIError, check_out_dir, positive_int, ratio, scan_text_lines
from .common import (default_device, first_line, format_table, load_config, load_model, load_tokenizer,
                     model_class, quiet_transformers, save_plot, score_rows)


def _add_calibrate(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="score every layer on text and write a 4/8-bit plan into the model config",
        description="Run MODEL_DIR on lines of --text, rank every attention layer by how much INT4 attention "
                    "there harms the model (--objective; by default ppl-gain for a causal LM, the INT4 attention "
                    "score otherwise), mark the most harmed --ratio share int8, and save the model (config with "
                    "the plan), its tokenizer, scores.json and scores.png (score or sensitivity per layer) into "
                    "--out.")
    parser.add_argument("model_dir", type=Path, help="a transformers model folder (config.json, weights, tokenizer)")
    parser.add_argument("--text", type=Path, required=True, help="text file: one input per line ('#' lines skipped)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--ratio", type=ratio, default=0.3, help="share of layers marked int8 (default 0.3)")
    parser.add_argument("--max-samples", type=positive_int, default=32, help="lines of --text to use (default 32)")
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per line at most (default 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="lines per forward pass (default 8)")
    from ..integrations.transformers.calibration import AUTO, OBJECTIVES

    parser.add_argument("--objective", default=AUTO, choices=[AUTO, *sorted(OBJECTIVES)],
                        help=f"how layers are ranked: {AUTO} (default): ppl-gain for a causal LM (on SmolLM2 its "
                             "plan recovered 51 %% of int4's perplexity increase on held-out text, attention's 30 %%), "
                             "attention for other models; " + "; ".join(f"{name}: {cost}" for name, (_, cost)
                                                                         in OBJECTIVES.items()))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_calibrate)


def _drop_invalid_plan(config, model_dir: Path) -> None:
    """Calibration writes a new plan: one already in the config that does not validate is dropped, with
    a note, instead of failing the run (a model that runs qattn refuses a malformed plan)."""
    from ..integrations.transformers.attention import plan_from_config
    from ..plan import PLAN_CONFIG_KEY, PlanError

    try:
        plan_from_config(config)
    except PlanError as error:
        delattr(config, PLAN_CONFIG_KEY)
        print(f"note: {model_dir / 'config.json'} held an invalid {PLAN_CONFIG_KEY} ({first_line(error)}); "
              "calibration replaces it")


def run_calibrate(args) -> int:
    import torch

    from ..integrations.transformers.calibration import AUTO, calibrate, choose_objective

    quiet_transformers()
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"MODEL_DIR {model_dir} is not a transformers model folder (no config.json)")
    texts, skipped = scan_text_lines(args.text, args.max_samples)
    check_out_dir(args.out, source=model_dir)
    print(f"{len(texts)} input line(s) from {args.text}" + (
        "; skipped " + ", ".join(f"{n} {reason}" for reason, n in skipped.items()) if skipped else ""))
    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir, "--text")
    _drop_invalid_plan(config, model_dir)
    device = default_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = load_model(model_class(model_dir, config), model_dir, config=config, dtype=dtype).to(device)
    if args.objective == AUTO:
        picked, why = choose_objective(model)
        print(f"objective: {picked} ({AUTO}: {why}; --objective names another)", flush=True)
    result = calibrate(model, texts, args.ratio, tokenizer=tokenizer, batch_size=args.batch_size,
                       max_length=args.max_length, progress=not args.no_progress, objective=args.objective)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "scores.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    from ..calibration.scoring import SCORE_MEANING

    objective = result.objective  # what ran (--objective auto picks one)
    if objective == "attention":
        plot = save_plot(result, out / "scores.png", f"{model_dir.name}: INT4 score per layer ({len(texts)} inputs)")
        print(f"{SCORE_MEANING}; mean and worst over the inputs:")
    else:
        meaning = {
            "logit-kl": "KL (nats per token) of the final next-token distribution with that layer alone at int4 "
                        "from full precision; higher is more harmed",
            "logit-kl-gain": "how much the KL (nats per token) of the all-int4 model's next-token distribution from "
                             "full precision drops when that layer alone is int8; higher gains more",
            "ppl-gain": "how much the next-token NLL (nats per token) of the text drops when that layer alone is "
                        "int8 and all others int4; higher gains more",
        }[objective]
        short = {"logit-kl": "KL with this layer int4 (nats/token)\nhigher = more harmed by int4",
                 "logit-kl-gain": "KL drop with this layer int8 (nats/token)\nhigher = gains more from int8",
                 "ppl-gain": "NLL drop with this layer int8 (nats/token)\nhigher = gains more from int8"}
        plot = save_plot(result, out / "scores.png", f"{model_dir.name}: {objective} per layer "
                         f"({len(texts)} inputs)", label=short[objective])
        print(f"{objective}: per layer, {meaning}; the highest are marked int8 "
              f"({result.forwards} forwards, {result.seconds:.1f} s); mean and worst over the inputs:")
    print(format_table(["layer", "mean", "worst", "inputs", "plan"], score_rows(result)))
    if objective == "ppl-gain" and result.scores:
        first = next(iter(result.scores.values()))
        print(f"next-token NLL on the text: {first.nll_int4:.4f} all int4, {first.nll_full:.4f} full precision "
              f"({first.tokens} tokens)")
    counts = result.plan.count()
    print(f"\nplan: {counts['int8']} layer(s) int8, {counts['int4']} int4 (ratio {args.ratio}); "
          f"written to {out / 'config.json'} under 'qattn_plan'")
    print(f"scores: {out / 'scores.json'}" + (f", plot: {plot}" if plot else ""))
    if result.skipped:
        print(f"calls not scored: {result.skipped}")
    return 0
