"""``torch.ops.hf_qattn.attention``: the quantized attention launch as one compiler-visible op.

:func:`hf_qattn.qattn` decides everything in Python — argument checks, the path
(:func:`hf_qattn.support.select_path`), statistics and warnings — and then runs the launch. Eagerly it
calls :func:`launch` directly; inside ``torch.compile`` it calls this op instead, so the compiler
sees one opaque node with a known output (its fake implementation) and no graph break.

The op is a ``torch.library.custom_op`` (not ``triton_op``): the sm90 kernel is Gluon, which
``wrap_triton`` cannot trace, and inductor has nothing to fuse inside the launch anyway. It mutates
nothing and reads no tensor value on the host (key ranges stay tensors), so CUDA graphs
(``mode="reduce-overhead"``) capture it.

Signature (``path`` is ``"hopper"``, ``"triton"`` or ``"reference"``; ``layout`` ``"HND"`` / ``"NHD"``)::

    attention(q, k, v, kv_start, kv_end, path, is_causal, sm_scale, qk, pv, layout,
              smooth_q, smooth_k, smooth_v, return_lse, split_channel,
              window=0, chunk=0, sinks=None, softcap=0.0) -> (out, lse)

The variants of :func:`hf_qattn.qattn` in the op's types: ``window`` / ``chunk`` ints with 0 for none,
``sinks`` an optional (Hq,) float tensor, ``softcap`` a float with 0.0 for none.

``out`` has q's shape and dtype (contiguous, in q's layout); ``lse`` is (B, Hq, Nq) float32 with
``return_lse``, else an empty float32 tensor of shape (0,).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import support

OP_NAME = "hf_qattn::attention"
KERNEL_PATHS = (support.HOPPER, support.TRITON, support.REFERENCE)


def launch(q, k, v, kv_start, kv_end, *, path: str, is_causal: bool, sm_scale: float, qk: str, pv: str, layout: str,
           smooth_q: bool, smooth_k: bool, smooth_v: bool, return_lse: bool, split_channel: bool = False,
           window: int = 0, chunk: int = 0, sinks: Optional[torch.Tensor] = None, softcap: float = 0.0):
    """Run one decided call on ``path``: (out in q's layout, contiguous; lse or None). No checks, no counting.
    window / chunk / softcap: 0 for none (the op's types)."""
    if (window or chunk) and not is_causal:  # the op is public: every path refuses what qattn refuses
        raise ValueError(f"window and chunk need is_causal=True; got window={window}, chunk={chunk}")
    qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
    if path in (support.HOPPER, support.TRITON):
        from hf_qattn.kernels import launch as kernels

        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        out_h = out if layout == "HND" else out.transpose(1, 2)
        options = dict(is_causal=is_causal, sm_scale=sm_scale, qk=qk, smooth_q=smooth_q, smooth_k=smooth_k,
                       smooth_v=smooth_v, kv_start=kv_start, kv_end=kv_end, return_lse=return_lse,
                       split_channel=split_channel, window=window, chunk=chunk, sinks=sinks, softcap=softcap)
        # Launch on the inputs' GPU, not the current one: Triton takes the device and stream from the
        # current device, so a tensor on cuda:1 under cuda:0 (device_map="auto") would run on the wrong
        # stream, racing the producer of q/k/v (measured: all-NaN logits on 2 GPUs).
        with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
            if path == support.HOPPER:
                lse = kernels.hopper_attention(qh, kh, vh, out_h, **options)
            else:
                lse = kernels.triton_attention(qh, kh, vh, out_h, v_fp8=pv == "fp8", **options)
        return out, lse
    if path != support.REFERENCE:
        raise ValueError(f"hf_qattn::attention serves the paths {KERNEL_PATHS}; got {path!r}")
    from hf_qattn import reference
    from hf_qattn.kernels.tuning import attention_config, reference_settings

    # torch sums in an order that depends on strides: contiguous HND views make both layouts bit-identical
    qh, kh, vh = (t.contiguous() for t in (qh, kh, vh))
    # the portable Triton kernel's tiles on sm90 (the Hopper kernel's granularities differ: see the README)
    settings = reference_settings(attention_config("sm90", qh.shape[-1], is_causal, pv, qk))
    result = reference.quantized_attention(
        qh, kh, vh, is_causal=is_causal, sm_scale=sm_scale, qk=qk, pv="fp8_e4m3" if pv == "fp8" else "fp16",
        smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v, kv_start=kv_start, kv_end=kv_end,
        return_lse=return_lse, split_channel=split_channel, window=window or None, chunk=chunk or None, sinks=sinks,
        softcap=softcap or None, **settings)
    out, lse = result if return_lse else (result, None)
    out = out.to(q.dtype)
    out = (out if layout == "HND" else out.transpose(1, 2)).contiguous()  # q's layout, as the kernels write it
    return out, (None if lse is None else lse.contiguous())


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: Optional[torch.Tensor],
              kv_end: Optional[torch.Tensor], path: str, is_causal: bool, sm_scale: float, qk: str, pv: str,
              layout: str, smooth_q: bool, smooth_k: bool, smooth_v: bool,
              return_lse: bool, split_channel: bool = False, window: int = 0, chunk: int = 0,
              sinks: Optional[torch.Tensor] = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = launch(q, k, v, kv_start, kv_end, path=path, is_causal=is_causal, sm_scale=sm_scale, qk=qk, pv=pv,
                      layout=layout, smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v, return_lse=return_lse,
                      split_channel=split_channel, window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    if lse is None:
        lse = q.new_empty(0, dtype=torch.float32)
    return out, lse


@attention.register_fake
def _(q, k, v, kv_start, kv_end, path, is_causal, sm_scale, qk, pv, layout, smooth_q, smooth_k, smooth_v,
      return_lse, split_channel=False, window=0, chunk=0, sinks=None, softcap=0.0):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not return_lse:
        return out, q.new_empty(0, dtype=torch.float32)
    b, hq, nq = (q.shape[0], q.shape[1], q.shape[2]) if layout == "HND" else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty((b, hq, nq), dtype=torch.float32)


def run(q, k, v, kv_start, kv_end, **options):
    """The launch of a decided call: through the op inside ``torch.compile``, directly otherwise.
    Returns (out, lse or None)."""
    if torch.compiler.is_compiling():
        out, lse = attention(q, k, v, kv_start, kv_end, **options)
        return out, (lse if options["return_lse"] else None)
    return launch(q, k, v, kv_start, kv_end, **options)


def _record_now(path: str, reason) -> int:
    from . import stats

    stats.record(path, reason)
    return 0


# Under torch.compile: run while tracing, the answer a constant of the graph, so counting and the
# once-per-reason warning cost no graph break (counted once per traced call site, not per call).
_record_once = torch._dynamo.assume_constant_result(lambda path, reason: _record_now(path, reason))


def record(path: str, reason=None) -> None:
    """Count a call served by ``path`` (with ``reason``: a fallback, warned once) — per call eagerly,
    once per traced call site inside ``torch.compile``."""
    (_record_once if torch.compiler.is_compiling() else _record_now)(path, reason)
