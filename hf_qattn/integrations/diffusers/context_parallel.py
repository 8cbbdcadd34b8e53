"""qattn inside diffusers' context parallelism: ring and Ulysses attention over several processes.

    transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=2))   # or ulysses_degree=2
    hf_qattn.patch(pipe)                                # every rank: the same plan, every shard on qattn
    video = pipe(prompt, ...).frames

How diffusers 0.42 runs it. ``enable_parallelism`` splits the sequence between ranks and gives every
dispatch-based processor a ``_parallel_config``, which the processor passes to ``dispatch_attention_fn``.
With it, a backend hands ``_templated_context_parallel_attention`` its *forward op*:
``forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
_save_ctx=..., _parallel_config=...)`` on (B, S, H, D) tensors, returning the output (B, S, H, D) and,
with ``return_lse``, the natural-log log-sum-exp (B, S, H). Ulysses exchanges heads by all-to-all and
calls the op once per layer on the whole sequence with H / n heads (no LSE). The ring all-gathers K and V
and calls the op once per key shard with ``return_lse=True``, merging the partial outputs by their LSE;
so a shard's LSE must be the one of the attention the shard computed. qattn's is (``return_lse``: the
kernels add back the smoothing term sm_scale·q·k̄ that smoothing K takes out of the scores); both degrees
> 1 ("unified") does both. Causal attention and GQA are refused by the template before any op runs,
and stay refused under the patch.

Hook point. The native backend reads the module global ``attention_dispatch._native_attention_forward_op``
at each context-parallel call; while a patch is active that global is :func:`forward_op` (installed by
the first live patch, the original put back by the last ``unpatch``; the patch already points processors
at the native backend). Inside a patched attention module it serves the call through the patch's plan —
the precision of (step, layer) as without parallelism, counted like every other call — and outside one
(an unpatched model) it calls diffusers' own op, so nothing else changes. Why this hook: the registry of
backends is a closed ``Enum`` (no name for a new backend), replacing the registry's ``native`` entry
would take over all of native attention instead of its context-parallel op, and the patch replaces no
processor. The global is private to diffusers: a diffusers without it runs no context parallelism
through the native backend, and :func:`install` then does nothing.

What falls back (counted, warned once) is what falls back without parallelism: masks other than key
padding, head dims > 256, dropout, autograd (inside diffusers' ``autograd.Function`` grad mode is off, so
inputs that require grad are the sign). A ring shard that falls back, or that the plan leaves
``unquantized``, computes its LSE in float32 (SDPA gives none), one head and query block at a time; a
Ulysses call runs SDPA itself. Calibration (:func:`hf_qattn.calibrate_pipeline`) refuses a model with
context parallelism: calibrate in one process; the plan then applies unchanged to every rank.

Tested (tests/test_context_parallel.py, CPU processes over gloo): ring and Ulysses of degree 2 and the
unified mode (ring 2 × Ulysses 2, four processes) on tiny Flux and Wan transformers. The "anything"
variants call the same op but are not tested here; neither is ``torch.compile`` of a context-parallel
denoiser.

xDiT (xfuser, on yunchang's ring and Ulysses attention) cannot take qattn cleanly. Its kernel is chosen
from a closed ``AttnType`` enum (FA, FA3, TORCH, SAGE_*, ...); yunchang's ``select_flash_attn_impl``
returns a caller's ``attn_processor`` only when the ``attn_type`` matches no member, and
``xFuserLongContextAttention(attn_type=..., attn_processor=...)`` is built inside xDiT's per-model
processors, not by the user; its torch ≥ 2.5 USP path picks flash-attn, AITER or efficient attention
by what is installed. The contract itself would fit qattn (a ring step wants ``(out, lse)`` on NHD
tensors with lse (B, H, S), which is ``qattn(q, k, v, layout="NHD", return_lse=True)``), so a user can
wire it by hand into those processors; hf_qattn adds no xDiT integration to keep in step with them.
"""

from __future__ import annotations

import math
import threading

import torch

from ... import support

OP_NAME = "_native_attention_forward_op"
CALIBRATION_REFUSED = ("has context parallelism enabled (a ContextParallelConfig); calibrate it without "
                       "parallelism, in one process: the plan then applies unchanged to every rank under "
                       "ring or Ulysses attention")

_lock = threading.Lock()
_users = 0
_original = None


def _dispatch_module():
    """diffusers' ``attention_dispatch`` when it has the native context-parallel op, else None."""
    try:
        from diffusers.models import attention_dispatch
    except ImportError:
        return None
    return attention_dispatch if hasattr(attention_dispatch, OP_NAME) else None


def install() -> None:
    """Put :func:`forward_op` in place of diffusers' native context-parallel op (counted: one per live
    patched denoiser)."""
    global _users, _original
    module = _dispatch_module()
    if module is None:
        return
    with _lock:
        if _users == 0:
            current = getattr(module, OP_NAME)
            _original = current if current is not forward_op else _original
            setattr(module, OP_NAME, forward_op)
        _users += 1


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts diffusers' op back (unless someone replaced ours since)."""
    global _users
    module = _dispatch_module()
    if module is None:
        return
    with _lock:
        _users = max(_users - 1, 0)
        if _users == 0 and getattr(module, OP_NAME) is forward_op and _original is not None:
            setattr(module, OP_NAME, _original)


def installed() -> bool:
    """Whether diffusers' native context-parallel attention runs :func:`forward_op` now."""
    module = _dispatch_module()
    return module is not None and getattr(module, OP_NAME) is forward_op


def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """diffusers' native forward op (see the module docstring) with the patch's attention: one shard of
    a ring or one Ulysses head group, (B, S, H, D) tensors in and out, lse (B, S, H) with ``return_lse``."""
    from .patching import active_route

    route = active_route()
    if route is None:  # not inside a patched attention module: diffusers' own op
        return _original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                         _save_ctx=_save_ctx, _parallel_config=_parallel_config)
    if _save_ctx:  # what diffusers' backward op reads (with gradients the call runs full precision, below)
        ctx.save_for_backward(query, key, value)
        ctx.attn_mask, ctx.dropout_p, ctx.is_causal = attn_mask, dropout_p, is_causal
        ctx.scale, ctx.enable_gqa = scale, enable_gqa
    named = dict(query=query.transpose(1, 2), key=key.transpose(1, 2), value=value.transpose(1, 2),
                 attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # grad mode is off inside diffusers' autograd.Function: qattn's own check cannot see training, this can
    gap = support.REASON_GRAD if any(t.requires_grad for t in (query, key, value)) else None

    def full_precision():
        if return_lse:
            return attention_with_lse(**named)
        with route.bypass():
            return torch.nn.functional.scaled_dot_product_attention(**named)

    result = route.serve(named, full_precision, return_lse=return_lse, gap=gap)
    out, lse = result if return_lse else (result, None)
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out


def attention_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, block_elements: int = 1 << 26):
    """SDPA's attention in float32 with its natural-log LSE, (B, H, Nq, D) in q's dtype and (B, H, Nq)
    float32; one head and at most ``block_elements`` scores at a time. Rows that see no key give zeros
    (lse −inf), as the kernels do."""
    if dropout_p:
        raise ValueError(f"dropout_p must be 0 for a context-parallel shard computed in full precision; got {dropout_p}")
    b, hq, nq, d = query.shape
    hk, nk = key.shape[1], key.shape[2]
    if hq != hk and not enable_gqa:
        raise ValueError(f"query has {hq} heads, key/value {hk}: enable_gqa=True is needed for that")
    groups = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = None if attn_mask is None else attn_mask.expand(b, hq, nq, nk)
    rows = max(1, block_elements // max(1, b * nk))
    out = query.new_empty(b, hq, nq, value.shape[-1])
    lse = torch.empty(b, hq, nq, device=query.device, dtype=torch.float32)
    for h in range(hq):
        k, v = key[:, h // groups].float(), value[:, h // groups].float()
        for start in range(0, nq, rows):
            stop = min(start + rows, nq)
            s = torch.matmul(query[:, h, start:stop].float(), k.transpose(-1, -2)) * scale
            if is_causal:  # SDPA's rule: top-left aligned
                s = s.masked_fill(torch.ones(stop - start, nk, dtype=torch.bool, device=s.device)
                                  .tril(start).logical_not(), -math.inf)
            if mask is not None:
                part = mask[:, h, start:stop]
                s = s.masked_fill(~part, -math.inf) if part.dtype == torch.bool else s + part.float()
            row_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(row_lse == -math.inf, 0.0, row_lse)[..., None])
            out[:, h, start:stop] = torch.matmul(p, v).to(out.dtype)
            lse[:, h, start:stop] = row_lse
    return out, lse


def refuse_calibration(name: str, model: torch.nn.Module, modules) -> None:
    """ValueError when calibration would run on a denoiser with context parallelism (each rank would
    score its own shard and write its own plan)."""
    parallel = getattr(model, "_parallel_config", None) is not None or any(
        getattr(getattr(module, "processor", None), "_parallel_config", None) is not None for module in modules)
    if parallel:
        raise ValueError(f"calibrate_pipeline: {name} ({type(model).__name__}) {CALIBRATION_REFUSED}")
