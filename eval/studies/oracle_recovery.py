"""How much of int4's perplexity loss can any per-layer ranking buy back? An oracle bound for issue 13.

    python eval/studies/oracle_recovery.py [--test-windows 2] [--test-len 512] [--ratios 0.1,0.3,0.5]   # ~25 min, CPU

On the *test* windows themselves (so this is a bound, not a calibration: no plan made this way is fair
to report as calibrated), SmolLM2-135M-Instruct's token perplexity is measured with every layer int4
except one at int8, for each layer in turn; the layers are ranked by that gain, and the top ξ share is
put at int8 (the oracle plan). recovery = (ppl_int4 − ppl_plan) / (ppl_int4 − ppl_sdpa). If the oracle
stays under 50 % at ξ = 30 %, no calibration objective that ranks layers one at a time reaches the
issue's target on this model and text size; the bound also shows how far today's objectives are from it.

Writes eval/results/oracle-recovery-cpu-<date>.md (rewritten after every measurement).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

EVAL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EVAL)  # eval/: shared helpers
from calibration_study import perplexity  # noqa: E402  (beside this file)
from wikitext import DATA, DEFAULT_MODEL, windows  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--test-windows", type=int, default=2)
    parser.add_argument("--test-len", type=int, default=512)
    parser.add_argument("--ratios", default="0.1,0.3,0.5")
    parser.add_argument("--rank-on", choices=("test", "valid"), default="test",
                        help="text the layers are ranked on: the test windows (the oracle) or --rank-windows "
                             "WikiText-2 validation windows (a calibration by perplexity gain)")
    parser.add_argument("--rank-windows", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qattn import QAttnPlan

    torch.manual_seed(0)
    date = datetime.date.today().isoformat()
    name = "oracle-recovery" if args.rank_on == "test" else "ppl-gain-calibration"
    out = args.out or os.path.join(EVAL, "results", f"{name}-cpu-{date}.md")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    layers = model.config.num_hidden_layers
    test = windows(tokenizer, os.path.join(DATA, "test.txt"), args.test_windows, args.test_len)
    rank_text = test if args.rank_on == "test" else windows(tokenizer, os.path.join(DATA, "valid.txt"),
                                                            args.rank_windows, args.test_len)
    ppl: dict[str, float] = {}
    gains: dict[int, float] = {}

    def save():
        ranked_on = ("the same windows (an oracle: a bound, not a calibration)" if args.rank_on == "test" else
                     f"{args.rank_windows} WikiText-2 *validation* windows of {args.test_len} tokens (a calibration)")
        lines = [f"# Plan recovery with layers ranked by perplexity gain — SmolLM2-135M-Instruct, CPU reference, {date}",
                 "", f"`python eval/studies/oracle_recovery.py --test-windows {args.test_windows} --test-len {args.test_len} "
                 f"--rank-on {args.rank_on}`: token perplexity on WikiText-2 *test* windows; each layer alone at int8 "
                 f"(rest int4), ranked by its perplexity on {ranked_on}.", ""]
        lines += ["| mode | token perplexity | recovery of int4's increase |", "|---|---|---|"]
        base, worst = ppl.get("sdpa"), ppl.get("int4")
        for name, value in ppl.items():
            rec = "" if base is None or worst is None or name in ("sdpa", "int4") else \
                f"{100 * (worst - value) / (worst - base):.1f} %"
            lines.append(f"| {name} | {value:.4f} | {rec} |")
        if gains and worst is not None:
            lines += ["", "Per layer, perplexity with that layer alone at int8 (rest int4) on the ranking text, and "
                      "(with --rank-on test) its share of int4's increase recovered:", "", "| layer | ppl | recovery |",
                      "|---|---|---|"]
            for layer, value in sorted(gains.items()):
                rec = f"{100 * (worst - value) / (worst - base):.1f} %" if args.rank_on == "test" else ""
                lines.append(f"| {layer} | {value:.4f} | {rec} |")
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def measure(name, impl, plan, text=None):
        value, seconds = perplexity(model, test if text is None else text, impl, plan)
        print(f"{name}: {value:.4f} ({seconds:.0f} s)", flush=True)
        return value

    ppl["sdpa"] = measure("sdpa", "sdpa", None)
    ppl["int4"] = measure("int4", "qattn", QAttnPlan(default="int4", num_layers=layers).to_dict())
    save()
    for layer in range(layers):
        plan = QAttnPlan(default="int4", layers={layer: "int8"}, num_layers=layers).to_dict()
        gains[layer] = measure(f"layer {layer} int8", "qattn", plan, rank_text)
        save()
    for ratio in (float(r) for r in args.ratios.split(",") if r):
        ranking = {layer: value for layer, value in gains.items()}  # lowest ppl (largest gain) first → int8
        plan = QAttnPlan.from_scores(ranking, ratio, num_layers=layers)
        label = f"{'oracle' if args.rank_on == 'test' else 'ppl-gain plan'} ξ={ratio:g}"
        ppl[label] = measure(label, "qattn", plan.to_dict())
        save()
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
