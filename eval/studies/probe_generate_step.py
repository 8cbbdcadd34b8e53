"""Where does one decode step of bench_decode's 8-layer model spend its time? Times steps and profiles.

    bash eval/device_run.sh python3 eval/studies/probe_generate_step.py [PROMPT [MODES [cprofile]]]   e.g. 16384 qattn,flash
    bash eval/device_run.sh python3 eval/studies/probe_generate_step.py alternate 4096,16384
    bash eval/device_run.sh python3 eval/studies/probe_generate_step.py layers 4096
    bash eval/device_run.sh python3 eval/studies/probe_generate_step.py captured 4096,16384
    bash eval/device_run.sh python3 eval/studies/probe_generate_step.py startup 4096

``layers``: the host's µs a layer of the eager step's attention function and cache update (SDPA flash +
DynamicCache against qattn + QAttnCache), three rounds, then a cProfile of 16 steps of each.

``captured``: what bounds ``captured_generate``: the GPU time of one replayed step by cache format (replays back
to back), the same step inside a greedy loop that synchronises every token as ``captured_generate`` does, and the
floor — the model's step with no cache (attention over one key) in a CUDA graph; then the replayed step's kernels
by GPU time. ``startup``: a ``captured_generate`` call's fixed cost (generate timed by new-token count, and the
first CapturedDecodeStep calls one by one).

Modes: ``sdpa`` (cuDNN) and ``flash`` (SDPA's flash backend) + DynamicCache, ``qattn`` + QAttnCache (int8).
Prefill a prompt, then 24 greedy steps, each timed by CUDA events (what bench_decode reports) and by the
host clock around a synchronised step, and 24 steps unsynchronised (the host's issue rate); then
torch.profiler over 3 steps, printing the ops with the most host (self CPU) and GPU time; with
``cprofile``, also the Python functions with the most host time over 8 steps.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch
import transformers as tf

import hf_qattn
from hf_qattn.kv_cache.captured import cache_argument

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import events_ms  # noqa: E402

CACHE_KW = cache_argument(tf.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before


def build():
    config = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=1 << 17,
                            rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def _use(model, mode: str):
    """Set the model's attention for ``mode`` ("sdpa", "flash", "qattn"); returns the SDPA backend context to run in."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.set_attn_implementation("qattn" if mode.startswith("qattn") else "sdpa")
    # "qattn, step graphs off": each eager step launches its kernels from Python (hf_qattn/kv_cache/step_graph.py)
    os.environ["HF_QATTN_STEP_GRAPHS"] = "0" if mode.endswith("step graphs off") else "1"
    if mode == "flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return contextlib.nullcontext()


def _new_cache(model, mode: str):
    return hf_qattn.QAttnCache(model, plan="int8") if mode.startswith("qattn") else tf.DynamicCache(config=model.config)


def _prefilled(model, mode: str, prompt: int):
    """A fresh cache for ``mode`` filled by a random prompt, and a function running one greedy decode step over it
    (call both under ``_use(model, mode)`` and ``torch.no_grad()``)."""
    cache = _new_cache(model, mode)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=model.device)
    token = model(ids, **{CACHE_KW: cache}, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

    def step():
        nonlocal token
        token = model(token, **{CACHE_KW: cache}, use_cache=True).logits[:, -1:].argmax(-1)

    return cache, step


def _cprofile(step, steps: int, rows: int, cumulative_filter=None, cumulative_rows: int = 40):
    """Prints a cProfile of ``steps`` calls of ``step``: functions by own time, then by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(*(a for a in (cumulative_filter, cumulative_rows) if a is not None))


@torch.no_grad()
def probe(model, mode: str, prompt: int = 4096, cprofile: bool = False):
    with _use(model, mode):
        _, step = _prefilled(model, mode, prompt)

        # events and the host clock around the same synchronised step (bench_decode's per-step timing), then
        # an unsynchronised run: three views of one step at once, so not one of eval/timing.py's loops
        events, hosts = [], []
        for i in range(24):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            if i >= 8:
                events.append(start.elapsed_time(end))
                hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(24):
            step()
        issue = (time.perf_counter() - t0) * 1e3 / 24
        torch.cuda.synchronize()
        free_run = (time.perf_counter() - t0) * 1e3 / 24
        print(f"== {mode} L={prompt}: event ms/step {statistics.median(events):.2f}, synchronised wall ms/step "
              f"{statistics.median(hosts):.2f}, unsynchronised: host issue {issue:.2f} ms/step, "
              f"wall {free_run:.2f} ms/step", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
        if cprofile:
            _cprofile(step, 8, 30)


@torch.no_grad()
def alternate(model, prompt: int, rounds: int = 8, steps: int = 24):
    """Eager steps of SDPA flash + DynamicCache and qattn + QAttnCache (int8), with and without the layers' step
    graphs, in alternating blocks of ``steps``,
    ``rounds`` blocks each, no profiler (the profiler's hooks slow every launch after it): the host's speed
    drifts on a shared machine, so the two are compared block by block. Prints the median ms a step of each
    and of their per-round ratio."""
    runs = {}  # mode: (step, ms a step of each round)
    for mode in ("flash", "qattn", "qattn, step graphs off"):
        with _use(model, mode):
            runs[mode] = (_prefilled(model, mode, prompt)[1], [])
    for _ in range(rounds + 1):  # the first round warms up
        for mode, (step, times) in runs.items():
            with _use(model, mode):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    flash = runs["flash"][1][1:]
    for mode in ("qattn", "qattn, step graphs off"):
        qattn = runs[mode][1][1:]
        ratios = [f / q for f, q in zip(flash, qattn)]
        print(f"== alternating L={prompt}: flash {statistics.median(flash):.2f} ms/step, {mode} "
              f"{statistics.median(qattn):.2f} ms/step, flash/qattn per round: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}–{max(ratios):.3f} ({rounds} rounds of {steps} steps)", flush=True)


@torch.no_grad()
def layers(model, prompt: int, rounds: int = 3, steps: int = 48):
    """Host µs a layer of the attention function and of the cache layer's update within eager steps (flash and
    qattn in turn, ``rounds`` times), then a cProfile of 16 steps of each mode."""
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_qattn.kv_cache.cache import QAttnLayer

    spent = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return call

    attention = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ("sdpa", "qattn")}
    updates = {cls: cls.update for cls in (cache_utils.DynamicLayer, QAttnLayer)}
    for name, fn in attention.items():
        ALL_ATTENTION_FUNCTIONS[name] = timed("attention", fn)
    for cls, fn in updates.items():
        cls.update = timed("update", fn)
    try:
        for rnd in range(rounds):
            for mode in ("flash", "qattn"):
                with _use(model, mode):
                    cache, step = _prefilled(model, mode, prompt)
                    for _ in range(8):
                        step()
                    torch.cuda.synchronize()
                    spent.clear()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        step()
                    issue = (time.perf_counter() - t0) * 1e3 / steps
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - t0) * 1e3 / steps
                    per_layer = {name: round(t / steps / model.config.num_hidden_layers * 1e6, 1)
                                 for name, t in spent.items()}
                    print(f"round {rnd} {mode:6s} L={prompt}: host issue {issue:.2f} ms/step, wall {wall:.2f}; "
                          f"µs a layer {per_layer}", flush=True)
                    if rnd == rounds - 1:
                        print(f"--- cProfile {mode}, 16 steps")
                        _cprofile(step, 16, 35, r"attention|cache|step_graph|support|update|sdpa", 30)
                del cache, step
                torch.cuda.empty_cache()
    finally:
        for name, fn in attention.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn
        for cls, fn in updates.items():
            cls.update = fn


@torch.no_grad()
def captured(model, prompt: int, formats=("int8", "int4", "int8g"), steps: int = 32):
    """GPU ms of a replayed decode step by cache format against the floor of the model's step (no cache, one
    key), and the ms a token of a greedy loop that synchronises every token (captured_generate's loop)."""
    model.set_attn_implementation("sdpa")
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    position = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    forward = lambda: model(input_ids=ids, position_ids=position, use_cache=False).logits  # noqa: E731
    for _ in range(3):
        forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    floor = events_ms(graph.replay, calls=steps, warmup=3)
    print(f"== captured L={prompt}: floor (the step without a cache, one key, one graph) {floor:.3f} ms", flush=True)
    del graph
    model.set_attn_implementation("qattn")
    for fmt in formats:
        cache = hf_qattn.QAttnCache(model, plan="int8", int8_layout="groups") if fmt == "int8g" else \
            hf_qattn.QAttnCache(model, plan=fmt)
        cache.reserve(prompt + 8 * steps + 16)
        prompt_ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=model.device)
        token = model(prompt_ids, **{CACHE_KW: cache}, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        step = hf_qattn.CapturedDecodeStep(model, cache)
        for _ in range(3):  # eager warm-up, capture, one replay
            token = step(token)[:, -1:].argmax(-1)
        replayed = events_ms(step._graph.replay, calls=steps, warmup=3)
        unfinished = torch.ones(1, dtype=torch.long, device=model.device)

        def loop_step():
            nonlocal token
            logits = step(token)[:, -1]
            token = logits.to(torch.float32, copy=True).argmax(-1, keepdim=True)
            bool((unfinished & (token[:, 0] != -1)).any())  # the loop's stop test: one sync a token

        looped = events_ms(loop_step, calls=steps, warmup=3)  # CUDA events: the host's waits included
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step._graph.replay()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.self_device_time_total / 3) for e in prof.key_averages()), key=lambda kv: -kv[1])
        total = sum(t for _, t in kernels)
        attention = sum(t for name, t in kernels if any(k in name for k in ("decode", "append", "combine")))
        print(f"   {fmt}: replay {replayed:.3f} ms (floor + {replayed - floor:.3f}), greedy loop synchronised every "
              f"token {looped:.3f} ms; profiled kernels {total / 1e3:.3f} ms a step, of which decode/append "
              f"{attention / 1e3:.3f} ms", flush=True)
        for name, t in kernels[:12]:
            print(f"      {t:8.1f} µs  {name[:110]}")
        cache = step = None
        torch.cuda.empty_cache()


@torch.no_grad()
def startup(model, prompt: int, counts=(1, 2, 3, 17, 65, 257), profile: bool = True):
    """A ``captured_generate`` call's fixed cost: ms of ``model.generate`` by new-token count (the faster of two
    calls after a warm-up call), then the first CapturedDecodeStep calls one by one (eager warm-up, capture +
    replay, replays), synchronised."""
    model.set_attn_implementation("qattn")
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=model.device)

    def call(new):
        kwargs = {CACHE_KW: hf_qattn.QAttnCache(model, plan="int8")}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones_like(ids), custom_generate=hf_qattn.captured_generate, **kwargs)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    call(counts[-1])
    times = {new: min(call(new) for _ in range(2)) for new in counts}
    print(f"== startup L={prompt}: generate ms by new tokens " + ", ".join(f"{n}: {t:.1f}" for n, t in times.items()))
    slope = (times[counts[-1]] - times[counts[-2]]) / (counts[-1] - counts[-2])
    print(f"   ms a token from {counts[-2]}→{counts[-1]}: {slope:.3f}; fixed cost of the decode (T(2) − T(1) − slope): "
          f"{times[2] - times[1] - slope:.1f} ms; (T({counts[-2]}) − T(1)) / {counts[-2] - 1} = "
          f"{(times[counts[-2]] - times[1]) / (counts[-2] - 1):.3f} ms a token", flush=True)
    cache = hf_qattn.QAttnCache(model, plan="int8")
    cache.reserve(prompt + 16)
    token = model(ids, **{CACHE_KW: cache}, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    step = hf_qattn.CapturedDecodeStep(model, cache)
    spent = [(time.perf_counter() - t0) * 1e3]
    import cProfile
    import pstats

    profiles = []
    for _ in range(4):
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        token = step(token)[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        profiler.disable()
        spent.append((time.perf_counter() - t0) * 1e3)
        profiles.append(profiler)
    print("   CapturedDecodeStep ms (under cProfile): build {:.1f}, eager warm-up {:.1f}, capture + replay {:.1f}, "
          "replays {:.2f}, {:.2f}".format(*spent), flush=True)
    if profile:
        for name, profiler in zip(("eager warm-up", "capture + replay"), profiles):
            print(f"--- cProfile: {name}")
            pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(18)
            pstats.Stats(profiler).strip_dirs().sort_stats("cumulative").print_stats(30)


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("alternate", "layers", "captured", "startup"):
        model = build()
        run = {"alternate": alternate, "layers": layers, "captured": captured, "startup": startup}[sys.argv[1]]
        for prompt in (int(n) for n in sys.argv[2].split(",")):
            run(model, prompt)
        return
    prompt = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["sdpa", "qattn", "sdpa"]  # sdpa twice: first-run effects
    cprofile = len(sys.argv) > 3 and sys.argv[3] == "cprofile"
    model = build()
    for mode in modes:
        probe(model, mode, prompt, cprofile)


if __name__ == "__main__":
    main()
