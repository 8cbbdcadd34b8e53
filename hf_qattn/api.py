"""``qattn``: the one documented entry point. Checks its arguments once, picks a path, runs it.

Layouts: ``"HND"`` is (batch, heads, tokens, head_dim), ``"NHD"`` is (batch, tokens, heads,
head_dim); the output has q's layout, shape and dtype. Q has ``Hq`` heads, K and V ``Hk``, with
``Hq % Hk == 0`` (GQA/MQA). The path (``triton``, ``reference``, or the ``sdpa`` fallback, counted
and warned once per reason by :func:`hf_qattn.fallback_stats`) is chosen by
:func:`hf_qattn.support.select_path`, the only policy point.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import torch

from . import ops, reference, stats, support
from .kernels import settings
from .support import BACKENDS, DTYPES, MAX_KERNEL_HEAD_DIM  # noqa: F401  (re-exported)

QK_CHOICES = ("int8", "int4")
PV_CHOICES = ("fp8", "fp16")
LAYOUTS = ("HND", "NHD")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _check_range(name: str, t: torch.Tensor | None, batch: int, nk: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must be an int32/int64 tensor of shape (batch,) = ({batch},)")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}); got {t.device}")
    if t.device.type == "cpu" and not torch.compiler.is_compiling() and bool(((t < 0) | (t > nk)).any()):
        raise ValueError(f"{name} values must lie in [0, {nk}] (the key length)")


def _check_sm_scale(sm_scale) -> float | None:
    if sm_scale is None:
        return None
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise ValueError(f"sm_scale must be a finite real number or None; got {type(sm_scale).__name__} {sm_scale!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite real number or None; got {sm_scale!r}")
    return float(sm_scale)


def _filled(t):
    """``t`` itself, or, for the output of a collective of torch's functional API that may still be in flight
    (an ``AsyncCollectiveTensor``: diffusers' ring all-gathers K and V into one, Ulysses exchanges heads by
    one), the tensor it wraps once the collective has filled it. Torch ops wait for such a tensor by
    themselves; the kernels read its memory directly (its own ``data_ptr()`` is 0), so they must not see it."""
    wait = None if type(t) is torch.Tensor else getattr(t, "trigger_wait", None)
    return t if wait is None else wait()


def _validate(q, k, v, layout, qk, pv, backend, kv_start, kv_end):
    _choice("qk", qk, QK_CHOICES)
    _choice("pv", pv, PV_CHOICES)
    _choice("layout", layout, LAYOUTS)
    _choice("backend", backend, BACKENDS)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions ({layout}); got shape {tuple(t.shape)}")
    hnd = [t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v)]
    wrong = support.argument_gap(*hnd)  # dtypes, devices, shapes: the rules the integrations fall back on
    if wrong is not None:
        raise ValueError(wrong[1])
    b, nk = hnd[0].shape[0], hnd[1].shape[2]
    _check_range("kv_start", kv_start, b, nk, q.device)
    _check_range("kv_end", kv_end, b, nk, q.device)
    # start > end: an error where checking is free (CPU tensors); on a GPU a check would wait for the
    # device, so the kernels read such a range as empty (zeros, lse -inf) and values are clamped to [0, Nk]
    if (kv_start is not None and kv_end is not None and kv_start.device.type == "cpu"
            and not torch.compiler.is_compiling()):  # a value check: inside a compiled graph it would break it
        bad = (kv_start > kv_end).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"kv_start must not exceed kv_end; sequence {bad[0]} has kv_start "
                             f"{int(kv_start[bad[0]])} > kv_end {int(kv_end[bad[0]])}")
    return hnd


def _empty_result(qh, kh, vh, *, is_causal, sm_scale, kv_start, kv_end, return_lse, **variants):
    """The result of a call with a zero-size dimension, in HND and float32, computed by plain attention
    (no launch): empty, or zeros with lse -inf for rows that see no key (Nk = 0; a sink's logit with sinks);
    with head_dim 0 the scores are all 0, so lse is log(visible keys)."""
    b, hq, nq, d = qh.shape
    if kh.shape[1] == 0:  # no heads at all (Hq = Hk = 0)
        return qh.new_zeros(b, 0, nq, d, dtype=torch.float32), qh.new_zeros(b, 0, nq, dtype=torch.float32)
    return reference.exact_attention(qh, kh, vh, is_causal=is_causal, sm_scale=sm_scale if d else 1.0,
                                     kv_start=kv_start, kv_end=kv_end, return_lse=True, dtype=torch.float32,
                                     **variants)


def qattn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    sm_scale: float | None = None,
    qk: Literal["int8", "int4"] = "int8",
    pv: Literal["fp8", "fp16"] = "fp8",
    layout: Literal["HND", "NHD"] = "HND",
    smooth_q: bool = True,
    smooth_k: bool = True,
    smooth_v: bool = True,
    return_lse: bool = False,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    backend: Literal["auto", "hopper", "triton", "reference"] = "auto",
    split_channel: bool | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """Quantized attention: Q·Kᵀ in INT8 or INT4 range, P·V in FP8 (E4M3), with Q/K/V smoothing.

    Args:
        q, k, v: float16 / bfloat16 / float32 tensors in ``layout``; k and v may have fewer heads.
        is_causal: mask keys right of the diagonal, aligned bottom-right when Nq ≠ Nk.
        sm_scale: softmax scale, default 1/sqrt(head_dim).
        qk: ``"int8"`` (±127) or ``"int4"`` (±7). Hopper has no INT4 tensor cores: there ``"int4"``
            runs as ``"int8"`` (more accurate, same speed) unless ``HF_QATTN_EXACT_INT4=1``.
        pv: ``"fp8"`` (E4M3) or ``"fp16"``. GPUs without FP8 tensor cores (sm80/86) run ``"fp16"``.
        smooth_q, smooth_k, smooth_v: subtract per-channel centers (exact; only error changes).
        return_lse: also return the log-sum-exp of the scaled scores, (B, Hq, Nq) float32 (natural log, smoothing
            included: shards of the keys merge by it exactly). With ``sinks`` it includes the sink, so merging
            shards called with sinks counts the sink once per shard: call the shards without, merge, then
            multiply the output by sigmoid(lse − sink) and take logaddexp(lse, sink). ``window`` / ``chunk``
            count positions from each call's key 0, so a key shard cannot take them.
        kv_start, kv_end: optional (batch,) int tensors; sequence b sees keys [start, end) —
            left/right padding without a mask tensor.
        backend: ``"auto"`` (kernels on capable GPUs, reference on CPU), or force one path.
        split_channel: compute one K channel per kv head in float outside the INT8 product when its
            range is ≥ 8× the head's mean channel range (large values of both signs, which smoothing
            cannot remove, would otherwise crush every other channel of K). Default: off, or the
            ``HF_QATTN_SPLIT_CHANNEL=1`` environment variable; on the H100 it makes a call 6–21 %
            slower (eval/results/split-channel-*.md), so it is for inputs known to need it.

    Attention variants (query row i sits at key position p = i + Nk − Nq, as for ``is_causal``):
        window: an int W ≥ 1: the query at p sees keys j with p − W < j ≤ p (transformers'
            ``sliding_window``). Needs ``is_causal=True``.
        chunk: an int C ≥ 1: the query at p sees keys j with j // C == p // C and j ≤ p (Llama 4's
            chunked attention; j counts from key 0 of the call). Needs ``is_causal=True``. With
            ``window`` both rules apply. Key tiles no query of a tile sees are skipped, not masked.
        sinks: a float tensor (Hq,) on q's device: one logit per query head, in the units of the scaled
            scores, that joins each row's softmax denominator without a value (gpt-oss).
        softcap: a float c > 0: scores s = sm_scale·q·k become c·tanh(s / c) before the softmax (Gemma 2).
        All combine with each other, key ranges, GQA, both layouts and every precision.

    Returns the output in q's layout, shape and dtype; with ``return_lse``, ``(out, lse)``: lse is
    the log of the denominator actually used (capped scores, the sink's term included).
    Rows that see no key give zeros (lse −inf; with sinks, the sink's logit). NaN or ±Inf in q, k or v
    comes out NaN in the rows it reaches (with smoothing on, through the centers, that can be the whole
    head), never zeros.
    A call with a zero-size dimension returns its (empty or zero) result without a launch, uncounted.
    Inference only: with gradients required, ``"auto"`` falls back to SDPA (counted), a forced
    backend raises ``RuntimeError``.
    """
    q, k, v = _filled(q), _filled(k), _filled(v)
    qh, kh, vh = _validate(q, k, v, layout, qk, pv, backend, kv_start, kv_end)
    sm_scale = _check_sm_scale(sm_scale)
    if split_channel is None:
        split_channel = settings.split_channel()
    elif not isinstance(split_channel, bool):
        raise ValueError(f"split_channel must be True, False or None; got {split_channel!r}")
    for name, flag in (("is_causal", is_causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):  # a string or None would be read by its truth, silently
            raise ValueError(f"{name} must be True or False; got {flag!r}")
    b, hq, nq, d = qh.shape
    nk = kh.shape[2]
    variants = support.check_variants(window=window, chunk=chunk, sinks=sinks, softcap=softcap, is_causal=is_causal,
                                      heads=hq, device=q.device)
    if qh.numel() == 0 or kh.numel() == 0:  # a zero-size dimension: nothing to launch
        out, lse = _empty_result(qh, kh, vh, is_causal=is_causal, sm_scale=sm_scale, kv_start=kv_start,
                                 kv_end=kv_end, return_lse=return_lse, **variants)
        out = out.to(q.dtype)
        out = out if layout == "HND" else out.transpose(1, 2).contiguous()
        return (out, lse) if return_lse else out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if q.device.type == "cuda":  # see _validate: no check that would wait for the GPU, a well-defined range instead
        kv_start = None if kv_start is None else kv_start.clamp(0, nk)
        kv_end = None if kv_end is None else kv_end.clamp(0, nk)

    path, qk, pv = (_decide_once if torch.compiler.is_compiling() else _decide)(
        q.device.type, q.device.index, d, backend, qk, pv,
        support.REASON_GRAD if support.needs_grad(q, k, v, sinks) else None, support.variants_of(**variants))

    if path == support.SDPA:
        result = reference.sdpa_attention(qh, kh, vh, is_causal=is_causal, sm_scale=sm_scale,
                                          kv_start=kv_start, kv_end=kv_end, return_lse=return_lse, **variants)
        out, lse = result if return_lse else (result, None)
        out = out if layout == "HND" else out.transpose(1, 2).contiguous()  # q's layout, as the kernels write it
        return (out, lse) if return_lse else out
    out, lse = ops.run(q, k, v, kv_start, kv_end, path=path, is_causal=is_causal, sm_scale=sm_scale, qk=qk, pv=pv,
                       layout=layout, smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v, return_lse=return_lse,
                       split_channel=split_channel, window=variants["window"] or 0, chunk=variants["chunk"] or 0,
                       sinks=sinks, softcap=variants["softcap"] or 0.0)
    return (out, lse) if return_lse else out


class _Probe:
    """What :func:`hf_qattn.support.select_path` reads of q (device, head dim), without the tensor."""

    def __init__(self, device: torch.device, head_dim: int):
        self.device = device
        self.shape = (0, 0, 0, head_dim)


def _decide(device_type: str, device_index, head_dim: int, backend: str, qk: str, pv: str, gap, variants=()):
    """(path, qk, pv) a call runs, counted (and a fallback warned once): the policy part of ``qattn``.
    Its arguments are plain values, so under ``torch.compile`` it runs once per traced call site.
    ``variants``: the names of the attention variants the call uses (:func:`hf_qattn.support.variants_of`)."""
    probe = _Probe(torch.device(device_type, device_index) if device_index is not None else torch.device(device_type),
                   head_dim)
    if backend == "auto":
        qk = support.effective_qk(probe, qk)  # int4 runs INT8 on Hopper (no INT4 tensor cores there)
    path, reason = support.select_path(probe, backend, qk, pv, gap=gap, variants=variants)
    stats.record(path, reason)  # under torch.compile this runs while tracing (_decide_once): once per call site
    if path == support.TRITON and pv == "fp8" and not support.has_fp8_mma(probe.device):
        pv = "fp16"  # no FP8 tensor cores (Ampere): P·V runs in FP16, as documented for ``pv``
    return path, qk, pv


@torch._dynamo.assume_constant_result
def _decide_once(device_type: str, device_index, head_dim: int, backend: str, qk: str, pv: str, gap, variants=()):
    """:func:`_decide` under ``torch.compile``: run in Python while tracing, its answer a constant of the
    graph (decided once per call site, counted once per compilation; a forced backend that cannot serve
    the call raises while compiling)."""
    return _decide(device_type, device_index, head_dim, backend, qk, pv, gap, variants)
