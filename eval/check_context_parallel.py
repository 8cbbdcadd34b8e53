"""Device check for two GPUs: a Wan-shaped denoiser with diffusers' ring and Ulysses attention, qattn vs SDPA.

    bash eval/device_run.sh python3 eval/check_context_parallel.py --out eval/results/   # nvidia-h200-x2
    python eval/check_context_parallel.py --tiny                                        # the logic, CPU + gloo

Starts one process per GPU (``--world``, default 2; NCCL, or gloo on the CPU) and builds on each the same
Wan 2.1 14B-shaped transformer (40 heads × 128, hidden 5120; ``--layers`` blocks, random weights, bf16) with a
720p, 81-frame latent: 21 × 45 × 80 = 75,600 video tokens, 512 text tokens. Per rank it runs:

1. one GPU: the unsharded denoiser with SDPA (diffusers' native backend) and under ``hf_qattn.patch``;
2. ``ring_degree=world``, then 3. ``ulysses_degree=world`` (``transformer.enable_parallelism``), each with
   SDPA sharded the same way (diffusers' ``_native_flash`` backend: torch's flash attention, with the LSE
   the ring needs; on the CPU the native backend, Ulysses only) and under ``hf_qattn.patch``.

Reports ms per denoiser forward (CUDA events, median of ``--repeats``, the slowest rank), the speed-up of
each sharded run over one GPU and of sharded qattn over sharded SDPA, and each output's cosine to the
single-GPU qattn and SDPA outputs. PASS rows: sharded qattn's cosine to single-GPU qattn ≥ 0.999, its
cosine to single-GPU SDPA no more than 0.002 below single-GPU qattn's, and every self-attention call of the
sharded qattn runs on a qattn kernel path, every cross-attention call too or on SDPA as the patch routes calls
below the GPU's break-even (512 text tokens), none on a fallback. Timing rows are measurements (always PASS).
Diffusers is imported inside the worker only (the GPU machine gets it from the carried wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import socket
import sys
import tempfile
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from report import finish, versions  # eval/report.py
from timing import events_ms  # eval/timing.py

WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, rope_max_seq_len=1024)
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=16, ffn_dim=32, rope_max_seq_len=32)


def _latent_and_text(args, device, dtype, generator):
    if args.tiny:  # 3 × 4 × 4 = 48 tokens, 8 text tokens
        shape, text = (1, 4, 3, 8, 8), (1, 8, 32)
    else:  # 720p, 81 frames: latent 21 × 90 × 160, patches 21 × 45 × 80
        shape, text = (1, 16, 21, 90, 160), (1, 512, 4096)
    return dict(hidden_states=torch.randn(*shape, generator=generator).to(device, dtype),
                encoder_hidden_states=torch.randn(*text, generator=generator).to(device, dtype),
                timestep=torch.tensor([500], device=device), return_dict=False)


def _build(args, device, dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(args.seed)  # the same weights on every rank
    config = WAN_TINY if args.tiny else WAN_14B
    with device:  # initialised where it runs: a 14B-shaped block holds ~0.4 B weights
        model = WanTransformer3DModel(**config, num_layers=args.layers)
    return model.to(dtype).eval()


@contextlib.contextmanager
def _devices_for_diffusers(device):
    """diffusers places rank r on device ``r % torch.accelerator.device_count()``: a CPU-only torch has
    0 accelerators; there every rank gets the one CPU."""
    if device.type != "cpu":
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _worker(rank: int, world: int, port: int, args, result_file: str) -> None:
    import hf_qattn

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    from diffusers import ContextParallelConfig

    def slowest(ms: float) -> float:
        value = torch.tensor([ms], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return value.item()

    def timed(model, inputs):
        with torch.no_grad():
            out = model(**inputs)[0]
            torch.distributed.barrier()
            ms = events_ms(lambda: model(**inputs), calls=1, repeats=args.repeats, warmup=0)
        return out.float().cpu(), slowest(ms)

    inputs = _latent_and_text(args, device, dtype, torch.Generator().manual_seed(args.seed + 1))
    layers = args.layers
    report = {"runs": {}, "counts": {}}
    model = _build(args, device, dtype)
    report["runs"]["1 GPU sdpa"] = timed(model, inputs)
    with hf_qattn.patch(model, plan=args.plan):
        report["runs"]["1 GPU qattn"] = timed(model, inputs)
    del model
    for mode in ("ring", "ulysses"):
        model = _build(args, device, dtype)
        sdpa_backend = "_native_flash" if cuda else ("native" if mode == "ulysses" else None)
        if sdpa_backend is not None:
            model.set_attention_backend(sdpa_backend)
        with _devices_for_diffusers(device):
            model.enable_parallelism(config=ContextParallelConfig(**{f"{mode}_degree": world}))
        if sdpa_backend is not None:
            report["runs"][f"{mode} {world} sdpa"] = timed(model, inputs)
        hf_qattn.reset_fallback_stats()
        with hf_qattn.patch(model, plan=args.plan):
            report["runs"][f"{mode} {world} qattn"] = timed(model, inputs)
        counts = hf_qattn.fallback_stats()
        self_calls = layers * (world if mode == "ring" else 1)  # a ring call per key shard, cross-attention once
        forwards = 1 + args.repeats
        report["counts"][mode] = (counts, (self_calls + layers) * forwards, self_calls * forwards)
        del model
        if cuda:
            torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()
    if rank == 0:  # a file, not a queue: tensors sent through a queue die with the process that sent them
        torch.save(report, result_file)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rows_of(report: dict, world: int) -> list[tuple[str, bool, str]]:
    runs = report["runs"]
    one_q, one_q_ms = runs["1 GPU qattn"]
    one_s, one_s_ms = runs["1 GPU sdpa"]
    base = _cosine(one_q, one_s)
    rows = [(f"1 GPU: qattn {one_q_ms:.1f} ms, SDPA {one_s_ms:.1f} ms a forward", True,
             f"qattn {one_s_ms / one_q_ms:.2f}× SDPA; cosine qattn↔SDPA {base:.6f}")]
    for mode in ("ring", "ulysses"):
        out, ms = runs[f"{mode} {world} qattn"]
        cos_q, cos_s = _cosine(out, one_q), _cosine(out, one_s)
        sdpa = runs.get(f"{mode} {world} sdpa")
        timing = f"qattn {ms:.1f} ms a forward: {one_q_ms / ms:.2f}× one GPU qattn"
        if sdpa is not None:
            sdpa_out, sdpa_ms = sdpa
            timing += (f"; SDPA sharded {sdpa_ms:.1f} ms ({one_s_ms / sdpa_ms:.2f}× one GPU SDPA), qattn "
                       f"{sdpa_ms / ms:.2f}× it; SDPA sharded cosine to 1-GPU SDPA {_cosine(sdpa_out, one_s):.6f}")
        rows.append((f"{mode} over {world}: timing", True, timing))
        rows.append((f"{mode} over {world}: qattn output matches one GPU", cos_q >= 0.999 and cos_s >= base - 0.002,
                     f"cosine to 1-GPU qattn {cos_q:.6f}, to 1-GPU SDPA {cos_s:.6f} (1-GPU qattn's {base:.6f})"))
        counts, expected, self_expected = report["counts"][mode]
        served = sum(n for path, n in counts["calls"].items() if path in ("hopper", "triton", "reference"))
        routed = counts["calls"].get("sdpa-below-break-even", 0)  # the patch's choice for the 512 text tokens
        rows.append((f"{mode} over {world}: every call on qattn or routed below the break-even",
                     served + routed == expected and served >= self_expected and not counts["fallbacks"],
                     f"calls {counts['calls']} (expected {expected}, the {self_expected} self-attention calls on "
                     f"a qattn kernel path), fallbacks {counts['fallbacks']}"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Wan on the CPU with gloo: checks the logic")
    parser.add_argument("--world", type=int, default=2, help="processes (GPUs); the sharding degree")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--plan", default="int8", help="plan for hf_qattn.patch (int8, int4, or a plan file)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per run (after one untimed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=600, help="seconds a collective may wait")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the markdown result")
    args = parser.parse_args(argv)
    if not args.tiny and torch.cuda.device_count() < args.world:
        parser.error(f"--world {args.world} needs as many GPUs; found {torch.cuda.device_count()} (or use --tiny)")
    with tempfile.TemporaryDirectory() as folder:
        result_file = os.path.join(folder, "report.pt")
        mp.spawn(_worker, args=(args.world, _free_port(), args, result_file), nprocs=args.world, join=True)
        rows = rows_of(torch.load(result_file), args.world)
    return finish(f"Context parallelism over {args.world} {'CPU processes' if args.tiny else 'GPUs'}, Wan-shaped",
                  versions("diffusers"), rows, args.out, "context-parallel")


if __name__ == "__main__":
    sys.exit(main())
