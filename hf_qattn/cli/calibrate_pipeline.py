"""``hf-qattn calibrate-pipeline``: calibrate a saved diffusers pipeline from the command line.

    hf-qattn calibrate-pipeline PIPELINE_DIR --prompts FILE --steps N --ratio R --out OUT_DIR

writes into OUT_DIR: the pipeline (``save_pretrained``, the plan in ``transformer/config.json``;
skip with ``--no-save-pipeline``), ``qattn_plan.<component>.json`` for each denoiser (usable as
``hf_qattn.patch(pipe, plan=path)``), ``qattn_calibration.json`` (every score) and
``qattn_scores.<component>.png`` (the step × layer heatmap).

This module imports neither torch nor diffusers at import time, so building the CLI's parser stays
cheap and works without diffusers installed.
"""

from __future__ import annotations

import argparse
import json
import os

from .args import CLIError, check_out_dir, positive_int, ratio, read_text

DTYPES = ("bfloat16", "float16", "float32")


def add_calibrate_pipeline_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``calibrate-pipeline`` sub-command to an argparse ``subparsers`` object; its
    ``func`` default is :func:`run_calibrate_pipeline`."""
    parser = subparsers.add_parser(
        "calibrate-pipeline",
        help="score INT4 attention at every (step, layer) of a diffusers pipeline and write a 4/8-bit plan",
        description="Run a diffusers pipeline in full precision on a few prompts, score the INT4 attention kernel "
                    "at every (denoising step, attention layer), mark the lowest-scoring RATIO share INT8, and save "
                    "the plan into the denoiser's config.")
    parser.add_argument("pipeline_dir", metavar="PIPELINE_DIR", help="a folder saved by pipe.save_pretrained")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="prompts: a text file with one prompt per line (blank lines and lines starting with # "
                             "are skipped), or a JSON list of strings")
    parser.add_argument("--steps", type=positive_int, default=50, metavar="N", help="denoising steps per prompt (default 50)")
    parser.add_argument("--ratio", type=ratio, default=0.3, metavar="R",
                        help="share of (step, layer) entries marked int8, in [0, 1] (default 0.3)")
    parser.add_argument("--out", required=True, metavar="OUT_DIR", help="output folder (created if missing)")
    parser.add_argument("--height", type=positive_int, help="image / video height passed to the pipeline")
    parser.add_argument("--width", type=positive_int, help="image / video width passed to the pipeline")
    parser.add_argument("--num-frames", type=positive_int, help="video frames passed to the pipeline")
    parser.add_argument("--guidance-scale", type=float, help="guidance scale passed to the pipeline")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompt i is SEED + i (default 0)")
    parser.add_argument("--device", help="device to run on (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--no-save-pipeline", action="store_true",
                        help="write only the plan, scores and heatmap, not a copy of the pipeline")
    parser.set_defaults(func=run_calibrate_pipeline)
    return parser


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per line) or a JSON list of strings."""
    text = read_text(path, "--prompts")
    if path.endswith(".json"):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as error:
            raise CLIError(f"--prompts: {path} is not valid JSON ({error})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise CLIError(f"--prompts: {path} must hold a JSON list of strings")
    else:
        prompts = [line.strip() for line in text.splitlines()]
        prompts = [line for line in prompts if line and not line.startswith("#")]
    if not prompts:
        raise CLIError(f"--prompts: {path} holds no prompt")
    return prompts


def _dtype_argument() -> str:
    """``from_pretrained``'s dtype keyword: ``dtype`` since diffusers deprecated ``torch_dtype``."""
    try:
        from diffusers.utils import deprecation_utils
    except ImportError:
        return "torch_dtype"
    return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"


def run_calibrate_pipeline(args: argparse.Namespace) -> int:
    """Run ``calibrate-pipeline`` with parsed ``args``; returns the exit status (0 on success).
    Problems with the arguments raise ``hf_qattn.cli.CLIError`` (printed by ``hf-qattn``)."""
    if not os.path.isdir(args.pipeline_dir):
        raise CLIError(f"PIPELINE_DIR: no such folder: {args.pipeline_dir}")
    if not os.path.isfile(os.path.join(args.pipeline_dir, "model_index.json")):
        raise CLIError(f"PIPELINE_DIR: {args.pipeline_dir} is not a diffusers pipeline folder (no model_index.json; "
                       "save one with pipe.save_pretrained)")
    prompts = read_prompts(args.prompts)
    check_out_dir(args.out, source=None if args.no_save_pipeline else args.pipeline_dir, source_name="PIPELINE_DIR")

    import torch

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise CLIError(f"--device: not a torch device: {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: no CUDA device is available")
    try:
        from diffusers import DiffusionPipeline
    except ImportError:
        raise CLIError("calibrate-pipeline needs diffusers: pip install 'hf-qattn[diffusers]'") from None

    from ..calibration.plots import plot_scores
    from ..integrations.diffusers.calibration import calibrate_pipeline

    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    try:
        pipe = DiffusionPipeline.from_pretrained(args.pipeline_dir, **{_dtype_argument(): getattr(torch, dtype_name)})
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CLIError(f"PIPELINE_DIR {args.pipeline_dir}: the pipeline does not load: {first}") from None
    pipe = pipe.to(device)
    options = {name: value for name, value in (("height", args.height), ("width", args.width),
                                               ("num_frames", args.num_frames),
                                               ("guidance_scale", args.guidance_scale)) if value is not None}
    result = calibrate_pipeline(pipe, prompts, num_inference_steps=args.steps, ratio=args.ratio, seed=args.seed,
                                **options)

    os.makedirs(args.out, exist_ok=True)
    if not args.no_save_pipeline:
        pipe.save_pretrained(args.out)
    for name, plan in result.plans.items():
        with open(os.path.join(args.out, f"qattn_plan.{name}.json"), "w", encoding="utf-8") as file:
            json.dump(plan.to_dict(), file, indent=2)
        plot_scores(result, os.path.join(args.out, f"qattn_scores.{name}.png"), denoiser=name,
                    title=f"{os.path.basename(os.path.normpath(args.pipeline_dir))} {name}")
    with open(os.path.join(args.out, "qattn_calibration.json"), "w", encoding="utf-8") as file:
        json.dump(result.to_dict(), file, indent=1)
    for name, plan in result.plans.items():
        counts = plan.count()
        print(f"{name}: {counts['int8']} int8 / {counts['int4']} int4 (step, layer) entries over "
              f"{result.num_steps} steps -> {args.out}")
    if result.skipped:
        print("not scored: " + ", ".join(f"{reason} ({n})" for reason, n in result.skipped.items()))
    return 0
