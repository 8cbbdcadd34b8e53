"""What each attention path serves, and why not: the one place every caller asks.

Path names are the vocabulary of ``fallback_stats()["calls"]``, the same in :func:`hf_qattn.qattn`
and in both integrations:

- ``"hopper"``: the warp-specialized Gluon kernel for sm90 (``kernels/hopper/``): INT8 Q·Kᵀ, FP8
  P·V, head dim ≤ 256, a triton with the Gluon API it was written for;
- ``"triton"``: the Triton GPU kernels (CUDA tensors on compute capability ≥ 8.0, head dim ≤ 256;
  under ``TRITON_INTERPRET=1`` also CPU tensors, which is how the tests run them);
- ``"reference"``: the PyTorch simulation of the kernels' math (CPU tensors, or asked for);
- ``"sdpa"``: full-precision ``scaled_dot_product_attention``, a fallback for a call no kernel serves;
- ``"eager"``: the model's own eager attention, a fallback for what SDPA cannot express either
  (soft-capping, attention sinks, returned attention weights; transformers only);
- ``"unquantized-by-plan"``: full-precision attention because the plan says ``"unquantized"`` for
  that layer (a choice, not a fallback: no reason is counted and nothing is warned);
- ``"sdpa-below-break-even"``: SDPA for a transformers call too short for the quantized kernels to beat
  it on this GPU (:func:`below_break_even`; a choice like the plan's, counted, not warned).

:data:`KERNEL_PATHS` says, per quantized path, on which device type ``backend="auto"`` tries it and
why it cannot serve a call; :func:`select_path` walks it. A new kernel path (a Hopper kernel in
Gluon, say) is one more entry there, placed before the paths it should be preferred to.
:func:`call_gap` holds what no kernel path serves whatever the device (dropout, gradients, dtypes,
shapes); the integrations ask it before anything else. Its argument rules (:func:`argument_gap`) are
the ones :func:`hf_qattn.qattn` raises ``ValueError`` on: a call the API accepts is one the
integrations do not fall back on for its arguments, and the reverse.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

from . import stats
from .kernels import settings, tuning

# -- the path vocabulary -------------------------------------------------------------------------
HOPPER = "hopper"
TRITON = "triton"
REFERENCE = "reference"
SDPA = "sdpa"
EAGER = "eager"
UNQUANTIZED_BY_PLAN = "unquantized-by-plan"
BELOW_BREAK_EVEN = "sdpa-below-break-even"
FALLBACK_PATHS = (SDPA, EAGER)
HALF_DTYPES = (torch.float16, torch.bfloat16)

MAX_KERNEL_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# -- why a call cannot run quantized, whatever the device ------------------------------------------
REASON_DROPOUT = "attention dropout in training"
REASON_GRAD = "autograd through attention: gradients required (the quantized kernels are inference-only)"
REASON_DTYPE = "dtype other than float16/bfloat16/float32, or query/key/value dtypes differ"
REASON_VALUE_DIM = "query/key/value head dims differ"
REASON_HEAD_DIM = f"head_dim > {MAX_KERNEL_HEAD_DIM}"
REASON_BATCH = "query/key/value batch sizes, or key/value heads and lengths, differ"
REASON_HEADS = "query heads not a multiple of key/value heads"
REASON_DEVICE = "query/key/value on different devices"
# an sm90 GPU whose triton cannot build the Hopper kernel: the portable kernel serves, counted and warned
REASON_NO_GLUON = "the sm90 Gluon kernel cannot be built with the installed triton"


def needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *more: torch.Tensor | None) -> bool:
    """Whether autograd would flow through this attention call (the quantized kernels are inference-only);
    ``more``: other tensors the call reads (the sinks), None where absent."""
    # no generator: this runs twice in every decode step of every layer
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or any(t is not None and t.requires_grad for t in more))


def argument_gap(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[str, str] | None:
    """(reason, message) when (B, H, N, D) tensors are not the q, k, v of one attention call, else None.

    The one statement of these rules: :func:`hf_qattn.qattn` raises ``ValueError(message)`` at its
    boundary; the integrations, handed such tensors by a model, fall back under ``reason``
    (:func:`call_gap`). Zero heads on both sides is a call (an empty one); zero K/V heads for query
    heads is not.
    """
    for name, t in (("q", query), ("k", key), ("v", value)):
        if t.dtype not in DTYPES:
            return REASON_DTYPE, f"{name} must be float16, bfloat16 or float32; got {t.dtype}"
    if not (query.dtype == key.dtype == value.dtype):
        return REASON_DTYPE, f"q, k and v must share one dtype; got {query.dtype}, {key.dtype}, {value.dtype}"
    if not (query.device == key.device == value.device):
        return REASON_DEVICE, f"q, k and v must be on one device; got {query.device}, {key.device}, {value.device}"
    (b, hq, _, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = query.shape, key.shape, value.shape
    if not (b == bk == bv):
        return REASON_BATCH, f"q, k and v must have the same batch size; got {b}, {bk}, {bv}"
    if not (d == dk == dv):
        return REASON_VALUE_DIM, f"q, k and v must have the same head_dim; got {d}, {dk}, {dv}"
    if (hk, nk) != (hv, nv):
        return REASON_BATCH, f"k and v must have the same heads and tokens; got {(hk, nk)} and {(hv, nv)}"
    if (hk == 0 and hq != 0) or (hk != 0 and hq % hk):
        return REASON_HEADS, (f"q's heads ({hq}) must be a multiple of k/v's heads ({hk}), and k/v need a head "
                              "when q has one")
    return None


def call_gap(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout: float = 0.0) -> str | None:
    """Why no quantized path can serve attention on these (B, H, N, D) tensors, or None when one can."""
    if dropout and dropout > 0.0:
        return REASON_DROPOUT
    if needs_grad(query, key, value):
        return REASON_GRAD
    bad = argument_gap(query, key, value)
    if bad is not None:
        return bad[0]
    if query.shape[-1] > MAX_KERNEL_HEAD_DIM:
        return REASON_HEAD_DIM
    return None


def below_break_even(query: torch.Tensor, num_keys: int, *, causal: bool, variant: bool) -> bool:
    """Whether an attention call of the integrations (transformers, diffusers) of these queries over ``num_keys``
    keys is better served by SDPA: on a GPU where the quantized kernels, quantization included, were measured
    slower than full precision below a count of queries and keys (``break_even`` in kernels.json, by arch, head
    dim and causality), SDPA is both faster and exact there. ``min(queries, keys)`` is the count: the K/V pass
    quantizes every key once per call, which only many queries pay back (a one-token step over a full-precision
    cache, a cross-attention over a few text tokens never do). fp16/bf16
    only (the floors compare with the half-precision kernels), never for a window, chunk, sinks or soft-cap
    (``variant``: transformers' path for those computes every masked score) and never with
    ``HF_QATTN_BREAK_EVEN=0``. :func:`hf_qattn.qattn` itself always runs the kernel it is asked for."""
    if variant or query.dtype not in HALF_DTYPES or not settings.break_even():  # CPUs: no floor in the table
        return False
    floor = tuning.break_even(tuning.arch_of(query.device), query.shape[-1], causal)
    return min(query.shape[-2], num_keys) < floor


# -- the kernel paths --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        from hf_qattn.kernels import launch  # noqa: F401
    except ImportError:
        return False
    return True


def capability(device: torch.device) -> tuple[int, int]:
    from hf_qattn.kernels.tuning import capability as device_capability

    return device_capability(device.index if device.index is not None else torch.cuda.current_device())


def has_fp8_mma(device: torch.device) -> bool:
    """Whether P·V can run in FP8 there: sm89 and newer (Ampere runs it in FP16)."""
    return device.type != "cuda" or capability(device) >= (8, 9)


def exact_int4() -> bool:
    """Whether qk="int4" runs in the INT4 range on GPUs without INT4 tensor cores (Hopper).

    Hopper has no INT4 MMA: INT4-range values run on the INT8 tensor cores at INT8 speed, so there
    they buy only error. By default an int4 call on sm90 runs INT8 (the Hopper kernel); set
    ``HF_QATTN_EXACT_INT4=1`` to reproduce INT4 numerics there (the portable Triton kernel).
    """
    return settings.exact_int4()


def effective_qk(q: torch.Tensor, qk: str) -> str:
    """The Q·Kᵀ precision a call on ``q`` runs: int4 becomes int8 on sm90 unless :func:`exact_int4`."""
    if qk == "int4" and q.device.type == "cuda" and not exact_int4() and capability(q.device) == (9, 0):
        return "int8"
    return qk


def _hopper_unbuildable(q: torch.Tensor) -> str | None:
    """Why the Hopper kernel cannot be built for this sm90 GPU (None: it can, or q is not on one)."""
    if q.device.type != "cuda" or capability(q.device) != (9, 0) or not triton_available():
        return None
    from hf_qattn.kernels.hopper.gluon_api import missing

    gap = missing()
    return None if gap is None else f"{REASON_NO_GLUON}: {gap}"


def _hopper_gap(q: torch.Tensor, qk: str, pv: str) -> str | None:
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return "not an sm90 GPU"
    if not triton_available():
        return "Triton is not installed"
    if (gap := _hopper_unbuildable(q)) is not None:
        return gap
    if qk != "int8" or pv != "fp8":
        return "the Hopper kernel runs INT8 Q·Kᵀ with FP8 P·V only"
    return None


REASON_CPU_WITHOUT_INTERPRETER = ("CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before importing "
                                  "hf_qattn), or backend='reference'")


def _triton_gap(q: torch.Tensor, qk: str, pv: str) -> str | None:
    if not triton_available():
        return "Triton is not installed"
    if q.device.type != "cuda":  # CPU tensors run only under the Triton interpreter
        return None if tuning.interpreting() else REASON_CPU_WITHOUT_INTERPRETER
    if capability(q.device) < (8, 0):
        return "GPU compute capability below 8.0"
    if q.shape[-1] > MAX_KERNEL_HEAD_DIM:
        return REASON_HEAD_DIM
    return None


# -- the attention variants (issue 27) ----------------------------------------------------------------
# qattn's window=, chunk=, sinks=, softcap=, by the names a call lists them under (:func:`variants_of`).
VARIANTS = ("window", "chunk", "sinks", "softcap")
# The variants the sm90 Gluon kernel serves (all of them: constexpr switches of kernels/hopper/). The place
# where a new variant starts on the portable kernel only: one left out here runs there instead, counted under
# REASON_HOPPER_VARIANT and warned once (not the SDPA fallback: the call stays quantized).
HOPPER_SERVES_VARIANTS: frozenset[str] = frozenset(VARIANTS)
REASON_HOPPER_VARIANT = "the sm90 Gluon kernel does not serve this attention variant"


def check_count(name: str, value, *, none_ok: bool = False, what: str = "") -> None:
    """A ValueError naming ``name`` unless ``value`` is an int ≥ 1 (or None where ``none_ok``); bools are not
    counts. ``what``: what the count counts, for the message."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{f' ({what})' if what else ''}{' or None' if none_ok else ''}; "
                         f"got {value!r}")


def check_variants(*, window, chunk, sinks, softcap, is_causal: bool, heads: int, device) -> dict:
    """The variants' arguments as the kernels take them ({window, chunk, sinks, softcap}), or a ValueError that
    names the argument and what is accepted: window / chunk an int ≥ 1 on a causal call, sinks a float tensor
    (heads,) on ``device``, softcap a finite real > 0; None for each is "not used"."""
    spans = {}
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None:
            check_count(name, value, none_ok=True, what="keys a query sees")
            if not is_causal:
                raise ValueError(f"{name}={value} needs is_causal=True (a query's keys end at its own position)")
            value = int(value)
        spans[name] = value
    if softcap is not None:
        if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap)
                or softcap <= 0):
            raise ValueError(f"softcap must be a finite real number > 0 or None; got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (heads,):
            got = (f"{sinks.dtype} tensor of shape {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor)
                   else type(sinks).__name__)
            raise ValueError(f"sinks must be a float tensor of shape (query heads,) = ({heads},); got {got}")
        if sinks.device != torch.device(device):
            raise ValueError(f"sinks must be on the same device as q ({device}); got {sinks.device}")
    return dict(window=spans["window"], chunk=spans["chunk"], sinks=sinks, softcap=softcap)


def variants_of(window=None, chunk=None, sinks=None, softcap=None) -> tuple[str, ...]:
    """The names of the variants a call uses (a constant of a traced call: plain strings)."""
    used = dict(window=window is not None, chunk=chunk is not None, sinks=sinks is not None,
                softcap=softcap is not None)
    return tuple(name for name in VARIANTS if used[name])


@dataclass(frozen=True)
class KernelPath:
    """A quantized path: where ``backend="auto"`` tries it, and why it cannot serve a call (None: it can)."""

    auto_on: tuple[str, ...]
    gap: Callable[[torch.Tensor, str, str], str | None]  # (q, qk, pv) -> reason or None
    # why the path, made for q's GPU, cannot be built with what is installed: a later path serving the
    # call instead is then a degradation, counted and warned (None: the path is buildable, or not for q)
    unbuildable: Callable[[torch.Tensor], str | None] = lambda q: None
    # the variants it serves; a later path serving a call that uses another is a degradation too
    serves: frozenset[str] = frozenset(VARIANTS)
    variant_reason: str = ""

    def variant_gap(self, variants: tuple[str, ...]) -> str | None:
        missing = [name for name in variants if name not in self.serves]
        return f"{self.variant_reason}: {', '.join(missing)}" if missing else None


# In order of preference for backend="auto". A new path is one entry here.
KERNEL_PATHS: dict[str, KernelPath] = {
    HOPPER: KernelPath(auto_on=("cuda",), gap=_hopper_gap, unbuildable=_hopper_unbuildable,
                       serves=HOPPER_SERVES_VARIANTS, variant_reason=REASON_HOPPER_VARIANT),
    TRITON: KernelPath(auto_on=("cuda",), gap=_triton_gap),
    REFERENCE: KernelPath(auto_on=("cpu",), gap=lambda q, qk, pv: None),
}
BACKENDS = ("auto", *KERNEL_PATHS)


def select_path(q: torch.Tensor, backend: str = "auto", qk: str = "int8", pv: str = "fp8",
                gap: str | None = None, variants: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """(path, None) for the quantized path that serves a call on ``q``, or (``"sdpa"``, reason).

    ``backend="auto"`` takes the first path of :data:`KERNEL_PATHS` made for q's device type that can
    serve the call, else falls back to SDPA with the reason the last one gave (a path passed over for
    a later one is no fallback: the Hopper kernel hands FP16 P·V calls to the Triton kernel silently). A
    forced backend that cannot serve the call raises ``RuntimeError``. ``gap`` is a reason no
    quantized path serves the call on any device (:func:`call_gap`, e.g. :data:`REASON_GRAD`): SDPA
    with that reason under ``"auto"``, ``RuntimeError`` for a forced backend — the same on every path.
    An sm90 GPU whose triton cannot build the Hopper kernel gets the portable Triton kernel, with the
    reason counted under ``fallbacks`` and warned once (:data:`REASON_NO_GLUON`). ``variants``
    (:func:`variants_of`) are the attention variants the call uses: a path that serves the call but not
    one of them is passed over the same way, counted and warned (:data:`REASON_HOPPER_VARIANT`).
    """
    if gap is not None:
        if backend != "auto":
            raise RuntimeError(f"backend={backend!r} cannot serve this call: {gap}")
        return SDPA, gap
    if backend != "auto":
        path = KERNEL_PATHS[backend]
        gap = path.gap(q, qk, pv) or path.variant_gap(variants)
        if gap is not None:
            raise RuntimeError(f"backend={backend!r} cannot serve this call: {gap}")
        return backend, None
    reason = f"no quantized path for {q.device.type} tensors"
    degraded = None
    for name, path in KERNEL_PATHS.items():
        if q.device.type in path.auto_on:
            reason = path.gap(q, qk, pv)
            if reason is None:
                reason = path.variant_gap(variants)
                degraded = degraded or reason  # the path fits the call but for a variant: a degradation
            if reason is None:
                if degraded is not None:  # counted and warned here; the caller counts the call as usual
                    stats.record_degraded(degraded, name)
                return name, None
            degraded = degraded or path.unbuildable(q)
    return SDPA, reason
