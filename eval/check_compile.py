"""torch.compile check on a CUDA GPU: graph breaks, compiled vs eager agreement, CUDA graphs, timings.

    python eval/check_compile.py --out eval/results           # ~5-7 min on an H100; exits 1 if a case fails

Cases (each in its own try/except, so one failure does not hide the others):

- Llama-shaped model (random weights, Llama-3-8B widths: 32 heads / 8 KV heads, head dim 128, bf16;
  --layers of them, 4 by default) with attn_implementation="qattn":
  * prefill: graph breaks under ``torch._dynamo.explain`` (expect 0), compiled (fullgraph) vs eager
    logits, ``mode="reduce-overhead"`` runs twice and agrees, timings of compiled SDPA vs compiled qattn;
  * decode: ``generate(..., cache_implementation="static")`` (transformers compiles the decode step),
    graph breaks of one static-cache decode step, its tokens vs eager static-cache generate, and
    the per-token time with SDPA vs qattn;
- Wan- and Flux-shaped denoisers (if diffusers is importable; 2 blocks of real widths, random weights)
  patched with ``hf_qattn.patch``: graph breaks, compiled vs eager, reduce-overhead, timings.

Agreement: the op alone (``qattn op``: the kernels are deterministic) must be bit-identical compiled,
under CUDA graphs and eager. In a model, compiling also fuses and reorders the other ops, so the bar
there is what compiling does to the same model with SDPA: qattn's compiled-vs-eager gap at most 1.5×
SDPA's (+1e-3); for decode, the fraction of identical greedy tokens. The table is printed last and written
as markdown under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

# the installed package (eval/device_run.sh installs the wheel: the source tree has no hf_qattn.kernels)
import transformers

import hf_qattn
from hf_qattn.kv_cache.captured import cache_argument

import report  # eval/report.py
from timing import events_ms  # eval/timing.py

# this checks the kernels, at lengths where the transformers integration would otherwise hand calls to SDPA
# (hf_qattn.support.below_break_even)
os.environ.setdefault("HF_QATTN_BREAK_EVEN", "0")

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before

ROWS: list[dict] = []
FAILED: list[str] = []


def row(case: str, **fields) -> None:
    ROWS.append(dict(case=case, **fields))
    print(f"[{case}] " + ", ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def timed(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() (CUDA events), as the model benchmark times."""
    return events_ms(fn, repeats=iters, warmup=warmup)


def breaks(fn, *args, **kwargs) -> tuple[int, str]:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = "; ".join(sorted({str(b.reason).splitlines()[0][:120] for b in explanation.break_reasons}))
    torch._dynamo.reset()
    return explanation.graph_break_count, reasons


def case(name):
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001  (every case reports, none hides the others)
                traceback.print_exc()
                FAILED.append(name)
                row(name, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}")
            finally:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        return run
    return wrap


# -- Llama ------------------------------------------------------------------------------------------

def llama(attn: str, layers: int):
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=4096, intermediate_size=8192, num_hidden_layers=layers, vocab_size=32000,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.eval()


@case("qattn op")
def qattn_op(args):
    """The op alone, compiled (fullgraph) and replayed from a CUDA graph, against eager on the same
    inputs: the kernels are deterministic, so the outputs must be bit-identical."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    end = torch.tensor([1000, 700], device="cuda", dtype=torch.int32)

    def fn(q, k, v, end):
        return hf_qattn.qattn(q, k, v, is_causal=True, kv_end=end)

    with torch.no_grad():
        count, reasons = breaks(fn, q, k, v, end)
        eager = fn(q, k, v, end)
        got = torch.compile(fn, fullgraph=True)(q, k, v, end)
        torch._dynamo.reset()
        cg = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        cg(q, k, v, end)
        cg(q, k, v, end)
        cg_out = cg(q, k, v, end).clone()
        torch._dynamo.reset()
    row("qattn op", shape="B2 Hq8 Hk2 N1000 d128 causal kv_end bf16", graph_breaks=count, break_reasons=reasons,
        compiled_vs_eager="bit-identical" if torch.equal(got, eager) else f"{rel(got, eager):.2e}",
        cudagraph_vs_eager="bit-identical" if torch.equal(cg_out, eager) else f"{rel(cg_out, eager):.2e}")
    if count or not (torch.equal(got, eager) and torch.equal(cg_out, eager)):
        FAILED.append("qattn op")


@case("llama prefill")
def llama_prefill(args):
    batch, seq = 1, args.prefill
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    results = {}
    for attn in ("sdpa", "qattn"):
        model = llama(attn, args.layers)

        def forward(ids):
            return model(input_ids=ids, use_cache=False).logits

        with torch.no_grad():
            count, reasons = breaks(forward, ids) if attn == "qattn" else (None, "")
            eager = forward(ids)
            compiled = torch.compile(forward, fullgraph=True)
            got = compiled(ids)
            ms = timed(lambda: compiled(ids))
            eager_ms = timed(lambda: forward(ids))
            torch._dynamo.reset()
            cg = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
            cg(ids)
            cg(ids)
            cg_out = cg(ids).clone()
            cg_ms = timed(lambda: cg(ids))
        results[attn] = dict(eager=eager.float().cpu(), compiled=got.float().cpu(), cg=cg_out.float().cpu(),
                             ms=ms, cg_ms=cg_ms, eager_ms=eager_ms, breaks=count, reasons=reasons)
        del model, compiled, cg
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    q, s = results["qattn"], results["sdpa"]
    row("llama prefill", shape=f"B{batch} N{seq} L{args.layers}", graph_breaks=q["breaks"], break_reasons=q["reasons"],
        compiled_vs_eager=f"{rel(q['compiled'], q['eager']):.2e}", cudagraph_vs_eager=f"{rel(q['cg'], q['eager']):.2e}",
        sdpa_compiled_vs_eager=f"{rel(s['compiled'], s['eager']):.2e}", qattn_vs_sdpa=f"{rel(q['eager'], s['eager']):.2e}",
        sdpa_ms=f"eager {s['eager_ms']:.2f} / compiled {s['ms']:.2f} / cudagraph {s['cg_ms']:.2f}",
        qattn_ms=f"eager {q['eager_ms']:.2f} / compiled {q['ms']:.2f} / cudagraph {q['cg_ms']:.2f}")
    # compile reorders and fuses the model's other ops too: qattn's compiled-vs-eager gap must stay within
    # what compiling does to the same model with SDPA (the op itself is checked alone in "qattn op")
    if q["breaks"] or not rel(q["compiled"], q["eager"]) <= 1.5 * rel(s["compiled"], s["eager"]) + 1e-3:
        FAILED.append("llama prefill")


@case("llama static decode")
def llama_decode(args):
    import transformers as tf

    batch, prompt, new = 1, args.prompt, args.new_tokens
    ids = torch.randint(0, 32000, (batch, prompt), device="cuda")
    results = {}
    for attn in ("sdpa", "qattn"):
        model = llama(attn, args.layers)
        model.generation_config.pad_token_id = 0
        opts = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        with torch.no_grad():
            count, reasons = None, ""
            if attn == "qattn":  # one static-cache decode step, as generate compiles it
                cache = tf.StaticCache(config=model.config, max_cache_len=prompt + new)
                logits = model(input_ids=ids, **{CACHE_KW: cache}, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                position = torch.tensor([prompt], device="cuda")

                def step(token, position):
                    return model(input_ids=token, **{CACHE_KW: cache}, cache_position=position,
                                 use_cache=True).logits

                count, reasons = breaks(step, token, position)
            eager = model.generate(ids, **opts, disable_compile=True)
            compiled = model.generate(ids, **opts)  # transformers compiles the decode step ("reduce-overhead")
            compiled = model.generate(ids, **opts)
            # ms a token of generate itself: (one call of `new` tokens − one of 2) / (new − 2), host clock
            # around whole calls (prefill and per-call setup cancel out), not a loop of identical calls
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, **opts)
            torch.cuda.synchronize()
            total = time.perf_counter() - start
            short = dict(opts, max_new_tokens=2, min_new_tokens=2)
            model.generate(ids, **short)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, **short)
            torch.cuda.synchronize()
            per_token = (total - (time.perf_counter() - start)) / (new - 2) * 1e3
        results[attn] = dict(eager=eager[:, prompt:].cpu(), compiled=compiled[:, prompt:].cpu(), ms=per_token,
                             breaks=count, reasons=reasons)
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    q, s = results["qattn"], results["sdpa"]
    same = float((q["compiled"] == q["eager"]).float().mean())
    row("llama static decode", shape=f"B{batch} prompt {prompt} +{new} L{args.layers}", graph_breaks=q["breaks"],
        break_reasons=q["reasons"], compiled_vs_eager=f"{same:.0%} tokens equal",
        qattn_vs_sdpa=f"{float((q['eager'] == s['eager']).float().mean()):.0%} tokens equal",
        sdpa_ms=f"compiled {s['ms']:.3f}/token", qattn_ms=f"compiled {q['ms']:.3f}/token")
    if q["breaks"] or same < 0.9:
        FAILED.append("llama static decode")


# -- denoisers -------------------------------------------------------------------------------------

def wan(device):
    import diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                            in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                                            ffn_dim=8960, num_layers=2, rope_max_seq_len=1024)
    model = model.to(device, torch.bfloat16).eval()
    # 480x832, 21 latent frames would be 32760 tokens; a quarter of that keeps the check short
    x = torch.randn(1, 16, 5, 60, 104, device=device, dtype=torch.bfloat16)
    inputs = dict(hidden_states=x, timestep=torch.tensor([500.0], device=device),
                  encoder_hidden_states=torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16))
    return model, inputs


def flux(device):
    import diffusers

    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                             pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    model = model.to(device, torch.bfloat16).eval()
    tokens, text = 4096, 512  # 1024x1024
    inputs = dict(hidden_states=torch.randn(1, tokens, 64, device=device, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=torch.bfloat16),
                  pooled_projections=torch.randn(1, 768, device=device, dtype=torch.bfloat16),
                  timestep=torch.tensor([0.5], device=device), guidance=torch.tensor([3.5], device=device),
                  img_ids=torch.zeros(tokens, 3, device=device), txt_ids=torch.zeros(text, 3, device=device))
    return model, inputs


def denoiser_case(name, build):
    @case(name)
    def run(args):
        model, inputs = build("cuda")

        def forward(**inputs):
            return model(**inputs, return_dict=False)[0]

        out = {}
        with torch.no_grad():
            ref_eager = forward(**inputs)
            compiled = torch.compile(forward, fullgraph=False)
            ref_compiled = compiled(**inputs)
            sdpa_ms = timed(lambda: compiled(**inputs))
            torch._dynamo.reset()
            with hf_qattn.patch(model):
                eager = forward(**inputs)
                count, reasons = breaks(forward, **inputs)
                compiled = torch.compile(forward, fullgraph=True)
                got = compiled(**inputs)
                qattn_ms = timed(lambda: compiled(**inputs))
                torch._dynamo.reset()
                cg = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
                cg(**inputs)
                cg(**inputs)
                cg_out = cg(**inputs).clone()
                cg_ms = timed(lambda: cg(**inputs))
            out = dict(eager=eager.float(), got=got.float(), cg=cg_out.float(), ref=ref_eager.float(),
                       ref_compiled=ref_compiled.float())
        row(name, shape=f"{tuple(inputs['hidden_states'].shape)}", graph_breaks=count, break_reasons=reasons,
            compiled_vs_eager=f"{rel(out['got'], out['eager']):.2e}",
            cudagraph_vs_eager=f"{rel(out['cg'], out['eager']):.2e}",
            sdpa_compiled_vs_eager=f"{rel(out['ref_compiled'], out['ref']):.2e}",
            qattn_vs_sdpa=f"{rel(out['eager'], out['ref']):.2e}",
            sdpa_ms=f"compiled {sdpa_ms:.2f}", qattn_ms=f"compiled {qattn_ms:.2f} / cudagraph {cg_ms:.2f}")
        if count or not rel(out["got"], out["eager"]) <= 1.5 * rel(out["ref_compiled"], out["ref"]) + 1e-3:
            FAILED.append(name)
    return run


def table() -> str:
    keys = ["case", "shape", "graph_breaks", "compiled_vs_eager", "cudagraph_vs_eager", "sdpa_compiled_vs_eager",
            "qattn_vs_sdpa",
            "sdpa_ms", "qattn_ms", "break_reasons", "error"]
    keys = [k for k in keys if any(k in r for r in ROWS)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")).replace("|", "/") for k in keys) + " |" for r in ROWS]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="eval/results")
    p.add_argument("--layers", type=int, default=4, help="Llama layers (real 8B widths; few layers keep compiles short)")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--skip", nargs="*", default=[], help="cases to skip: op prefill decode wan flux")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("check_compile needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_float32_matmul_precision("high")
    started = time.time()
    if "op" not in args.skip:
        qattn_op(args)
    if "prefill" not in args.skip:
        llama_prefill(args)
    if "decode" not in args.skip:
        llama_decode(args)
    try:
        import diffusers  # noqa: F401
        has_diffusers = True
    except ImportError:
        has_diffusers = False
        row("denoisers", error="diffusers not importable: skipped")
    if has_diffusers:
        for name, build in (("wan denoiser", wan), ("flux denoiser", flux)):
            if name.split()[0] not in args.skip:
                denoiser_case(name, build)(args)
    stats = hf_qattn.fallback_stats()
    text = (f"# torch.compile check — {report.device_name()}, {report.today()}\n\n{report.versions('transformers')}\n\n"
            f"{table()}\n\nfallback_stats: {stats}\n\nfailed: {FAILED or 'none'}; "
            f"{time.time() - started:.0f} s\n")
    path = report.write(report.result_path("compile", args.out), text)
    print("\n" + text + f"written to {path}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
