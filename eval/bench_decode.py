"""Decode speed and memory with the quantized KV cache (issue 10), on a CUDA GPU.

    python eval/bench_decode.py --out eval/results            # everything (kernel + generate level)
    python eval/bench_decode.py --out /tmp/out --skip-generate  # kernel level only
    python eval/bench_decode.py --out /tmp/out --tiny           # small shapes: checks the script runs
    python eval/bench_decode.py --out /tmp/out --sweep --skip-generate  # + launch configs at B8 L16k/64k

Kernel level — one decode step of attention: B ∈ {1, 8}, 32 query / 8 KV heads, d128, bf16,
cached tokens L ∈ {1k, 4k, 16k, 64k, 128k}, one query token:
  * SDPA over a bf16 cache (torch.nn.functional.scaled_dot_product_attention, enable_gqa);
  * qattn over the same bf16 cache (today's path: re-quantizes the whole cache every step);
  * the decode kernel over the quantized cache, INT8 K and INT4 K (both with INT8 V per token);
  * the append kernel alone, quantizing one new token per sequence into the cache (per step cost);
  * the host time of one decode call (Python + launch, no synchronization; the launch remembered as a cache
    layer remembers it, ``launches=``): when it is close to the GPU time the call is launch-bound, not
    bandwidth-bound;
  * on a GPU, the GPU time alone of SDPA's and each format's decode call (20 calls captured in one CUDA
    graph, as a replayed decode step runs them): the kernels' speed where an eager call's host time
    (≈ 60–90 µs) is near its GPU time (B8 16k) or above it (B1 up to 64k).
Times are medians of CUDA-event-timed batches of calls after warm-up; GB/s is the cache bytes
each reads (scales included) over its time.

``--sweep`` adds a table of decode launch configurations (BLOCK_N, num_warps, num_stages, waves:
rounds of the programs the SMs hold at once that the split count fills) at B8 L16k and L64k, INT8 and
INT4 K, and names the fastest per precision, to pick the defaults (the ``decode`` section of
configs/kernels.json) from one GPU run.

Generate level — a Llama-3-8B-shaped model of 8 layers (random bf16 weights), prompt 4k and 16k,
256 new tokens, greedy, batch 1: prefill timed alone, then each decode step (one token through
the model, CUDA events, after warm-up steps) for SDPA + DynamicCache — with the flash/efficient
kernels (the baseline) and with torch's default choice (cuDNN on the H100, which builds an execution
plan for every new key length, so at every step) — vs qattn + QAttnCache (INT8 K, and INT4 K in every
layer), eager and with each decode step replayed from a CUDA graph (static storage,
``hf_qattn.CapturedDecodeStep``: no host work per step), and SDPA over transformers' StaticCache with
the forward compiled (``mode="reduce-overhead"``: CUDA graphs; its eager static-cache path reads the
mask on the host, so it cannot be captured by hand); decode tokens/s, peak GPU memory, cache bytes, and the agreement of the greedy tokens with the
first SDPA run. The longest context that fits a memory budget is derived
from the measured cache bytes per token (scaled to a 32-layer Llama-3-8B).

Each case runs in its own try/except; a failure is reported in the table, not raised. The table is
printed last and written as markdown to ``<out>/decode-<gpu>-<date>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import statistics
import sys
import time
import traceback

import torch
import transformers

if not torch.cuda.is_available():  # the kernels run under Triton's interpreter, set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402
from timing import events_ms, graph_ms, host_us  # noqa: E402  (eval/timing.py)
import report  # noqa: E402  (eval/report.py)

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before


def log(*args):
    print(*args, flush=True)


def parse_sizes(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="eval/results", help="folder for the markdown table (created)")
    p.add_argument("--lengths", default="1k,4k,16k,64k,128k", help="cached tokens, kernel level")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--q-len", type=int, default=1, help="query tokens per decode call (kernel level)")
    p.add_argument("--calls", type=int, default=50, help="calls per timed batch (kernel level)")
    p.add_argument("--repeats", type=int, default=7, help="timed batches; the median is reported")
    p.add_argument("--no-qattn-prefill-path", action="store_true",
                   help="skip timing hf_qattn.qattn over the bf16 cache (today's re-quantizing path)")
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--generate-calls-only", action="store_true",
                   help="generate level: only the model.generate calls (not the hand-timed decode loop)")
    p.add_argument("--prompts", default="4k,16k", help="prompt lengths, generate level")
    p.add_argument("--eager-only", action="store_true", help="generate calls: the eager modes only")
    p.add_argument("--graphs-only", action="store_true",
                   help="generate calls: the CUDA-graph modes only (captured_generate, compiled static SDPA)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup-steps", type=int, default=8, help="decode steps not timed")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sliding-window", type=int, default=0,
                   help="generate level: a Mistral-shaped model whose layers all have this sliding window")
    p.add_argument("--budget-gib", type=float, default=40.0, help="KV-cache memory budget for the longest context")
    p.add_argument("--tiny", action="store_true", help="small shapes and a tiny model (runs anywhere)")
    p.add_argument("--sweep", action="store_true", help="time decode launch configurations (see above)")
    p.add_argument("--sweep-lengths", default="16k,64k")
    p.add_argument("--sweep-batch", type=int, default=8)
    p.add_argument("--sweep-block-n", default="32,64")  # INT8: at most per-token V's tile
    p.add_argument("--sweep-warps", default="4,8")
    p.add_argument("--sweep-stages", default="2,3,4")
    p.add_argument("--sweep-waves", default="1,2,4")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# timing


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back calls, in µs."""
    return events_ms(fn, calls=calls, repeats=repeats) * 1e3


# ------------------------------------------------------------------------------------------------
# kernel level


def exact_decode(q, k, v) -> torch.Tensor:
    """Float64 attention of q (B, Hq, Nq, D) over k, v (B, Hk, L, D) → (B, Nq, Hq, D), one sequence at a
    time (the whole batch in float64 at B8 L128k needs > 32 GiB)."""
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    out = torch.empty(b, nq, hq, d, device=q.device, dtype=torch.float64)
    for i in range(b):
        qi = q[i].double().reshape(hk, hq // hk * nq, d)
        scores = torch.matmul(qi, k[i].double().transpose(-1, -2)) / math.sqrt(d)
        o = torch.matmul(torch.softmax(scores, dim=-1), v[i].double())  # (Hk, G·Nq, D)
        out[i] = o.reshape(hq, nq, d).transpose(0, 1)
    return out


# the cache's storage formats (hf_qattn.kv_cache.reference.PRECISIONS): per-token INT8 K + V (equalized), 4-bit K
# groups + per-token INT8 V, 8-bit K and V groups
CACHE_PRECISIONS = ("int8", "int4", "int8g")


def qattn_cache(model, precision: str, **kwargs):
    """A QAttnCache storing every layer in ``precision`` (one of CACHE_PRECISIONS; int8g: the int8 plan with
    ``int8_layout="groups"``)."""
    import hf_qattn

    if precision == "int8g":
        return hf_qattn.QAttnCache(model, plan="int8", int8_layout="groups", **kwargs)
    return hf_qattn.QAttnCache(model, plan=precision, **kwargs)


def fill_cache(k, v, precision, device):
    """(buffers, k̄, v̄, bytes of the tokens' storage) of a cache holding k, v."""
    from hf_qattn.kv_cache import reference as kv_reference
    from hf_qattn.kernels import decode_launch

    b, hk, n, d = k.shape
    k_bar, v_bar = kv_reference.centers(k, v)
    buf = kv_reference.allocate(b, hk, n, d, precision, device, k.dtype)
    kv_reference.set_equalizers(buf, k, v, k_bar, v_bar)  # as a cache's first fill
    decode_launch.append(k, v, k_bar, v_bar, buf, 0)
    nbytes = sum(t.numel() * t.element_size() for t in buf[1:5])  # what a decode step reads, scales included
    return buf, k_bar, v_bar, nbytes


def _failed(row: dict, error: Exception) -> None:
    """A case that raised: the row says why, the run goes on."""
    row["error"] = f"{type(error).__name__}: {error}"[:160]
    traceback.print_exc()


def _finish(rows: list, kind: str, row: dict) -> None:
    """Free the case's memory, print its row and keep it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(kind, row)
    rows.append(row)


def kernel_rows(args, device, dtype):
    from hf_qattn.kernels import decode_launch

    import hf_qattn

    rows = []
    hq, hk, d, nq = args.heads, args.kv_heads, args.head_dim, args.q_len
    for b in parse_sizes(args.batches):
        for n in parse_sizes(args.lengths):
            row = {"B": b, "L": n}
            try:
                k = torch.randn(b, hk, n, d, device=device, dtype=dtype)
                v = torch.randn(b, hk, n, d, device=device, dtype=dtype)
                q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
                bf16_bytes = 2 * b * hk * n * d * k.element_size()
                row["sdpa_us"] = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=False, enable_gqa=True), args.calls, args.repeats)
                row["bf16_bytes"] = bf16_bytes
                row["sdpa_GBs"] = bf16_bytes / row["sdpa_us"] / 1e3
                graphs = torch.device(device).type == "cuda"  # GPU time alone: the calls replayed from one CUDA graph
                if graphs:
                    row["sdpa_graph_us"] = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=False, enable_gqa=True), calls=args.calls, replays=args.repeats) * 1e3
                if not args.no_qattn_prefill_path:
                    try:
                        row["qattn_bf16cache_us"] = time_us(lambda: hf_qattn.qattn(q, k, v), max(3, args.calls // 10),
                                                            args.repeats)
                    except Exception as error:  # noqa: BLE001
                        row["qattn_bf16cache_us"] = f"error: {type(error).__name__}"
                ref = None
                for precision in CACHE_PRECISIONS:
                    try:
                        buf, k_bar, v_bar, qbytes = fill_cache(k, v, precision, device)
                        out = torch.empty(b, nq, hq, d, device=device, dtype=dtype)
                        launches = {}  # remembered as a cache layer remembers its launch (its eager steps' host path)

                        def run():
                            decode_launch.decode(q, buf, v_bar, n, out=out, launches=launches)

                        us = time_us(run, args.calls, args.repeats)
                        row[f"{precision}_us"] = us
                        row[f"{precision}_bytes"] = qbytes
                        row[f"{precision}_GBs"] = qbytes / us / 1e3
                        row[f"{precision}_x"] = row["sdpa_us"] / us
                        row[f"{precision}_host_us"] = host_us(run, args.calls, repeats=1, hold_gpu=False)
                        if graphs:
                            try:
                                row[f"{precision}_graph_us"] = graph_ms(run, calls=args.calls,
                                                                        replays=args.repeats) * 1e3
                            except Exception as error:  # noqa: BLE001
                                row[f"{precision}_graph_us"] = f"error: {type(error).__name__}"
                        # accuracy of the timed call against exact attention on the bf16 cache (before the append
                        # timing below, which leaves a grouped format's last group built from stale recent rows)
                        run()
                        if ref is None:
                            ref = exact_decode(q, k, v)
                        err = (out.double() - ref).abs().sum() / ref.abs().sum()
                        row[f"{precision}_relL1"] = err.item()
                        # the append kernel alone: one new token per sequence (rewrites the last slot; INT4: the
                        # token that completes a group, which quantizes the group)
                        k1, v1 = k[:, :, -1:].contiguous(), v[:, :, -1:].contiguous()
                        row[f"{precision}_append_us"] = time_us(
                            lambda: decode_launch.append(k1, v1, k_bar, v_bar, buf, n - 1), args.calls, args.repeats)
                        del buf, out
                    except Exception as error:  # noqa: BLE001
                        row[f"{precision}_us"] = f"error: {type(error).__name__}: {error}"[:120]
                        traceback.print_exc()
                del ref
                del k, v, q
            except Exception as error:  # noqa: BLE001
                _failed(row, error)
            _finish(rows, "kernel", row)
    return rows


# ------------------------------------------------------------------------------------------------
# launch-configuration sweep


def sweep_configs(args) -> list[dict]:
    """The default launch, then the grid."""
    configs = [{"name": "default"}]
    for block_n in parse_sizes(args.sweep_block_n):
        for warps in parse_sizes(args.sweep_warps):
            for stages in parse_sizes(args.sweep_stages):
                for waves in [float(w) for w in args.sweep_waves.split(",") if w.strip()]:
                    configs.append({"name": f"N{block_n} w{warps} s{stages} waves{waves:g}", "block_n": block_n,
                                    "num_warps": warps, "num_stages": stages, "waves": waves})
    return configs


def sweep_rows(args, device, dtype):
    from hf_qattn.kernels import decode_launch

    rows = []
    hq, hk, d, nq, b = args.heads, args.kv_heads, args.head_dim, args.q_len, args.sweep_batch
    calls, repeats = max(2, args.calls // 2), max(2, args.repeats - 2)
    for n in parse_sizes(args.sweep_lengths):
        try:
            k = torch.randn(b, hk, n, d, device=device, dtype=dtype)
            v = torch.randn(b, hk, n, d, device=device, dtype=dtype)
            q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
            sdpa = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           calls, repeats)
            ref = exact_decode(q, k, v)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"L": n, "name": "setup", "error": f"{type(error).__name__}: {error}"[:160]})
            continue
        for precision in CACHE_PRECISIONS:
            try:
                buf, k_bar, v_bar, qbytes = fill_cache(k, v, precision, device)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"L": n, "precision": precision, "name": "fill", "error": f"{type(error).__name__}"})
                continue
            out = torch.empty(b, nq, hq, d, device=device, dtype=dtype)
            for config in sweep_configs(args):
                row = {"B": b, "L": n, "precision": precision, "name": config["name"], "sdpa_us": sdpa}
                kwargs = {key: value for key, value in config.items() if key != "name"}
                if precision != "int8" and kwargs.get("block_n", 64) != 64:
                    continue  # grouped formats are read a 64-token group a tile
                try:
                    _, cfg = decode_launch.plan_decode(precision, q.shape, hk, n, q.device, **kwargs)
                    row["splits"] = cfg["num_splits"]

                    def run():
                        decode_launch.decode(q, buf, v_bar, n, out=out, **kwargs)

                    us = time_us(run, calls, repeats)
                    run()
                    err = ((out.double() - ref).abs().sum() / ref.abs().sum()).item()
                    row.update(us=us, GBs=qbytes / us / 1e3, x=sdpa / us, relL1=err)
                    if not err < (0.25 if precision == "int4" else 0.05):
                        row["error"] = f"wrong result: relL1 {err:.3g}"
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {error}"[:120]
                    traceback.print_exc()
                log("sweep", row)
                rows.append(row)
            del buf, out
        del k, v, q, ref
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def sweep_table(rows) -> list[str]:
    lines = ["| L | K | config | splits | µs | GB/s | ×SDPA | relL1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['L']} | {r.get('precision', '-')} | {r['name']} | {r.get('splits', '-')} | "
                         f"failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['L']} | {r['precision']} | {r['name']} | {r['splits']} | {r['us']:.1f} | "
                     f"{r['GBs']:.0f} | {r['x']:.2f} | {r['relL1']:.4f} |")
    # the best configuration per precision: the lowest total time over the swept lengths
    lines += ["", "Fastest configuration per storage format (total µs over the swept lengths; ties: the first):", ""]
    for precision in CACHE_PRECISIONS:
        totals = {}
        lengths = {r["L"] for r in rows if r.get("precision") == precision}
        for r in rows:
            if r.get("precision") == precision and "error" not in r:
                totals.setdefault(r["name"], []).append(r["us"])
        complete = {name: sum(t) for name, t in totals.items() if len(t) == len(lengths)}
        if complete:
            best = min(complete, key=complete.get)
            default = complete.get("default")
            gain = f" ({default / complete[best]:.2f}× the default)" if default else ""
            lines.append(f"- {precision}: **{best}**: {complete[best]:.1f} µs{gain}")
    return lines


# ------------------------------------------------------------------------------------------------
# generate level


def build_model(args, device, dtype):
    import transformers as tf

    import hf_qattn  # noqa: F401  (registers "qattn")

    if args.tiny:  # several layers: the cache must have one layer per decoder layer
        config = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                                num_attention_heads=8,
                                num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1 << 17)
    elif args.sliding_window:  # Mistral-shaped: every layer a sliding window (a ring in QAttnCache)
        config = tf.MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                                  max_position_embeddings=1 << 17, sliding_window=args.sliding_window)
    else:
        config = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                max_position_embeddings=1 << 17, rope_theta=500000.0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def generate_run(model, ids, mode: str, new_tokens: int, warmup: int):
    """Greedy decoding by hand so that prefill and each decode step are timed apart."""
    import transformers as tf

    import hf_qattn

    backends = contextlib.nullcontext()
    if mode.startswith("sdpa+StaticCache"):  # what transformers offers for fast decoding: compiled, CUDA graphs
        model.set_attn_implementation("sdpa")
        cache = tf.StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 8)
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def compiled_step(token, position=[ids.shape[1]]):  # noqa: B006 - the step's position, advanced here
            at = torch.tensor([position[0]], device=token.device)
            position[0] += 1
            return forward(input_ids=token, position_ids=at[None], cache_position=at, **{CACHE_KW: cache},
                           use_cache=True).logits.clone()
        return _timed_generate(model, ids, cache, new_tokens, warmup, make_step=lambda: compiled_step)
    if mode.startswith("sdpa"):
        model.set_attn_implementation("sdpa")
        cache = tf.DynamicCache(config=model.config)
        if mode.startswith("sdpa-flash") and torch.cuda.is_available():
            # torch picks cuDNN attention on the H100, which builds an execution plan for every new key
            # length, i.e. at every decode step (≈ 8 ms a layer on the host, eval/studies/probe_generate_step.py)
            SDPBackend = torch.nn.attention.SDPBackend
            backends = torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    else:
        model.set_attn_implementation("qattn")
        precision = mode.split()[1].rstrip(",")
        graph = mode.endswith("CUDA graph")
        cache = qattn_cache(model, precision, static_max_len=ids.shape[1] + new_tokens + 1 if graph else None)
        if graph:  # static storage, and each decode step replayed from a CUDA graph (hf_qattn.CapturedDecodeStep)
            return _timed_generate(model, ids, cache, new_tokens, warmup,
                                   make_step=lambda: hf_qattn.CapturedDecodeStep(model, cache))
    with backends:
        return _timed_generate(model, ids, cache, new_tokens, warmup)


def _timed_generate(model, ids, cache, new_tokens: int, warmup: int, make_step=None):
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model(ids, **{CACHE_KW: cache}, use_cache=True, logits_to_keep=1)
    _sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    token = out.logits[:, -1:].argmax(-1)
    tokens = [token]
    step_ms = []
    decode_step = make_step() if make_step else (lambda t: model(t, **{CACHE_KW: cache}, use_cache=True).logits)
    # Each step timed on its own (events around one step; the next step needs this step's token, and the
    # first ``warmup`` steps are dropped): not timing.events_ms's batches of identical calls.
    for step in range(new_tokens - 1):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t1 = time.perf_counter()
        token = decode_step(token)[:, -1:].argmax(-1)
        if torch.cuda.is_available():
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t1) * 1e3
        if step >= warmup:
            step_ms.append(ms)
        tokens.append(token)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    result = {
        "prefill_ms": prefill_ms,
        "step_ms": statistics.median(step_ms) if step_ms else float("nan"),
        "tok_s": ids.shape[0] * 1e3 / statistics.median(step_ms) if step_ms else float("nan"),
        "peak_GiB": peak / 2**30,
        "cache_bytes": cache_bytes(cache),
        "cache_tokens": cache.get_seq_length(),
        "tokens": torch.cat(tokens, dim=1).cpu(),
    }
    # GPU time of a step, without the host: a replayed graph's step time is that already; for eager
    # steps, the kernels' own time summed by the profiler (what a CUDA graph of the step would cost)
    if make_step is not None:
        result["gpu_ms"] = result["step_ms"]
    elif torch.cuda.is_available():
        result["gpu_ms"] = _kernel_ms_per_step(decode_step, token)
    return result


def _kernel_ms_per_step(decode_step, token, steps: int = 4) -> float:
    _sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = decode_step(token)[:, -1:].argmax(-1)
        _sync()
    total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total_us / 1e3 / steps


# the compiled mode last: on a CPU, Triton's interpreter fails in a process where inductor ran before
GENERATE_CALLS = ("sdpa-flash, DynamicCache", "qattn, QAttnCache int8", "qattn, QAttnCache int8, step graphs off",
                  "qattn, QAttnCache int8, captured_generate",
                  "qattn, QAttnCache int4, captured_generate", "qattn, QAttnCache int8g, captured_generate",
                  "sdpa, static cache, compiled")


def generate_call(model, ids, mode: str, new_tokens: int):
    """One ``model.generate`` call as a user writes it (greedy, exactly ``new_tokens``): (ms, cache)."""
    import transformers as tf

    import hf_qattn

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    backends = contextlib.nullcontext()
    if mode.startswith("sdpa"):
        model.set_attn_implementation("sdpa")
        if mode == "sdpa, static cache, compiled":  # transformers compiles the forward for a static cache
            kwargs["cache_implementation"] = "static"
            cache = None
        else:
            cache = tf.DynamicCache(config=model.config)
            SDPBackend = torch.nn.attention.SDPBackend  # not cuDNN: it plans anew at every key length
            backends = torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    else:
        model.set_attn_implementation("qattn")
        cache = qattn_cache(model, mode.split()[2].rstrip(","))
        if mode.endswith("captured_generate"):
            kwargs["custom_generate"] = hf_qattn.captured_generate
    if cache is not None:
        kwargs[CACHE_KW] = cache
    # "step graphs off": every eager decode step launches its kernels from Python (hf_qattn/kv_cache/step_graph.py)
    os.environ["HF_QATTN_STEP_GRAPHS"] = "0" if mode.endswith("step graphs off") else "1"
    with backends:
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, return_dict_in_generate=True, **kwargs)
        _sync()
    os.environ.pop("HF_QATTN_STEP_GRAPHS")
    return (time.perf_counter() - t0) * 1e3, getattr(out, CACHE_KW, None) or cache


def generate_call_rows(args, device, dtype):
    """ms a token of ``model.generate`` itself: (time of N new tokens − time of 1) / (N − 1), after a
    warm-up call of N (compiles, captures); cache bytes as allocated after the call."""
    model = build_model(args, device, dtype)
    rows = []
    for prompt in parse_sizes(args.prompts):
        ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=device)  # 0 is the pad token
        for mode in GENERATE_CALLS:
            graphs = "captured" in mode or "compiled" in mode
            if (args.eager_only and graphs) or (args.graphs_only and not graphs):
                continue
            row = {"prompt": prompt, "mode": mode}
            try:
                generate_call(model, ids, mode, args.new_tokens)  # warm-up: compiles, captures
                one = min(generate_call(model, ids, mode, 1)[0] for _ in range(2))
                many, cache = min((generate_call(model, ids, mode, args.new_tokens) for _ in range(2)),
                                  key=lambda call: call[0])
                row["ms_token"] = (many - one) / (args.new_tokens - 1)
                row["cache_bytes"] = cache_bytes(cache) if cache is not None else None
            except Exception as error:  # noqa: BLE001
                _failed(row, error)
            _finish(rows, "generate call", row)
    return rows


def generate_call_table(rows) -> list[str]:
    lines = ["| prompt | mode | ms a token | ×SDPA-flash eager | ×compiled static SDPA | cache MiB | cache/bf16 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['prompt']} | {r['mode']} | error: {r['error']} | | | | |")
            continue
        same = [x for x in rows if x["prompt"] == r["prompt"] and "ms_token" in x]
        flash = next((x for x in same if x["mode"].startswith("sdpa-flash")), None)
        static = next((x for x in same if x["mode"].startswith("sdpa, static")), None)
        mib = f"{r['cache_bytes'] / 2**20:.1f}" if r.get("cache_bytes") else "-"
        rel = (f"{r['cache_bytes'] / flash['cache_bytes']:.3f}"
               if r.get("cache_bytes") and flash and flash.get("cache_bytes") else "-")
        ratio = [f"{base['ms_token'] / r['ms_token']:.2f}" if base else "-" for base in (flash, static)]
        lines.append(f"| {r['prompt']} | {r['mode']} | {r['ms_token']:.2f} | {ratio[0]} | {ratio[1]} | {mib} | {rel} |")
    return lines


def generate_rows(args, device, dtype):
    rows = []
    try:
        model = build_model(args, device, dtype)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        return [{"prompt": "-", "mode": "build model", "error": f"{type(error).__name__}: {error}"[:160]}]
    vocab = model.config.vocab_size
    for prompt in parse_sizes(args.prompts):
        ids = torch.randint(0, vocab, (1, prompt), device=device)
        base_tokens = None
        for mode in ("sdpa-flash+DynamicCache", "sdpa+DynamicCache", "qattn+QAttnCache int8",
                     "qattn+QAttnCache int4", "qattn+QAttnCache int8, CUDA graph",
                     "qattn+QAttnCache int4, CUDA graph", "qattn+QAttnCache int8g, CUDA graph",
                     "sdpa+StaticCache, torch.compile CUDA graph"):
            row = {"prompt": prompt, "mode": mode}
            try:
                result = generate_run(model, ids, mode, args.new_tokens, args.warmup_steps)
                tokens = result.pop("tokens")
                if base_tokens is None:
                    base_tokens = tokens
                else:
                    same = (tokens == base_tokens).long()
                    row["agree"] = same.float().mean().item()
                    row["first_diff"] = int(same.argmin()) if not bool(same.all()) else None
                row.update(result)
            except Exception as error:  # noqa: BLE001
                _failed(row, error)
            _finish(rows, "generate", row)
        # the baseline: SDPA with flash/efficient kernels (cuDNN's per-length plan building is not attention)
        base = next((r for r in rows if r["prompt"] == prompt and r["mode"].startswith("sdpa-flash") and "tok_s" in r),
                    None)
        for r in rows:
            if r["prompt"] == prompt and base is not None and "tok_s" in r:
                r["x_sdpa"] = r["tok_s"] / base["tok_s"]
                if r.get("gpu_ms") and base.get("gpu_ms"):
                    r["x_sdpa_gpu"] = base["gpu_ms"] / r["gpu_ms"]
                r["cache_vs_bf16"] = r["cache_bytes"] / base["cache_bytes"]
    return rows


# ------------------------------------------------------------------------------------------------
# report


def fmt(value, spec="{:.1f}"):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return spec.format(value)


def kernel_table(rows) -> list[str]:
    lines = ["| B | L | SDPA bf16 µs (GB/s) | qattn on bf16 cache µs | INT8-K µs (GB/s) | ×SDPA | relL1 | INT4-K µs (GB/s) | ×SDPA | relL1 | int8g µs (GB/s) | ×SDPA | relL1 | host µs/call (INT8) | append µs/token INT8 / INT4 / int8g |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['L']} | failed: {r['error']} | | | | | | | | | | | | |")
            continue
        cells = [str(r["B"]), str(r["L"]), f"{fmt(r.get('sdpa_us'))} ({fmt(r.get('sdpa_GBs'), '{:.0f}')})",
                 fmt(r.get("qattn_bf16cache_us"))]
        for p in CACHE_PRECISIONS:
            us = r.get(f"{p}_us")
            if isinstance(us, str):
                cells += [us, "-", "-"]
            else:
                cells += [f"{fmt(us)} ({fmt(r.get(f'{p}_GBs'), '{:.0f}')})", fmt(r.get(f"{p}_x"), "{:.2f}"),
                          fmt(r.get(f"{p}_relL1"), "{:.4f}")]
        cells += [fmt(r.get("int8_host_us")), " / ".join(fmt(r.get(f"{p}_append_us")) for p in CACHE_PRECISIONS)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kernel_gpu_table(rows) -> list[str]:
    """GPU time alone of one decode call (20 calls replayed from one CUDA graph): SDPA and each format, with the
    ratio and the cache's GB/s at that time; empty where no row has it (no GPU)."""
    rows = [r for r in rows if "error" not in r and "sdpa_graph_us" in r]
    if not rows:
        return []
    lines = ["| B | L | SDPA bf16 µs (GB/s) | " + " | ".join(f"{p} µs (GB/s) | ×SDPA" for p in CACHE_PRECISIONS) + " |",
             "|---|---|---|" + "---|---|" * len(CACHE_PRECISIONS)]
    for r in rows:
        sdpa = r["sdpa_graph_us"]
        cells = [str(r["B"]), str(r["L"]), f"{fmt(sdpa)} ({fmt(r['bf16_bytes'] / sdpa / 1e3, '{:.0f}')})"]
        for p in CACHE_PRECISIONS:
            us = r.get(f"{p}_graph_us")
            if not isinstance(us, float):
                cells += [str(us or "-"), "-"]
            else:
                cells += [f"{fmt(us)} ({fmt(r[f'{p}_bytes'] / us / 1e3, '{:.0f}')})", fmt(sdpa / us, "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def generate_table(rows, args) -> list[str]:
    lines = ["GPU ms/token: the kernels' time of a step (profiler sum for eager steps; the step time itself when "
             "replayed from a CUDA graph) — what each mode costs once the host is out of the loop.", "",
             "| prompt | mode | prefill ms | decode ms/token | tokens/s | ×SDPA | GPU ms/token | ×SDPA (GPU) | peak GiB | cache MiB | cache/bf16 | greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['prompt']} | {r['mode']} | failed: {r['error']} | | | | | | | | | |")
            continue
        agree = "-" if "agree" not in r else f"{r['agree']:.3f}" + (f" (first diff at {r['first_diff']})"
                                                                    if r.get("first_diff") is not None else "")
        lines.append("| " + " | ".join([
            str(r["prompt"]), r["mode"], fmt(r["prefill_ms"]), fmt(r["step_ms"], "{:.2f}"), fmt(r["tok_s"]),
            fmt(r.get("x_sdpa"), "{:.2f}"), fmt(r.get("gpu_ms"), "{:.2f}"), fmt(r.get("x_sdpa_gpu"), "{:.2f}"),
            fmt(r["peak_GiB"], "{:.2f}"), fmt(r["cache_bytes"] / 2**20),
            fmt(r.get("cache_vs_bf16"), "{:.3f}"), agree]) + " |")
    # longest context in a fixed budget, from measured bytes per token and layer
    per_token = {}
    for r in rows:
        if "error" not in r and r.get("cache_tokens") and "graph" not in r["mode"]:  # same bytes as eager
            per_token.setdefault(r["mode"], r["cache_bytes"] / r["cache_tokens"] / max(1, args.layers))
    if per_token:
        budget = args.budget_gib * 2**30
        lines += ["", f"Longest context in {args.budget_gib:g} GiB of KV cache, 32-layer Llama-3-8B (from the measured bytes per token):", "",
                  "| cache | bytes / token / layer | tokens | × bf16 |", "|---|---|---|---|"]
        base = per_token.get("sdpa-flash+DynamicCache")
        for mode, bpt in per_token.items():
            tokens = budget / (bpt * 32)
            lines.append(f"| {mode} | {bpt:.0f} | {tokens:,.0f} | {fmt(base / bpt if base else None, '{:.2f}')} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.lengths, args.batches, args.prompts = "300,1000", "1,2", "64"
        args.new_tokens, args.warmup_steps, args.calls, args.repeats, args.layers = 6, 1, 2, 2, 4
        args.sweep_lengths, args.sweep_batch, args.sweep_stages, args.sweep_waves = "200", 2, "2", "1,2"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.tiny:
            log("no GPU: use --tiny to check the script on a CPU (times are then meaningless)")
            return 2
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    krows = [] if args.skip_kernel else kernel_rows(args, device, dtype)
    srows = sweep_rows(args, device, dtype) if args.sweep else []
    grows = [] if args.skip_generate or args.generate_calls_only else generate_rows(args, device, dtype)
    crows = [] if args.skip_generate else generate_call_rows(args, device, dtype)

    lines = [f"# Decode with the quantized KV cache — {gpu}, {date}", "",
             f"torch {torch.__version__}; {args.dtype}; command: `python eval/bench_decode.py {' '.join(sys.argv[1:])}`", ""]
    if krows:
        lines += [f"## Kernel: one decode step, Hq {args.heads} / Hk {args.kv_heads}, d{args.head_dim}, q_len {args.q_len}", "",
                  "GB/s = cache bytes read (scales included) / time. relL1 against float64 attention on the bf16 cache.", ""]
        lines += kernel_table(krows) + [""]
        gpu_lines = kernel_gpu_table(krows)
        if gpu_lines:
            lines += ["GPU time alone (20 calls replayed from one CUDA graph, as a captured decode step runs them; the "
                      "eager times above include each call's host time where it is longer than the GPU's):", ""]
            lines += gpu_lines + [""]
    if srows:
        lines += [f"## Decode launch configurations: B{args.sweep_batch}, Hq {args.heads} / Hk {args.kv_heads}, "
                  f"d{args.head_dim}, q_len {args.q_len}", "",
                  "config: BLOCK_N, num_warps, num_stages, waves (rounds of resident programs the split count fills); "
                  "default: the launcher's choice (the decode section of configs/kernels.json).", ""]
        lines += sweep_table(srows) + [""]
    if grows:
        lines += [f"## Generate: Llama-3-8B-shaped, {args.layers} layers, random bf16 weights, batch 1, "
                  f"{args.new_tokens} new tokens (median decode step after {args.warmup_steps} warm-up steps)", ""]
        lines += generate_table(grows, args) + [""]
    if crows:
        shape = (f"Mistral-shaped (every layer a sliding window of {args.sliding_window})" if args.sliding_window
                 else "Llama-3-8B-shaped")
        lines += [f"## model.generate as users call it: {shape}, {args.layers} layers, random bf16 weights, "
                  f"batch 1, greedy, {args.new_tokens} new tokens", "",
                  "ms a token = (one call of N new tokens − one call of 1) / (N − 1), each the faster of two calls, "
                  "after a warm-up call; the cache "
                  "as allocated after the call. Modes: SDPA flash with "
                  "transformers' DynamicCache (eager); `cache_implementation=\"static\"` (transformers compiles the "
                  "forward, CUDA graphs); qattn with `cache=QAttnCache(model)` (eager); the same with "
                  "`custom_generate=hf_qattn.captured_generate`.", ""]
        lines += generate_call_table(crows) + [""]
    text = "\n".join(lines)
    name = "decode-generate" if args.generate_calls_only and args.skip_kernel else "decode"  # its own results file
    path = report.write(report.result_path(name + "-tiny" if args.tiny else name, args.out), text)
    log("")
    log(text)
    log(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
