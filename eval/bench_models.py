"""Model-level timing on a CUDA GPU: a Llama-shaped LLM prefill and a Wan-shaped video denoiser.

    python eval/bench_models.py [--out eval/results/models-<gpu>-<date>.md] [--tiny]

Random weights built from configs (no downloads), bf16:
  * Llama-shaped: Llama-3-8B layer sizes (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    MLP 14336), 8 layers, one prompt of each ``--llama-tokens`` count (default 4096); time of one
    prefill forward with SDPA, qattn-8b as shipped (calls below the kernels' break-even run SDPA:
    hf_qattn.support.below_break_even) and qattn-8b with the kernels at every length
    (HF_QATTN_BREAK_EVEN=0); at the first count also qattn-4b and a calibrated mix (hf_qattn.calibrate,
    ratio 0.3, on two random-token prompts), both with the kernels at every length; plus the logits'
    cosine to the SDPA run.
  * Wan-shaped: Wan2.1-T2V-1.3B sizes (30 blocks, 12 heads × 128, FFN 8960), a 13×60×88 latent
    (17,160 video tokens) with 512 text tokens; time of one transformer call (a CFG denoising step
    makes two) with SDPA, qattn-8b as shipped (the cross-attention over 512 text tokens is below the
    break-even: SDPA) and with the kernels at every length, qattn-4b and a mix calibrated by
    hf_qattn.calibrate_pipeline (ratio 0.3, one prompt, 4 steps), plus the prediction's cosine to the SDPA run.
Times are medians of CUDA-event-timed calls after warm-up. ``--tiny`` shrinks everything so the
script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics

import torch

import hf_qattn
from hf_qattn import QAttnPlan

from timing import events_ms  # eval/timing.py
import report  # noqa: E402  (eval/report.py)


ROUNDS = 5  # the Llama modes take turns this many times


def log(*args):
    print(*args, flush=True)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def llama(device, dtype, tiny: bool, repeats: int, lengths: list[int]):
    import transformers

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, vocab_size=256) if tiny else dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=8, vocab_size=32000)
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=2 * max(lengths))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    n = config.num_hidden_layers
    rows = []
    for tokens in lengths:
        ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
        int8 = QAttnPlan(default="int8", num_layers=n)
        modes = {"sdpa": ("sdpa", None, True), "qattn-8b": ("qattn", int8, True),
                 "qattn-8b, kernels at every length": ("qattn", int8, False)}
        if tokens == lengths[0]:
            modes["qattn-4b, kernels at every length"] = ("qattn", QAttnPlan(default="int4", num_layers=n), False)
            model.set_attn_implementation("qattn")
            calib = [{"input_ids": torch.randint(0, config.vocab_size, (1, tokens), device=device)} for _ in range(2)]
            plan, _ = hf_qattn.calibrate(model, calib, ratio=0.3, progress=False)
            modes[f"mix ({plan.count()['int8']}/{n} int8), kernels at every length"] = ("qattn", plan, False)

        def use(implementation, plan, break_even):
            model.set_attn_implementation(implementation)
            if plan is None:
                model.config.__dict__.pop("qattn_plan", None)
            else:
                model.config.qattn_plan = plan.to_dict()
            os.environ["HF_QATTN_BREAK_EVEN"] = "1" if break_even else "0"

        logits, paths, samples = {}, {}, {name: [] for name in modes}
        for name, mode in modes.items():
            use(*mode)
            hf_qattn.reset_fallback_stats()
            with torch.no_grad():
                logits[name] = model(ids).logits.float()
            paths[name] = "/".join(sorted(hf_qattn.fallback_stats()["calls"])) or "(transformers' own)"
        # the modes in turns (ROUNDS of them, the median kept): the host of a lent machine drifts within a run
        for _ in range(ROUNDS):
            for name, mode in modes.items():
                use(*mode)
                with torch.no_grad():
                    samples[name].append(events_ms(lambda: model(ids), repeats=repeats, warmup=1))
        ms = {name: statistics.median(values) for name, values in samples.items()}
        for name in modes:
            rows.append({"model": f"Llama-shaped {n}L", "tokens": tokens, "attention": name, "paths": paths[name],
                         "ms/forward": ms[name], "×sdpa": ms["sdpa"] / ms[name],
                         "cos vs sdpa": cosine(logits[name], logits["sdpa"])})
            log("   ", rows[-1])
    os.environ.pop("HF_QATTN_BREAK_EVEN", None)
    return rows


def wan(device, dtype, tiny: bool, repeats: int):
    import diffusers

    sizes = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
                 freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32) if tiny else dict(
        num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
        ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=1024)
    latent = (1, sizes["in_channels"], 3, 8, 8) if tiny else (1, 16, 13, 60, 88)
    text_tokens, text_dim = (8, 32) if tiny else (512, 4096)
    with torch.device(device):
        transformer = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), **sizes).to(dtype).eval()
    video_tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    x = torch.randn(latent, device=device, dtype=dtype)
    text = torch.randn(1, text_tokens, text_dim, device=device, dtype=dtype)
    timestep = torch.tensor([500.0], device=device)
    rows, outs = [], {}

    def call():
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

    def timed(name, plan, break_even=True):
        handle = hf_qattn.patch(transformer, plan=plan) if plan is not None else None
        before = os.environ.get("HF_QATTN_BREAK_EVEN")
        os.environ["HF_QATTN_BREAK_EVEN"] = "1" if break_even else "0"
        try:
            with torch.no_grad():
                outs[name] = call().float()
                ms = events_ms(call, repeats=repeats, warmup=2)
        finally:
            if before is None:
                os.environ.pop("HF_QATTN_BREAK_EVEN")
            else:
                os.environ["HF_QATTN_BREAK_EVEN"] = before
        if handle is not None:
            hf_qattn.unpatch(transformer)
        rows.append({"model": f"Wan-shaped {sizes['num_layers']} blocks", "tokens": video_tokens, "attention": name,
                     "ms/transformer call": ms, "cos vs sdpa": cosine(outs[name], outs["sdpa"])})
        log("   ", rows[-1])

    timed("sdpa", None)
    timed("qattn-8b", QAttnPlan(default="int8"))  # as shipped: calls below the break-even (the cross-attention) SDPA
    timed("qattn-8b, kernels at every length", QAttnPlan(default="int8"), break_even=False)
    timed("qattn-4b", QAttnPlan(default="int4"))
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    steps = 4
    with torch.no_grad():
        result = hf_qattn.calibrate_pipeline(
            pipe, [dict(prompt_embeds=text, negative_prompt_embeds=torch.randn_like(text))],
            num_inference_steps=steps, ratio=0.3, height=latent[3] * 8, width=latent[4] * 8,
            num_frames=(latent[2] - 1) * 4 + 1, guidance_scale=5.0, output_type="latent")
    plan = result.plan
    # time the mix at the plan's first step (the bare transformer starts counting at step 0)
    timed(f"mix ({plan.count()['int8']}/{sum(plan.count().values())} (step, layer) int8)", plan)
    return rows


def markdown(rows):
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[k]:.4f}" if isinstance(row.get(k), float) and k.startswith("cos")
                                        else f"{row[k]:.2f}" if isinstance(row.get(k), float) and k.startswith("×")
                                        else f"{row[k]:.1f}" if isinstance(row.get(k), float)
                                        else str(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, for a CPU check of the script")
    parser.add_argument("--only", choices=["llama", "wan"], default=None)
    parser.add_argument("--llama-tokens", default=None, help="prompt lengths of the Llama-shaped model, comma-"
                        "separated (default 4096; 64 with --tiny)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    repeats = 3 if args.tiny else 10
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    date = datetime.date.today().isoformat()
    import transformers

    header = (f"{name}, {date}, torch {torch.__version__}, transformers {transformers.__version__}, "
              f"python {platform.python_version()}, hf_qattn {hf_qattn.__version__}")
    try:
        import diffusers
        header += f", diffusers {diffusers.__version__}"
    except ImportError:
        pass
    log(header)
    sections = [f"# Model-level timing — {name}\n\n{header}\n\nProduced by `python eval/bench_models.py`; see its "
                "docstring for the models. Random weights, bf16, medians of CUDA-event-timed calls.\n"]
    hf_qattn.reset_fallback_stats()
    for which, fn in (("llama", llama), ("wan", wan)):
        if args.only and args.only != which:
            continue
        log(f"== {which}")
        if which == "llama":
            lengths = [int(x) for x in (args.llama_tokens or ("64" if args.tiny else "4096")).split(",")]
            rows = fn(device, dtype, args.tiny, repeats, lengths)
        else:
            rows = fn(device, dtype, args.tiny, repeats)
        sections.append(markdown(rows))
    sections.append(f"Calls by path and fallbacks during the run: `{hf_qattn.fallback_stats()}`\n")
    log(sections[-1])
    out = report.write(report.result_path("models", args.out), "\n".join(sections))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
