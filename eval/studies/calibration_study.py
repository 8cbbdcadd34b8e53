"""Which calibration objective earns its 8-bit layers? Per-layer attention score vs end-to-end KL, and plan perplexity.

    python eval/studies/calibration_study.py                       # SmolLM2-135M-Instruct, CPU: ~20 min on 2 cores
    python eval/studies/calibration_study.py --ratios 0.3 --test-windows 2 --test-len 512
    python eval/studies/calibration_study.py --objectives ppl-gain --cal-windows 16 --cal-len 512 --test-windows 8 \
        --chunks 4 --batch-size 1                       # ppl-gain vs attention, and recovery vs calibration text

1. Calibrates SmolLM2 on ``--cal-windows`` windows of ``--cal-len`` tokens of WikiText-2 *validation* text with
   ``attention`` (CosSim·(1 − RelL1) of each layer's INT4 attention output) and the ``--objectives`` of
   ``hf_qattn.calibrate`` (default ``logit-kl``: KL of the final next-token distribution with that layer alone
   at int4; also ``logit-kl-gain``, ``ppl-gain``).
2. Reports them per layer and their Spearman rank correlation with attention (attention score taken as
   1 − score, so that all read "higher = int8 first").
3. Perplexity on ``--test-windows`` windows of ``--test-len`` tokens of WikiText-2 *test* text, computed
   directly with the model's loss (token-level, not lm-eval's word perplexity: fast, comparable between
   modes only): sdpa, int8 everywhere, int4 everywhere, and each objective's plan at every ``--ratios`` value;
   recovery = (ppl_int4 − ppl_plan) / (ppl_int4 − ppl_sdpa).
4. With ``--chunks K``: the calibration windows are split into K interleaved chunks (chunk k: windows k, k + K,
   …, so each is spread over the whole text) and ``hf_qattn.calibrate`` runs on each chunk separately. A
   set of chunks' per-layer score is the token-weighted mean of theirs — exactly what ``calibrate`` computes
   on their union (it sums over batches and divides by the tokens; ``worst`` is the max), so the main plans
   (all chunks) cost nothing extra, and the data-amount curve does: recovery at ``--curve-ratio`` of the plan
   made from every single chunk, every group of 2, 4, … chunks (disjoint), up to all of them.

Writes eval/results/calibration-study-cpu-<date>.md (rewritten after every measurement, so a cut-short run
keeps what it measured) and a JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EVAL = os.path.dirname(HERE)
sys.path.insert(0, EVAL)  # eval/: shared helpers
from wikitext import DATA, DEFAULT_MODEL, windows  # noqa: E402


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def perplexity(model, test, impl: str, plan: dict | None) -> tuple[float, float]:
    """(token perplexity over all windows, seconds): mean next-token NLL from the model's own loss."""
    import torch

    from hf_qattn.plan import PLAN_CONFIG_KEY

    started = time.perf_counter()
    if plan is None:
        if hasattr(model.config, PLAN_CONFIG_KEY):
            delattr(model.config, PLAN_CONFIG_KEY)
    else:
        setattr(model.config, PLAN_CONFIG_KEY, plan)
    model.set_attn_implementation(impl)
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in test:
            ids = row[None]
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            nll += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    model.set_attn_implementation("sdpa")
    return math.exp(nll / count), time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--cal-windows", type=int, default=2)
    parser.add_argument("--cal-len", type=int, default=256)
    parser.add_argument("--test-windows", type=int, default=2)
    parser.add_argument("--test-len", type=int, default=512)
    parser.add_argument("--ratios", default="0.3,0.1,0.5", help="ξ values, in the order they are measured")
    parser.add_argument("--objectives", default="attention,logit-kl",
                        help="comma list of hf_qattn.calibrate objectives (attention is always included)")
    parser.add_argument("--chunks", type=int, default=1,
                        help="calibrate on this many interleaved chunks of the calibration windows separately; "
                             "with K > 1, the recovery curve over 1, 2, 4, … chunks")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="calibrate's batch_size (the CPU reference runs 1 × 512 tokens far faster per token "
                             "than batches of several)")
    parser.add_argument("--curve-ratio", type=float, default=0.3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_qattn
    from hf_qattn import QAttnPlan

    torch.manual_seed(0)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(EVAL, "results", f"calibration-study-cpu-{date}.md")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    num_layers = model.config.num_hidden_layers
    cal = windows(tokenizer, os.path.join(DATA, "valid.txt"), args.cal_windows, args.cal_len)
    test = windows(tokenizer, os.path.join(DATA, "test.txt"), args.test_windows, args.test_len)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = "?"
    state: dict = {"date": date, "model": args.model, "layers": num_layers, "commit": commit,
                   "calibration": f"{args.cal_windows} WikiText-2 validation windows × {args.cal_len} tokens"
                                  + (f" in {args.chunks} interleaved chunks, each calibrated separately"
                                     if args.chunks > 1 else "") + f" (calibrate batch_size={args.batch_size})",
                   "test": f"{args.test_windows} WikiText-2 test windows × {args.test_len} tokens",
                   "versions": {"hf_qattn": hf_qattn.__version__, "torch": torch.__version__,
                                "transformers": transformers.__version__, "python": platform.python_version()},
                   "threads": torch.get_num_threads(), "objectives": {}, "ppl": {}, "curve": {},
                   "chunks": args.chunks, "curve_ratio": args.curve_ratio, "batch_size": args.batch_size}

    def save():
        write_report(out, state)

    objectives = ["attention"] + [o for o in args.objectives.split(",") if o and o != "attention"]
    if args.chunks < 1 or args.cal_windows % args.chunks:
        raise SystemExit("--chunks must divide --cal-windows")
    chunks = [cal[k :: args.chunks] for k in range(args.chunks)]
    parts: dict[str, list] = {}  # objective → one CalibrationResult per chunk

    def weight(result):
        first = next(iter(result.scores.values()))
        return getattr(first, "tokens", first.count)  # ppl-gain / logit-kl: tokens; attention: sequences

    def combined(objective, which):
        """Per-layer means over the chunks ``which``: what calibrate returns on their union."""
        chosen = [parts[objective][k] for k in which]
        total = sum(weight(r) for r in chosen)
        layers = sorted(chosen[0].scores)
        return {l: sum(weight(r) * r.scores[l].mean for r in chosen) / total for l in layers}

    for objective in objectives:
        parts[objective] = []
        for k, chunk in enumerate(chunks):
            print(f"calibrating: {objective}" + (f", chunk {k + 1}/{args.chunks}" if args.chunks > 1 else ""), flush=True)
            result = hf_qattn.calibrate(model, chunk, 0.3, objective=objective, batch_size=args.batch_size,
                                        progress=True)
            parts[objective].append(result)
        results = parts[objective]
        means = combined(objective, range(args.chunks))
        state["objectives"][objective] = entry = {
            "forwards": sum(r.forwards for r in results), "seconds": round(sum(r.seconds for r in results), 1),
            "per_layer": {str(l): [means[l], max(r.scores[l].worst for r in results)] for l in means}}
        if args.chunks > 1:
            entry["per_chunk"] = [{str(l): s.mean for l, s in sorted(r.scores.items())} for r in results]
        if objective == "ppl-gain":
            total = sum(weight(r) for r in results)
            firsts = [next(iter(r.scores.values())) for r in results]
            entry["nll_int4"] = sum(weight(r) * f.nll_int4 for r, f in zip(results, firsts)) / total
            entry["nll_full"] = sum(weight(r) * f.nll_full for r, f in zip(results, firsts)) / total
            entry["recovery"] = {str(l): means[l] / (entry["nll_int4"] - entry["nll_full"]) for l in means}
        save()
    attn = combined("attention", range(args.chunks))
    state["spearman"] = {}
    for objective in objectives[1:]:
        other = combined(objective, range(args.chunks))
        layers = sorted(other)
        state["spearman"][objective] = spearman([1 - attn[l] for l in layers], [other[l] for l in layers])
    save()

    def ranking(objective, which=None):
        means = combined(objective, range(args.chunks) if which is None else which)
        return {l: (v if objective == "attention" else -v) for l, v in means.items()}  # lowest → int8

    def measure(name, impl, plan, record=True):
        ppl, seconds = perplexity(model, test, impl, plan)
        entry = {"ppl": ppl, "seconds": round(seconds, 1),
                 "int8_layers": sorted(l for l, p in (QAttnPlan.from_dict(plan).layers.items()
                                                      if plan else []) if p == "int8")}
        if record:
            state["ppl"][name] = entry
            save()
        print(f"{name}: ppl {ppl:.4f} ({seconds:.0f} s)", flush=True)
        return entry

    measure("sdpa", "sdpa", None)
    measure("int4", "qattn", QAttnPlan(default="int4", num_layers=num_layers).to_dict())
    for ratio in ratios:
        for objective in objectives:
            plan = QAttnPlan.from_scores(ranking(objective), ratio, num_layers=num_layers)
            measure(f"{objective} ξ={ratio:g}", "qattn", plan.to_dict())
        if ratio == ratios[0]:
            measure("int8", "qattn", QAttnPlan(default="int8", num_layers=num_layers).to_dict())

    # data-amount curve: recovery at --curve-ratio of plans made from 1, 2, 4, … chunks (disjoint groups)
    if args.chunks > 1:
        per_chunk = args.cal_windows // args.chunks
        size = 1
        while size <= args.chunks:
            for objective in objectives:
                points = state["curve"].setdefault(objective, {}).setdefault(str(size * per_chunk), [])
                for first in range(0, args.chunks - size + 1, size):
                    which = range(first, first + size)
                    if size == args.chunks and f"{objective} ξ={args.curve_ratio:g}" in state["ppl"]:
                        entry = state["ppl"][f"{objective} ξ={args.curve_ratio:g}"]  # the main plan, measured above
                    else:
                        plan = QAttnPlan.from_scores(ranking(objective, which), args.curve_ratio, num_layers=num_layers)
                        entry = measure(f"{objective}, chunks {list(which)} ξ={args.curve_ratio:g}", "qattn",
                                        plan.to_dict(), record=False)
                    points.append({**entry, "chunks": list(which),
                                   "forwards": sum(parts[objective][k].forwards for k in which),
                                   "seconds_cal": round(sum(parts[objective][k].seconds for k in which), 1)})
                    save()
            size *= 2
    return 0


def write_report(path: str, state: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.path.splitext(path)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    lines = [f"# Calibration objectives on {os.path.basename(state['model'])} (cpu, {state['date']})", "",
             "Produced by `python eval/studies/calibration_study.py` (" + " ".join(sys.argv[1:]) + ")", "",
             f"- model: `{os.path.basename(state['model'])}`, {state['layers']} layers, float32",
             f"- calibration: {state['calibration']} (all objectives on the same tokens)",
             f"- test: {state['test']}; token-level perplexity from the model's own loss (not lm-eval's word "
             "perplexity: compare rows of this table only); short test text, so differences under ~0.3 % are noise",
             f"- device: CPU ({platform.machine()}, {state['threads']} threads, shared with other jobs); qattn on the "
             "PyTorch reference of the kernels' math",
             f"- versions: {state['versions']}; commit {state['commit']} plus this change", ""]
    objectives = state["objectives"]
    if objectives:
        lines.append("## Cost")
        lines.append("")
        lines.append("| objective | forwards | seconds |")
        lines.append("|---|---|---|")
        for name, entry in objectives.items():
            lines.append(f"| {name} | {entry['forwards']} | {entry['seconds']} |")
        lines.append("")
    if "attention" in objectives and state.get("spearman"):
        names = [n for n in objectives if n in state["spearman"] or n == "attention"]
        per = {n: objectives[n]["per_layer"] for n in names}
        ranks = {n: {l: r for r, l in enumerate(sorted(per[n], key=lambda l: per[n][l][0] * (1 if n == "attention"
                                                                                             else -1)), 1)}
                 for n in names}
        lines += ["## Per layer", ""]
        for n, rho in state["spearman"].items():
            lines.append(f"Spearman rank correlation of (1 − attention score) with {n}: **{rho:+.3f}** "
                         "(1: the attention score orders the layers exactly as that end-to-end measure).")
        units = {"attention": "attention score (mean)", "logit-kl": "logit KL, nats/token (mean)",
                 "logit-kl-gain": "KL drop when int8, nats/token (mean)",
                 "ppl-gain": "NLL drop when int8, nats/token (mean)"}
        lines += ["", "| layer | " + " | ".join(f"{units.get(n, n)} | rank (worst = 1)" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        for l in sorted(per["attention"], key=int):
            cells = " | ".join(f"{per[n][l][0]:.6f} | {ranks[n][l]}" for n in names if l in per[n])
            lines.append(f"| {l} | {cells} |")
        lines.append("")
    ppl = state["ppl"]
    if ppl:
        base, int4 = ppl.get("sdpa", {}).get("ppl"), ppl.get("int4", {}).get("ppl")
        lines += ["## Perplexity on the test windows", "",
                  "| mode | token perplexity | Δ vs sdpa | recovery of int4's increase | int8 layers | seconds |",
                  "|---|---|---|---|---|---|"]
        for name, entry in ppl.items():
            delta = f"{100 * (entry['ppl'] / base - 1):+.2f} %" if base else ""
            recovery = ""
            if base and int4 and name not in ("sdpa", "int4") and int4 != base:
                recovery = f"{100 * (int4 - entry['ppl']) / (int4 - base):.0f} %"
            layers = ", ".join(str(l) for l in entry["int8_layers"]) if 0 < len(entry["int8_layers"]) < state["layers"] else ""
            lines.append(f"| {name} | {entry['ppl']:.4f} | {delta} | {recovery} | {layers} | {entry['seconds']} |")
        lines.append("")
    curve = state.get("curve")
    if curve and ppl.get("sdpa") and ppl.get("int4"):
        base, int4 = ppl["sdpa"]["ppl"], ppl["int4"]["ppl"]
        counts = sorted({int(c) for points in curve.values() for c in points})
        lines += ["## Recovery vs calibration text", "",
                  "Plans from n calibration windows (disjoint groups of the interleaved chunks, so each group is "
                  "spread over the validation text), each measured on the same test windows at ξ = "
                  f"{state.get('curve_ratio', 0.3):g}. Cell: recovery of int4's increase of every group (their mean); "
                  "calibration forwards and seconds per group.", "",
                  "| objective | " + " | ".join(f"n = {c}" for c in counts) + " |", "|---|" + "---|" * len(counts)]
        for name, points in curve.items():
            cells = []
            for c in counts:
                group = points.get(str(c), [])
                if not group:
                    cells.append("")
                    continue
                rec = [100 * (int4 - g["ppl"]) / (int4 - base) for g in group]
                text = ", ".join(f"{r:.0f} %" for r in rec)
                if len(rec) > 1:
                    text += f" (mean {sum(rec) / len(rec):.0f} %)"
                cells.append(f"{text}; {group[0]['forwards']} fw, {group[0]['seconds_cal']} s")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
