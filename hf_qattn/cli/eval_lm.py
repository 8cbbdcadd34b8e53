"""``hf-qattn eval-lm MODEL_DIR --tasks T [--modes sdpa,int8,int4,plan]``: lm-eval once per attention mode.

The model is loaded once; each mode sets the attention on it and runs lm-eval's Python API
(``lm_eval.simple_evaluate`` on an ``HFLM`` wrapping that model), so every mode sees the same weights,
tokenizer, tasks and seed. Modes:

- ``sdpa``: transformers' SDPA attention (the baseline);
- ``int8`` / ``int4``: qattn with that precision in every layer;
- ``plan``: qattn with the plan in the model's config (``hf-qattn calibrate`` writes it), or ``--plan FILE``.

Writes ``eval-lm.md`` (metric × mode, and each mode's change against the first mode) and
``eval-lm.json`` (every number, with model, plan, versions, device, seed and date) into ``--out``.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path

from .args import CLIError, check_out_dir, positive_int
from .common import first_line

MODES = ("sdpa", "int8", "int4", "plan")


def _modes(text: str) -> list[str]:
    import argparse

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated list of {', '.join(MODES)}; got {text!r}")
    return modes


def add_eval_lm_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval-lm", help="run lm-eval tasks once per attention mode and write a side-by-side table",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("model_dir", type=Path, help="a transformers causal-LM folder (config.json, weights, tokenizer)")
    parser.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    parser.add_argument("--modes", type=_modes, default=list(MODES[:3]),
                        help="comma-separated, from sdpa, int8, int4, plan (default sdpa,int8,int4); "
                             "deltas are against the first; a mode given twice is run twice")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--plan", type=Path, default=None, help="plan JSON for mode 'plan' (default: the model config's)")
    parser.add_argument("--include-path", type=Path, default=None,
                        help="folder of extra task YAMLs (e.g. eval/lm_eval_tasks for wikitext2_local)")
    parser.add_argument("--metadata", default=None, help="JSON passed to the tasks (e.g. '{\"text_file\": \"F\"}')")
    parser.add_argument("--limit", type=positive_int, default=None, help="documents per task at most")
    parser.add_argument("--max-length", type=positive_int, default=None, help="model context for lm-eval's windows")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="lm-eval's batch size: requests scored per forward pass (default 1)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="lm-eval's random, NumPy, torch and few-shot seeds, the same for every mode "
                             "(default 1234)")
    parser.set_defaults(func=run_eval_lm)


def _load_plan(args, config):
    """The plan mode 'plan' runs, checked against the model's layer count before the weights load."""
    import copy

    from ..integrations.transformers.attention import plan_from_config
    from ..plan import PLAN_CONFIG_KEY, PlanError

    if args.plan is not None:
        source = f"--plan {args.plan}"
        try:
            data = json.loads(args.plan.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise CLIError(f"{source}: {error}") from None
        hint = "write one with hf-qattn calibrate, or hf_qattn.QAttnPlan(...).to_dict()"
    else:
        data = getattr(config, PLAN_CONFIG_KEY, None)
        if data is None:
            raise CLIError(f"mode 'plan' needs a plan: {args.model_dir} has no '{PLAN_CONFIG_KEY}' in its config "
                           "(run hf-qattn calibrate first) and no --plan was given")
        source = f"MODEL_DIR {args.model_dir}: config.json's {PLAN_CONFIG_KEY}"
        hint = "re-run hf-qattn calibrate, or pass --plan FILE"
    probe = copy.copy(config)
    setattr(probe, PLAN_CONFIG_KEY, data)
    try:
        return plan_from_config(probe)
    except PlanError as error:
        raise CLIError(f"{source} is invalid: {error} ({hint})") from None


def _check_tasks(tasks: list[str], manager, option_text: str) -> None:
    """Build the tasks once before the model loads, so an unknown name or a task whose data is missing
    (wikitext2_local without its text file) fails now, in one line, not after the weights load."""
    import logging

    def build(names, manager):  # what simple_evaluate calls: TaskManager.load, or get_task_dict in older lm-eval
        if hasattr(manager, "load"):
            return manager.load(names)
        from lm_eval.tasks import get_task_dict

        return get_task_dict(names, manager)

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its notes on building the tasks come again when the first mode runs
    try:
        build(tasks, manager)
    except Exception as error:  # noqa: BLE001 - lm-eval raises KeyError, ValueError, OSError, ...
        message = error.args[0] if isinstance(error, KeyError) and error.args else first_line(error)
        hint = ("; lm_eval ls tasks lists lm-eval's own, and local task YAMLs need --include-path "
                "(e.g. eval/lm_eval_tasks)" if isinstance(error, KeyError) else "")
        raise CLIError(f"--tasks {option_text}: {message}{hint}") from None
    finally:
        logger.setLevel(level)


def _labels(modes: list[str]) -> list[str]:
    """Column names: a mode given twice (e.g. to see run-to-run spread) gets #2, #3, ..."""
    seen: dict[str, int] = {}
    labels = []
    for mode in modes:
        seen[mode] = seen.get(mode, 0) + 1
        labels.append(mode if seen[mode] == 1 else f"{mode}#{seen[mode]}")
    return labels


def _set_mode(model, mode: str, plan) -> None:
    from ..plan import PLAN_CONFIG_KEY, QAttnPlan

    if mode == "sdpa":
        model.set_attn_implementation("sdpa")
        return
    setattr(model.config, PLAN_CONFIG_KEY, plan if mode == "plan" else QAttnPlan(default=mode))
    model.set_attn_implementation("qattn")


def metric_rows(results: dict[str, dict], modes: list[str]) -> list[dict]:
    """One row per (task, metric): each mode's value and its change against the first mode."""
    rows = []
    first = results[modes[0]]
    for task, metrics in first.items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or "," not in key or "_stderr" in key:
                continue  # lm-eval's metrics are "name,filter"; sample counts and stderrs are not compared
            row = {"task": task, "metric": key.split(",")[0]}
            for mode in modes:
                v = results[mode].get(task, {}).get(key)
                row[mode] = v
                if mode != modes[0] and v is not None:
                    row[f"{mode} Δ%"] = 100.0 * (v - value) / value if value else math.nan
            rows.append(row)
    return rows


def markdown(rows: list[dict], modes: list[str]) -> str:
    keys = ["task", "metric", *modes, *[f"{m} Δ%" for m in modes[1:]]]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = []
        for key in keys:
            value = row.get(key)
            cells.append(f"{value:+.3f}" if key.endswith("Δ%") and value is not None else
                         f"{value:.6g}" if isinstance(value, float) else str(value if value is not None else "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_eval_lm(args) -> int:
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise CLIError(f"eval-lm needs lm-eval ({error}): pip install lm-eval") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from .. import __version__, fallback_stats, reset_fallback_stats
    from .common import default_device, load_config, load_model, load_tokenizer, quiet_transformers

    if args.include_path is not None and not args.include_path.is_dir():
        raise CLIError(f"--include-path {args.include_path} is not a folder")
    if args.plan is not None and "plan" not in args.modes:
        raise CLIError(f"--plan {args.plan}: only mode 'plan' uses it, and --modes {','.join(args.modes)} has none")
    metadata = None
    if args.metadata is not None:
        try:
            metadata = json.loads(args.metadata)
        except ValueError as error:
            raise CLIError(f"--metadata is not JSON: {error}") from None
        if not isinstance(metadata, dict):
            raise CLIError(f"--metadata must be a JSON object, e.g. '{{\"text_file\": \"F\"}}'; got {args.metadata!r}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise CLIError(f"--tasks: no task name in {args.tasks!r}")
    check_out_dir(args.out)
    quiet_transformers()
    # everything that can be checked without the weights is, before they load: config, plan, tasks, tokenizer
    config = load_config(args.model_dir)
    plan = _load_plan(args, config) if "plan" in args.modes else None
    manager = TaskManager(include_path=str(args.include_path) if args.include_path else None, metadata=metadata)
    _check_tasks(tasks, manager, args.tasks)
    tokenizer = load_tokenizer(args.model_dir, "lm-eval")
    device = default_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = load_model(AutoModelForCausalLM, args.model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    labels = _labels(args.modes)
    results, stats = {}, {}
    for mode, label in zip(args.modes, labels):
        _set_mode(model, mode, plan)
        reset_fallback_stats()
        print(f"== {label}", flush=True)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, max_length=args.max_length)
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=args.limit,
                                     metadata=metadata, random_seed=args.seed, numpy_random_seed=args.seed,
                                     torch_random_seed=args.seed, fewshot_random_seed=args.seed)
        results[label] = out["results"]
        stats[label] = fallback_stats()
    rows = metric_rows(results, labels)
    record = {
        "model": str(args.model_dir), "tasks": tasks, "modes": labels, "limit": args.limit, "seed": args.seed,
        "plan": plan.to_dict() if plan is not None else None, "device": str(device), "dtype": str(dtype),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "versions": {"hf_qattn": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "lm_eval": getattr(lm_eval, "__version__", "?"), "python": platform.python_version()},
        "results": results, "calls": stats, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval-lm.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    table = markdown(rows, labels)
    header = (f"# lm-eval per attention mode — {args.model_dir.name}\n\n{record['date']}, {device}, {dtype}, "
              f"seed {args.seed}, limit {args.limit}; versions {record['versions']}\n\n")
    (args.out / "eval-lm.md").write_text(header + table + "\n\nCalls by path: " + json.dumps(stats) + "\n",
                                         encoding="utf-8")
    print(table)
    print(f"wrote {args.out / 'eval-lm.md'} and eval-lm.json")
    return 0
