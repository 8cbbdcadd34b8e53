"""What the host spends to issue one qattn call, piece by piece (H100; the GPU held busy, so only issue time).

    bash eval/device_run.sh bash -c 'python3 eval/studies/host_overhead.py --out $OUT'
    bash eval/device_run.sh python3 eval/studies/host_overhead.py --decode-only

``--prefill``: whole prefill calls of four shapes (1k GQA, causal 2k B4, window 1024 d128, gpt-oss's sinks + window
128 d64) with the K/V pass's buffers kept between calls (kernels/workspace.py) and without (``HF_QATTN_WORKSPACE_MB=0``),
in alternating rounds; the host's pace moves by ±40 % over seconds on a lent machine, so each side's least and
median µs of its rounds, and the call's GPU time beside them.

``--decode-only``: one decode step of one attention layer instead (B1 Hq32 Hk8 d128 bf16, a 4k-token cache):
transformers' DynamicCache + SDPA flash against QAttnCache + qattn, the qattn layer's pieces, and a cProfile of
its step.

Prints µs per operation: a qattn call (B1 H32 N1k d128 fp16) and its pieces — the three launches
through Triton's JIT path, the same launches with their arguments already bound (the compiled
kernel's ``run``, which is what remains when binding and the cache lookup are skipped), Triton's
binder alone, a TMA descriptor built on the host and encoded, a ``torch.empty`` — and a decode step's
two launches (append, decode). Every figure is a median of 5 × 30 issues while a sleep kernel keeps
the GPU busy (``timing.host_us``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

import hf_qattn
from hf_qattn.kernels import decode_launch, launch, tuning

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
from timing import host_us  # noqa: E402


def bound_launch(jit_fn, grid, args, kwargs):
    """A closure that launches ``jit_fn`` with ``args`` already bound: what Triton's run does after its
    binder and cache lookup (the compiled kernel's launcher, on the current stream)."""
    import triton
    from triton.runtime import driver

    kernel = jit_fn[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    _, _, _, _, binder = jit_fn.device_caches[device]
    bound, _, _ = binder(*args, **kwargs)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def run():
        stream = driver.active.get_current_stream(device)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                   triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook, *values)
    return run, (lambda: binder(*args, **kwargs))


def capture_launches(fn):
    """Run ``fn`` once, recording every JIT launch it makes as (jit function, grid, args, kwargs)."""
    from triton.runtime.jit import JITFunction

    seen = []
    original = JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append((self, grid, args, dict(kwargs)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        fn()
    finally:
        JITFunction.run = original
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--decode-only", action="store_true", help="only a decode step's layer and its pieces")
    parser.add_argument("--prefill", action="store_true", help="prefill calls with and without kept buffers")
    parser.add_argument("--rounds", type=int, default=15, help="--prefill: alternating rounds")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    if args.prefill:
        print("\n".join(prefill_workspace_rows(args.rounds)))
        return
    if args.decode_only:
        rows = decode_layer_rows()
        print("\n".join(f"| {name} | {us:.1f} |" for name, us in rows))
        return
    q, k, v = (torch.randn(1, 32, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    call = lambda: hf_qattn.qattn(q, k, v)  # noqa: E731
    rows.append(("qattn B1 H32 N1k d128 (whole call)", host_us(call)))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    rows.append(("SDPA same shape (whole call)", host_us(sdpa)))
    for jit_fn, grid, a, kw in capture_launches(call):
        name = getattr(jit_fn, "__name__", None) or getattr(jit_fn, "fn", jit_fn).__name__
        kw = {key: value for key, value in kw.items() if key not in ("debug", "instrumentation_mode")}
        rows.append((f"{name}: JIT launch", host_us(lambda: jit_fn[grid](*a, **kw))))
        try:
            bound, binder = bound_launch(jit_fn, grid, a, kw)
            rows.append((f"{name}: bound launch (compiled kernel's run)", host_us(bound)))
            rows.append((f"{name}: binder alone", host_us(binder)))
        except Exception as error:  # noqa: BLE001 - a probe: report, go on
            rows.append((f"{name}: bound launch failed: {type(error).__name__}: {error}"[:150], float("nan")))
    from hf_qattn.kernels.hopper.gluon_api import TensorDescriptor as GluonDescriptor

    buf = torch.empty(32 * 1024, 128, device="cuda", dtype=torch.int8)
    layout = launch._hopper_layouts(128, 128)[0]
    rows.append(("Gluon TensorDescriptor.from_tensor", host_us(lambda: GluonDescriptor.from_tensor(buf, [128, 128], layout))))
    rows.append(("torch.empty (4 MiB)", host_us(lambda: torch.empty(32 * 1024, 128, device="cuda", dtype=torch.int8))))
    rows.append(("torch.full (small)", host_us(lambda: torch.full((128, 2, 128), float("-inf"), device="cuda"))))

    # a decode step's two launches, B1 Hq32 Hk8 L4k
    kc, vc = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = hf_qattn.QAttnCache(_Config(), plan="int8")
    cache.update(kc, vc, 0)
    store = cache.layers[0].storage()
    k1, v1 = (torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q1 = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    rows.append(("decode: append one token (JIT launch)", host_us(
        lambda: decode_launch.append(k1, v1, store.k_bar, store.v_bar, store, 4095))))
    rows.append(("decode: attention step (JIT launch)", host_us(
        lambda: decode_launch.decode(q1, store, store.v_bar, 4096))))
    for jit_fn, grid, a, kw in capture_launches(lambda: decode_launch.decode(q1, store, store.v_bar, 4096)):
        kw = {key: value for key, value in kw.items() if key not in ("debug", "instrumentation_mode")}
        bound, binder = bound_launch(jit_fn, grid, a, kw)
        rows.append(("decode: attention step, bound launch", host_us(bound)))
        rows.append(("decode: attention step, binder alone", host_us(binder)))

    import triton

    text = [f"# Host time to issue a qattn call, by piece — {torch.cuda.get_device_name()}, {datetime.date.today()}",
            "", f"torch {torch.__version__}, triton {triton.__version__}; µs per issue, GPU held busy "
            "(median of 5 × 30). Command: `python3 eval/host_overhead.py`", "", "| what | host µs |", "|---|---|"]
    text += [f"| {name} | {us:.1f} |" for name, us in rows]
    text += ["", "## Where the host time of a qattn call goes (cProfile, 300 calls, GPU busy; own time first)", "",
             "```", _profile(call), "```"]
    report = "\n".join(text) + "\n"
    print(report)
    if args.out:
        name = f"host-overhead-{torch.cuda.get_device_name().replace(' ', '-')}-{datetime.date.today()}.md"
        with open(os.path.join(args.out, name), "w") as f:
            f.write(report)


def prefill_workspace_rows(rounds: int) -> list[str]:
    """Markdown rows: host µs a prefill call with the K/V pass's buffers made anew (``HF_QATTN_WORKSPACE_MB=0``)
    and kept, least / median of ``rounds`` alternating rounds of 20 calls each, and the call's GPU time."""
    from hf_qattn.kernels import settings
    from timing import graph_ms

    def qkv(b, hq, hk, n, d):
        return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)]

    sinks = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    shapes = {"causal 1k B1 GQA 32/8 d128": (qkv(1, 32, 8, 1024, 128), {}),
              "causal 2k B4 H32 d128": (qkv(4, 32, 32, 2048, 128), {}),
              "window 1024, 8k B1 H32 d128": (qkv(1, 32, 32, 8192, 128), dict(window=1024)),
              "gpt-oss: sinks + window 128, 8k B1 GQA 64/8 d64": (qkv(1, 64, 8, 8192, 64),
                                                                  dict(window=128, sinks=sinks))}
    old = os.environ.get(settings.WORKSPACE_MB)
    rows = ["| call | host µs, new buffers (least / median) | host µs, kept (least / median) | kept / new (least) | "
            "GPU µs |", "|---|---|---|---|---|"]
    try:
        for name, ((q, k, v), options) in shapes.items():
            call = lambda: hf_qattn.qattn(q, k, v, is_causal=True, **options)  # noqa: E731
            samples = {"0": [], "256": []}
            for _ in range(rounds):
                for budget, found in samples.items():
                    os.environ[settings.WORKSPACE_MB] = budget
                    found.append(host_us(call, calls=20, repeats=1))
            new, kept = (sorted(samples[b]) for b in ("0", "256"))
            rows.append(f"| {name} | {new[0]:.1f} / {new[rounds // 2]:.1f} | {kept[0]:.1f} / {kept[rounds // 2]:.1f} | "
                        f"{kept[0] / new[0]:.2f} | {graph_ms(call) * 1e3:.1f} |")
            print(rows[-1], flush=True)
    finally:
        if old is None:
            os.environ.pop(settings.WORKSPACE_MB, None)
        else:
            os.environ[settings.WORKSPACE_MB] = old
    return rows


def decode_layer_rows(prompt: int = 4096):
    """Host µs of one decode step of one attention layer (B1, Hq32 Hk8 d128, bf16, a ``prompt``-token cache):
    transformers' DynamicCache + SDPA (flash) against QAttnCache + qattn, and the qattn layer's pieces."""
    import transformers as tf
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_qattn.integrations.transformers import attention as integration
    from hf_qattn.kv_cache import attention as kv_attention

    config = tf.LlamaConfig(num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                            head_dim=128, intermediate_size=64, vocab_size=64)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="qattn", dtype=torch.bfloat16)
    module = model.model.layers[0].self_attn
    scaling = module.scaling
    kc, vc = (torch.randn(1, 8, prompt, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k1, v1 = (torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q1 = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    rows = []
    dynamic = tf.DynamicCache(config=config)
    dynamic.update(kc, vc, 0)

    def flash_layer():
        key, value = dynamic.update(k1, v1, 0)
        return sdpa_attention_forward(module, q1, key, value, None, scaling=scaling)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        rows.append(("layer step: DynamicCache.update + SDPA flash", host_us(flash_layer)))
    cache = hf_qattn.QAttnCache(model, plan="int8")
    cache.update(kc, vc, 0)
    packed = cache.update(k1, v1, 0)

    def qattn_layer():
        key, value = cache.update(k1, v1, 0)
        return integration.qattn_attention_forward(module, q1, key, value, None, scaling=scaling)

    rows.append(("layer step: QAttnCache.update + qattn", host_us(qattn_layer)))
    rows.append(("  QAttnCache.update (append launch, PackedKV handles)", host_us(lambda: cache.update(k1, v1, 0))))
    rows.append(("  qattn_attention_forward over the packed layer", host_us(
        lambda: integration.qattn_attention_forward(module, q1, *packed, None, scaling=scaling))))
    pattern, _ = integration.resolve_pattern(module, q1, packed[0], None, None, {})
    def read_mask():
        integration.call_variants(module, q1, packed[0], packed[1], 0.0, {})
        return integration.resolve_pattern(module, q1, packed[0], None, None, {})

    rows.append(("    call_variants + step_pattern", host_us(lambda: kv_attention.step_pattern(q1, packed[0], read_mask))))
    rows.append(("    packed_attention", host_us(lambda: kv_attention.packed_attention(q1, packed[0], pattern, scaling))))
    layer = cache.layers[0]
    store = layer.storage()
    n = store.length
    rows.append(("      layer.storage()", host_us(layer.storage)))
    rows.append(("      decode_launch.decode", host_us(lambda: decode_launch.decode(q1, store, store.v_bar, n))))
    rows.append(("      decode_launch.append", host_us(
        lambda: decode_launch.append(k1, v1, store.k_bar, store.v_bar, store, n - 1))))
    rows.append(("  PackedKV handle", host_us(lambda: kv_attention.PackedKV(layer, "keys"))))
    from hf_qattn.kernels import fast_launch

    launcher = fast_launch.fast(decode_launch.decode_kernel)
    seen = []
    original = launcher.launch
    launcher.launch = lambda grid, a, kw: seen.append((grid, a, kw)) or original(grid, a, kw)
    decode_launch.decode(q1, store, store.v_bar, n)
    launcher.launch = original
    grid, a, kw = seen[-1]
    rows.append(("      decode: FastLauncher.launch, arguments given", host_us(lambda: launcher.launch(grid, a, kw))))
    rows.append(("      decode: its key", host_us(lambda: (torch.cuda.current_device(), fast_launch._args_key(
        a, launcher.plain), tuple(kw.items())))))
    kernel = launcher.launch(grid, a, kw)
    params = [*a, *launcher._params_tail(a, kw)]
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch._C._cuda_getCurrentRawStream(0)
    rows.append(("      decode: compiled kernel's run", host_us(lambda: kernel.run(
        g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *params))))
    print(_profile(qattn_layer, 200))
    return rows


def _profile(call, calls: int = 300) -> str:
    """cProfile of ``calls`` issues of ``call`` with the GPU held busy: the functions with the most own time."""
    import cProfile
    import io
    import pstats

    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # longer than the calls take to issue, even profiled
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


class _Config:
    """A one-layer Llama-like config for the cache (Hk 8, d128)."""

    def __init__(self):
        import transformers as tf

        self.config = tf.LlamaConfig(num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                                     hidden_size=4096, head_dim=128)


if __name__ == "__main__":
    main()
