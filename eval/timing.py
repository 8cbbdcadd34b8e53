"""GPU and host timing for the eval scripts: the loops each benchmark needs, written once.

- ``bench_ms``: ``triton.testing.do_bench``'s median (Triton flushes L2 between calls): kernel-level speed.
- ``bench_graph_ms``: ``triton.testing.do_bench_cudagraph``'s median: the same call replayed from Triton's
  CUDA graph, GPU time without Python and launch gaps.
- ``events_ms``: back-to-back calls between two CUDA events, what a loop of eager calls sees (the GPU waits
  whenever the host is slower than it); median over repeats of the mean ms a call. The host clock where
  CUDA is absent (the scripts' CPU ``--tiny`` modes).
- ``graph_ms``: a CUDA graph of ``calls`` calls captured here and replayed, median of the replays, ms a call.
- ``host_us``: the host's µs to issue one call (Python, allocation, launch), the GPU held busy by a sleep
  kernel so that launches only queue.

Medians are ``statistics.median`` (the mean of the two middle samples for an even count).
"""

from __future__ import annotations

import statistics
import time

import torch


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn()`` by ``triton.testing.do_bench`` (``warmup`` / ``rep`` in ms, Triton's meaning),
    after one call outside the measurement (compilation, autotuning)."""
    from triton.testing import do_bench

    fn()
    _sync()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph_ms(fn, rep: int = 100) -> float:
    """Median ms of ``fn()`` replayed from a CUDA graph by ``triton.testing.do_bench_cudagraph``."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def events_ms(fn, calls: int = 1, repeats: int = 5, warmup: int = 1) -> float:
    """Median over ``repeats`` of the mean ms a call of ``calls`` back-to-back ``fn()`` calls, timed by CUDA
    events on the current stream (the host clock without CUDA), after ``warmup`` calls and a synchronize."""
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        if _cuda():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """GPU ms a call: ``calls`` calls captured in one CUDA graph (after 3 calls on a side stream, as
    capture requires), the graph replayed ``replays`` times, each replay timed by events; the median."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return events_ms(graph.replay, calls=1, repeats=replays, warmup=0) / calls


def host_us(fn, calls: int = 30, repeats: int = 5, hold_gpu: bool = True) -> float:
    """µs of host time to issue one ``fn()`` call: median over ``repeats`` of the mean over ``calls`` calls.

    ``hold_gpu``: a sleep kernel (≈ 0.2 s of GPU cycles, longer than the calls take to issue) runs first, so
    every launch only queues and the figure is host time alone. Without it (or without CUDA) the calls run
    as they come; the GPU is waited for after each sample, outside the timing."""
    fn()
    _sync()
    samples = []
    for _ in range(repeats):
        if hold_gpu and _cuda():
            torch.cuda._sleep(int(3e8))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        _sync()
    return statistics.median(samples)
