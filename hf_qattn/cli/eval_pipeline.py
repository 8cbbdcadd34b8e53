"""``hf-qattn eval-pipeline PIPELINE_DIR --prompts FILE --modes sdpa,int8,int4,plan --out OUT_DIR``:
generate with a saved diffusers pipeline once per attention mode and compare with full precision.

One command for image and video pipelines: the kind is read from the pipeline's output (``frames``:
video, ``images``: image); ``--kind`` forces it. Every prompt is generated under every mode with the
same seed (sample j of prompt i: seed SEED + i·N + j, N = ``--num-videos-per-prompt``), so each output
has a full-precision twin:

- ``sdpa``: the pipeline unpatched, full precision — the reference (always run, first);
- ``int8`` / ``int4``: ``hf_qattn.patch(pipe, plan=...)`` with that precision in every layer;
- ``plan``: the plan ``hf-qattn calibrate-pipeline`` stored in each denoiser's ``config.json``, or
  ``--plan FILE`` (a plan JSON such as ``qattn_plan.transformer.json``, or a config.json holding one).

Outputs go into OUT_DIR in VBench's layout, one folder per mode: ``OUT_DIR/<mode>/{prompt}-{index}.mp4``
for videos (imageio + imageio-ffmpeg, or torchvision + PyAV; without either, the frames as PNGs in
``{prompt}-{index}/``) and ``{prompt}-{index}.png`` for images, the prompt kept verbatim as VBench
wants it (:func:`hf_qattn.evaluation.pipeline.vbench_stem`). Each output is compared with the ``sdpa`` output
of the same seed (:func:`hf_qattn.evaluation.quality.sample_metrics`: PSNR, SSIM, lowest frame cosine, and VBench's
weight-free temporal-flickering score of videos), and ``eval-pipeline.md`` / ``eval-pipeline.json``
are written: per mode the mean and worst of each metric, per prompt rows, and the model, modes,
plans, versions, device, seed, date and command. VBench dimensions (``--vbench-dimensions``) run only
where the ``vbench`` package imports and their weights are already on disk; the report says per
dimension what was skipped and why.

Prompts are text: the pipeline folder must hold its text encoders. There is deliberately no switch
for random prompt embeddings: diffusers builds and saves tiny text encoders offline (a tiny CLIP, T5
or UMT5 from a config and a word-level tokenizer from a local vocabulary), so the tests run the
command exactly as a user does, on pipelines saved with their encoders (``eval/pipeline_quality.py``
``save_tiny``), and the VBench file names are the prompts that made the videos.

Arguments (folder, prompts, output folder, plan, pipeline options) are checked before any model loads.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import json
import os
import platform
import shlex

from .args import CLIError, check_out_dir, positive_int
from .calibrate_pipeline import DTYPES, _dtype_argument, read_prompts
from .eval_lm import _labels, _modes

KINDS = ("image", "video")
# pipeline arguments this command sets itself (or has an option for)
OWN_ARGUMENTS = {"prompt": "--prompts", "num_inference_steps": "--steps", "generator": "--seed",
                 "output_type": None, "return_dict": None, "latents": "--seed", "height": "--height",
                 "width": "--width", "num_frames": "--num-frames", "guidance_scale": "--guidance-scale",
                 "num_images_per_prompt": "--num-videos-per-prompt", "num_videos_per_prompt": "--num-videos-per-prompt"}


def _pipeline_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE with a keyword argument name as KEY; got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value  # a plain string
    return key.strip(), parsed


def _dimensions(text: str) -> list[str]:
    from ..evaluation.pipeline import VBENCH_DIMENSIONS

    if text.strip().lower() in ("", "none"):
        return []
    dimensions = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dimensions if d not in VBENCH_DIMENSIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown VBench dimension(s) {', '.join(bad)}; "
                                         f"known: {', '.join(VBENCH_DIMENSIONS)} (or none)")
    return dimensions


def add_eval_pipeline_parser(subparsers) -> None:
    from ..evaluation.pipeline import VBENCH_DEFAULT

    parser = subparsers.add_parser(
        "eval-pipeline", help="generate with a diffusers pipeline per attention mode; metrics against SDPA, "
                              "outputs in VBench's layout",
        description="Generate every prompt with a saved diffusers pipeline once per attention mode (sdpa, int8, "
                    "int4, plan) with a fixed seed per prompt, save the images / videos in VBench's layout "
                    "(OUT_DIR/<mode>/{prompt}-{index}.mp4 or .png), compare each with the sdpa output of the same "
                    "seed (PSNR, SSIM, frame cosine, temporal flickering) and write eval-pipeline.md / .json.")
    parser.add_argument("pipeline_dir", metavar="PIPELINE_DIR", help="a folder saved by pipe.save_pretrained "
                        "(with its text encoders)")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="one prompt per line (blank lines and lines starting with # are skipped), or a JSON "
                             "list of strings")
    parser.add_argument("--modes", type=_modes, default=["sdpa", "int8", "int4"],
                        help="comma-separated, from sdpa, int8, int4, plan (default sdpa,int8,int4); sdpa, the "
                             "reference, is added when missing; a mode given twice is run twice (sdpa,sdpa: "
                             "run-to-run agreement)")
    parser.add_argument("--out", required=True, metavar="OUT_DIR", help="output folder (created if missing)")
    parser.add_argument("--plan", metavar="FILE",
                        help="plan JSON for mode plan (default: the plan in each denoiser's config.json)")
    parser.add_argument("--kind", choices=KINDS, help="force image or video (default: from the pipeline's output)")
    parser.add_argument("--steps", type=positive_int, default=50, metavar="N",
                        help="denoising steps per generation (default 50)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sample j of prompt i uses seed SEED + i*N + j, N samples per prompt (default 0)")
    parser.add_argument("--num-videos-per-prompt", "--num-images-per-prompt", dest="per_prompt", type=positive_int,
                        default=1, metavar="N", help="samples per prompt, indices 0..N-1 in the file names "
                                                     "(default 1; VBench samples 5)")
    parser.add_argument("--height", type=positive_int, help="image / video height passed to the pipeline")
    parser.add_argument("--width", type=positive_int, help="image / video width passed to the pipeline")
    parser.add_argument("--num-frames", "--frames", dest="num_frames", type=positive_int,
                        help="video frames passed to the pipeline")
    parser.add_argument("--guidance-scale", type=float, help="guidance scale passed to the pipeline")
    parser.add_argument("--pipeline-arg", dest="pipeline_args", type=_pipeline_arg, action="append", default=[],
                        metavar="KEY=VALUE", help="another keyword argument for the pipeline call, VALUE as JSON "
                                                  "(else a string); repeatable, e.g. max_sequence_length=226")
    parser.add_argument("--fps", type=positive_int, default=8, help="frame rate of the saved videos (default 8)")
    parser.add_argument("--vbench-dimensions", type=_dimensions, default=list(VBENCH_DEFAULT), metavar="D,D",
                        help=f"VBench dimensions to score the videos on where VBench and its weights are installed "
                             f"(default {','.join(VBENCH_DEFAULT)}; none: no VBench)")
    parser.add_argument("--device", help="device to run on (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_eval_pipeline)


# -- checks before anything loads -----------------------------------------------------------------

def _model_index(pipeline_dir: str) -> dict:
    if not os.path.isdir(pipeline_dir):
        raise CLIError(f"PIPELINE_DIR: no such folder: {pipeline_dir}")
    path = os.path.join(pipeline_dir, "model_index.json")
    if not os.path.isfile(path):
        raise CLIError(f"PIPELINE_DIR: {pipeline_dir} is not a diffusers pipeline folder (no model_index.json; "
                       "save one with pipe.save_pretrained)")
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CLIError(f"PIPELINE_DIR: {path} is not readable JSON ({error})") from None
    if not isinstance(index, dict):
        raise CLIError(f"PIPELINE_DIR: {path} is not a diffusers model index")
    encoders = {key: value for key, value in index.items() if key.startswith("text_encoder")}
    if encoders and all(not (isinstance(v, list) and v and v[0]) for v in encoders.values()):
        raise CLIError(f"PIPELINE_DIR: {pipeline_dir} has no text encoder ({', '.join(sorted(encoders))} empty in "
                       "model_index.json), so it cannot read prompts; save the pipeline with its text encoders")
    return index


def _check_names(prompts: list[str]) -> None:
    """No two prompts may share a file name."""
    from ..evaluation.pipeline import vbench_stem

    seen: dict[str, int] = {}
    for number, prompt in enumerate(prompts, 1):
        stem = vbench_stem(prompt, 0)
        if stem in seen:
            raise CLIError(f"--prompts: prompts {seen[stem]} and {number} give the same file name {stem!r} "
                           "(VBench names files by prompt); for several samples of a prompt use "
                           "--num-videos-per-prompt")
        seen[stem] = number


def _check_plan(args, index: dict):
    """The plan of mode ``plan``: --plan's (loaded now), or None for the denoisers' stored plans,
    checked to exist in their config.json files now, before the weights load."""
    from ..integrations.diffusers.patching import DENOISER_NAMES, load_plan
    from ..plan import PLAN_CONFIG_KEY, PlanError, QAttnPlan

    if args.plan is not None:
        try:
            return load_plan(args.plan)
        except (OSError, UnicodeDecodeError, ValueError, PlanError) as error:
            raise CLIError(f"--plan {args.plan}: {error}") from None
    found, without = {}, []
    for name in DENOISER_NAMES:
        if not (isinstance(index.get(name), list) and index[name] and index[name][0]):
            continue
        path = os.path.join(args.pipeline_dir, name, "config.json")
        try:
            with open(path, encoding="utf-8") as file:
                data = json.load(file).get(PLAN_CONFIG_KEY)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            data = None
        if data is None:
            without.append(name)
            continue
        try:
            found[name] = QAttnPlan.from_dict(data)
        except (PlanError, ValueError, TypeError) as error:
            raise CLIError(f"mode 'plan': the plan in {path} is malformed: {error}") from None
    if not found:
        raise CLIError(f"mode 'plan' needs a plan: no denoiser config in {args.pipeline_dir} holds "
                       f"'{PLAN_CONFIG_KEY}' (run hf-qattn calibrate-pipeline first) and no --plan was given")
    if without:
        print(f"note: mode 'plan': {', '.join(without)} has no stored plan and runs int8 everywhere")
    return None


def _call_options(args) -> dict:
    options = {name: value for name, value in (("height", args.height), ("width", args.width),
                                               ("num_frames", args.num_frames),
                                               ("guidance_scale", args.guidance_scale)) if value is not None}
    for key, value in args.pipeline_args:
        if key in OWN_ARGUMENTS:
            option = OWN_ARGUMENTS[key]
            raise CLIError(f"--pipeline-arg {key}: this command sets {key} itself"
                           + (f"; use {option}" if option else ""))
        options[key] = value
    return options


def _device(name: str | None):
    import torch

    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise CLIError(f"--device: not a torch device: {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: no CUDA device is available")
    return device


def _check_call_options(pipe, options: dict) -> None:
    """Every option is a keyword of the pipeline's __call__ (unless it takes **kwargs)."""
    parameters = inspect.signature(pipe.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in options:
        if key not in parameters:
            option = next((o for k, o in OWN_ARGUMENTS.items() if k == key and o), f"--pipeline-arg {key}")
            raise CLIError(f"{option}: {type(pipe).__name__} takes no argument {key!r}")


def command_line(args) -> str:
    """The command, every option spelled out (defaults included), as it would be typed."""
    words = ["hf-qattn", "eval-pipeline", args.pipeline_dir, "--prompts", args.prompts, "--modes", ",".join(args.modes),
             "--out", args.out, "--steps", str(args.steps), "--seed", str(args.seed), "--num-videos-per-prompt",
             str(args.per_prompt), "--fps", str(args.fps), "--vbench-dimensions",
             ",".join(args.vbench_dimensions) or "none"]
    for option, value in (("--plan", args.plan), ("--kind", args.kind), ("--height", args.height),
                          ("--width", args.width), ("--num-frames", args.num_frames),
                          ("--guidance-scale", args.guidance_scale), ("--device", args.device),
                          ("--dtype", args.dtype)):
        if value is not None:
            words += [option, str(value)]
    for key, value in args.pipeline_args:
        words += ["--pipeline-arg", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return " ".join(shlex.quote(word) for word in words)


# -- the report -----------------------------------------------------------------------------------

def _cell(value) -> str:
    if isinstance(value, float):  # dB to 2 decimals; scores near 1 (SSIM, cosine) to 6, where int8 and int4 differ
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.6f}"
    return "-" if value is None else str(value).replace("|", "\\|")


def _table(headers: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
           ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]


def summary_columns(summary: dict) -> list[str]:
    from ..evaluation.pipeline import METRICS

    present = {metric for per_mode in summary.values() for metric in per_mode}
    return [metric for metric in METRICS if metric in present]


def markdown(record: dict) -> str:
    from ..plan import QAttnPlan

    summary, labels = record["summary"], record["modes"]
    metrics = summary_columns(summary)
    lines = [f"# eval-pipeline — {os.path.basename(os.path.normpath(record['model']['path']))} "
             f"({record['model']['pipeline']}, {record['kind']})", "",
             f"{record['date']}, {record['device']}, {record['dtype']}, seed {record['seed']}, {record['steps']} steps, "
             f"{len(record['prompts'])} prompt(s) × {record['samples_per_prompt']} sample(s); versions "
             + ", ".join(f"{k} {v}" for k, v in record["versions"].items()), "",
             f"Command: `{record['command']}`", "",
             "Every output against the `sdpa` output of the same prompt and seed (`sdpa`: the pipeline unpatched, "
             "full precision, compared with itself). psnr in dB (inf: identical), ssim, frame_cosine (the lowest "
             "frame's cosine similarity): mean and worst (lowest) over the samples; temporal_flickering: VBench's "
             "weight-free score of the mode's own videos (1 = no change between frames). calls: attention calls "
             "served by qattn (all paths), fallbacks: calls that fell back to full precision.", ""]
    headers = ["mode"] + [f"{metric} {stat}" for metric in metrics for stat in ("mean", "worst")] + ["calls",
                                                                                                   "fallbacks"]
    rows = []
    for label in labels:
        stats = record["calls"][label]
        rows.append([label] + [summary[label].get(metric, {}).get(stat) for metric in metrics
                               for stat in ("mean", "worst")]
                    + [sum(stats.get("calls", {}).values()), sum(stats.get("fallbacks", {}).values())])
    lines += _table(headers, rows) + [""]
    for label, plans in record["plan"].items():
        parts = []
        for name, plan in plans.items():
            counts = QAttnPlan.from_dict(plan).count()
            explicit = ", ".join(f"{n} {precision}" for precision, n in counts.items() if n)
            parts.append(f"{name}: " + (f"{explicit} explicit entries, else {plan.get('default') or 'int8'}"
                                        if explicit else f"{plan.get('default')} everywhere"))
        lines.append(f"- plan of `{label}`: " + "; ".join(parts))
    lines += ["", f"Files: `{record['out']}/<mode>/` — " + record["files_note"], ""]
    lines += ["## VBench", ""]
    vbench = record["vbench"]
    if not vbench["dimensions"]:
        lines.append("No dimensions asked for (`--vbench-dimensions none`).")
    else:
        ran = {d: entry for d, entry in vbench["dimensions"].items() if entry["status"] != "skipped"}
        if ran:
            vrows = []
            for dimension, entry in ran.items():
                status = "ran" if not entry.get("failed") else "failed: " + "; ".join(
                    f"{label}: {reason}" for label, reason in entry["failed"].items())
                vrows.append([dimension, status] + [entry["scores"].get(label) for label in labels])
            lines += _table(["dimension", "status"] + labels, vrows) + [""]
        by_reason: dict[str, list[str]] = {}
        for dimension, entry in vbench["dimensions"].items():
            if entry["status"] == "skipped":
                by_reason.setdefault(entry["reason"], []).append(dimension)
        lines += [f"- skipped {', '.join(dimensions)}: {reason}" for reason, dimensions in by_reason.items()]
        if vbench.get("commands"):
            lines += ["", "To score the skipped dimensions where VBench and its weights are installed, run per mode "
                          "folder and dimension, e.g. for the first mode:", "", "```"] + vbench["commands"] + ["```"]
    lines += ["", "## Per prompt", ""]
    present = [m for m in metrics if any(m in row for row in record["rows"])]
    lines += _table(["prompt", "index", "seed", "mode"] + present + ["file"],
                    [[row["prompt"], row["index"], row["seed"], row["mode"]] + [row.get(m) for m in present]
                     + [row.get("file")] for row in record["rows"]])
    return "\n".join(lines) + "\n"


# -- the command -----------------------------------------------------------------------------------

def run_eval_pipeline(args) -> int:
    """Run ``eval-pipeline`` with parsed ``args``; returns the exit status (0 on success)."""
    index = _model_index(args.pipeline_dir)
    prompts = read_prompts(args.prompts)
    _check_names(prompts)
    check_out_dir(args.out)
    if "sdpa" not in args.modes:
        args.modes = ["sdpa", *args.modes]
        print("note: mode sdpa added: it is the reference every mode is compared with")
    options = _call_options(args)
    if args.plan is not None and "plan" not in args.modes:
        raise CLIError("--plan is for mode plan, which --modes does not list")
    plan = _check_plan(args, index) if "plan" in args.modes else None
    if importlib.util.find_spec("diffusers") is None:
        raise CLIError("eval-pipeline needs diffusers: pip install diffusers (or pip install 'hf-qattn[diffusers]')")
    if importlib.util.find_spec("torchmetrics") is None:  # PSNR and SSIM (hf_qattn.evaluation.quality)
        raise CLIError("eval-pipeline needs torchmetrics: pip install torchmetrics (or pip install 'hf-qattn[diffusers]')")
    device = _device(args.device)

    import torch
    import diffusers

    from .. import __version__
    from ..evaluation import pipeline as pipeline_eval
    from ..integrations.diffusers import patch
    from ..plan import PlanError
    from .common import quiet_transformers

    if importlib.util.find_spec("transformers") is not None:
        quiet_transformers()
    diffusers.utils.logging.disable_progress_bar()
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    try:
        pipe = diffusers.DiffusionPipeline.from_pretrained(args.pipeline_dir,
                                                           **{_dtype_argument(): getattr(torch, dtype_name)})
    except Exception as error:  # noqa: BLE001 -- whatever the folder holds, one line says why it does not load
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CLIError(f"PIPELINE_DIR {args.pipeline_dir}: the pipeline does not load: {first}") from None
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    _check_call_options(pipe, options)
    if "plan" in args.modes:
        try:
            with patch(pipe, plan=plan):
                pass  # the plan fits the denoisers (layer count, precisions)
        except (PlanError, ValueError) as error:
            raise CLIError(f"mode 'plan': {error}") from None

    labels = _labels(args.modes)
    writer = pipeline_eval.video_writer()
    calls = [pipeline_eval.Call(name=prompt, index=j, seed=args.seed + i * args.per_prompt + j,
                                kwargs={"prompt": prompt})
             for i, prompt in enumerate(prompts) for j in range(args.per_prompt)]

    def save(label, call, image, kind):
        return os.path.join(label, pipeline_eval.save_sample(os.path.join(args.out, label),
                                                             pipeline_eval.vbench_stem(call.name, call.index),
                                                             image[0], kind, fps=args.fps, writer=writer))

    result = pipeline_eval.run(pipe, calls, args.modes, steps=args.steps, plan=plan, kind=args.kind, save=save,
                               progress=not args.no_progress, **options)

    # VBench: per dimension, run or say why not
    skips = pipeline_eval.vbench_skips(args.vbench_dimensions, result.kind, writer)
    ready = [d for d, reason in skips.items() if reason is None]
    vbench_out = os.path.join(args.out, "vbench")
    scored = pipeline_eval.run_vbench({label: os.path.join(args.out, label) for label in labels}, ready,
                                      vbench_out, device) if ready else {}
    dimensions = {}
    for dimension, reason in skips.items():
        dimensions[dimension] = ({"status": "skipped", "reason": reason} if reason is not None else
                                 {"status": "ran", **scored[dimension]})
    commands = []  # for another environment: the first mode's folder on each dimension VBench could score
    if result.kind == "video" and writer != "png-frames":
        commands = [pipeline_eval.vbench_command(os.path.join(args.out, labels[0]), dimension,
                                                 os.path.join(vbench_out, labels[0]))
                    for dimension, reason in skips.items()
                    if reason is not None and dimension not in pipeline_eval.VBENCH_SUITE_ONLY]
    by_reason: dict[str, list[str]] = {}
    for dimension, entry in dimensions.items():
        if entry["status"] == "skipped":
            by_reason.setdefault(entry["reason"], []).append(dimension)
    for reason, skipped in by_reason.items():  # one line per reason
        print(f"VBench skipped {', '.join(skipped)}: {reason}")

    if result.kind == "image":
        files_note = "`{prompt}-{index}.png`, VBench's naming."
    elif writer == "png-frames":
        files_note = ("videos as PNG frames in `{prompt}-{index}/` folders: neither imageio-ffmpeg nor "
                      "torchvision + PyAV is installed to write `{prompt}-{index}.mp4` (pip install imageio "
                      "imageio-ffmpeg).")
    else:
        files_note = f"`{{prompt}}-{{index}}.mp4` at {args.fps} fps, VBench's naming (written with {writer})."
    versions = {"hf_qattn": __version__, "torch": torch.__version__, "diffusers": diffusers.__version__}
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        versions["transformers"] = transformers.__version__
    if importlib.util.find_spec("vbench") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            versions["vbench"] = version("vbench")
        except PackageNotFoundError:
            versions["vbench"] = "?"
    versions["python"] = platform.python_version()
    denoisers = {name: type(getattr(pipe, name)).__name__ for name in ("transformer", "transformer_2", "unet")
                 if getattr(pipe, name, None) is not None}
    record = {
        "command": command_line(args),
        "model": {"path": args.pipeline_dir, "pipeline": type(pipe).__name__, "denoisers": denoisers},
        "kind": result.kind, "shape": list(result.shape), "modes": labels,
        "plan": result.plans, "versions": versions,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": dtype_name, "seed": args.seed, "steps": args.steps, "samples_per_prompt": args.per_prompt,
        "pipeline_args": options, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "prompts": prompts, "out": args.out, "writer": writer if result.kind == "video" else "png",
        "files_note": files_note, "summary": pipeline_eval.summarize(result.rows, labels),
        "calls": result.stats, "rows": result.rows,
        "vbench": {"dimensions": dimensions, "cache_dir": pipeline_eval.vbench_cache_dir(), "commands": commands},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eval-pipeline.json"), "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    text = markdown(record)
    with open(os.path.join(args.out, "eval-pipeline.md"), "w", encoding="utf-8") as file:
        file.write(text)
    print(text.split("\n## VBench")[0].rstrip())
    print(f"wrote {os.path.join(args.out, 'eval-pipeline.md')} and eval-pipeline.json")
    return 0
