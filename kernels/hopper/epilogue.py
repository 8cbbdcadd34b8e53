"""The epilogue: O = acc / l · δV + v̄ in the output dtype, and optionally the log-sum-exp.

The 448 of P's FP8 scale is in both acc and l, so it cancels. A row that saw no key has l = 0
and gets zeros (lse −inf); a row that met NaN/Inf keeps it (l is NaN, which is not 0).

SINKS: the head's sink logit joins the denominator, l′ = l + 2^(sink − m + log2 448) in the kernel's units
(its true logit less the row's smoothing shift sm_scale·q·k̄, times log2 e; no shift under SOFTCAP, whose
scores are true scores). The weights then sum to l/l′: the output is the one without a sink times l/l′
(V's center included), and lse is that of l′ (a row that saw no key: zeros, lse = the sink). l′ is taken at
max(m, sink) so a large sink cannot overflow.
"""

from .. import formats
from .gluon_api import gl, gluon

_LOG2E = gl.constexpr(formats.LOG2E)
_FP8_MAX = gl.constexpr(formats.FP8_E4M3_MAX)
_SCALE_FLOOR = gl.constexpr(formats.SCALE_FLOOR)


@gluon.jit
def store_output(prob, cfg, acc, l_i, m_i, shift_smem, b, h, bhq, bhk, row0, BM: gl.constexpr,
                 o_layout: gl.constexpr):
    row: gl.constexpr = gl.SliceLayout(1, o_layout)
    col: gl.constexpr = gl.SliceLayout(0, o_layout)
    l = gl.convert_layout(l_i, row)
    seen = l != 0.0
    rows = row0 + gl.arange(0, BM, layout=row)
    cols = gl.arange(0, cfg.D_PAD, layout=col)
    inside = (rows < prob.NQ)[:, None] & (cols < cfg.HEAD_DIM)[None, :]
    # K was smoothed, so the true scores are the kernel's plus sm_scale·q·k̄, which the prologue left in
    # shift_smem (not under SOFTCAP, which added it back before the cap)
    shift = gl.zeros([BM], gl.float32, layout=row)
    if (cfg.RETURN_LSE or cfg.SINKS) and not cfg.SOFTCAP:
        shift = shift_smem.load(row)
    m = gl.convert_layout(m_i, row)
    inv_l = gl.where(seen, 1.0 / l, 0.0)
    if cfg.SINKS:
        no_key = m == float("-inf")
        m_use = gl.where(no_key, 0.0, m)  # acc and l are at this maximum (mainloop._scaling_max)
        sink = (gl.load(prob.SINK + h).to(gl.float32) - shift) * _LOG2E  # in the model's dtype (gpt-oss: bf16)
        # a row that saw no key takes the sink's own maximum: at 0 a sink below −109 (in base 2) would
        # underflow and its lse come out −inf; a sink of −inf (none) keeps 0
        m = gl.where(no_key & (sink > float("-inf")), sink, gl.maximum(m_use, sink))
        rescale = gl.where(no_key, 0.0, gl.exp2(m_use - m))
        l_sink = l * rescale + gl.exp2(sink - m + cfg.P_LOG2)
        keys_share = gl.where(seen, l * rescale / l_sink, 0.0)  # l / l′: the weights' sum (0: no key seen)
        l = l_sink
        seen = l_sink != 0.0  # the lse is the sink's for a row that saw no key
    v_bar = gl.load(prob.V_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
    # V_SCALE holds V's range per channel (max V, max −V): max |V − v̄| as the K/V pass computed it
    v_absmax = gl.maximum(gl.load(prob.V_SCALE + bhk * 2 * cfg.D_PAD + cols) - v_bar,
                          v_bar + gl.load(prob.V_SCALE + (bhk * 2 + 1) * cfg.D_PAD + cols))
    v_scale = gl.maximum(v_absmax, _SCALE_FLOOR) / _FP8_MAX
    if cfg.SINKS:  # the keys' output, as without a sink, times their share l/l′ (one product an element)
        out = (acc * inv_l[:, None] * v_scale[None, :] + v_bar[None, :]) * keys_share[:, None]
    else:
        out = gl.where(seen[:, None], acc * inv_l[:, None] * v_scale[None, :] + v_bar[None, :], 0.0)
    base = prob.O + b.to(gl.int64) * prob.stride_ob + h.to(gl.int64) * prob.stride_oh
    gl.store(base + rows.to(gl.int64)[:, None] * prob.stride_on + cols[None, :] * prob.stride_od,
             out.to(prob.O.dtype.element_ty), mask=inside)
    if cfg.RETURN_LSE:
        lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0)) - cfg.P_LOG2) / _LOG2E + shift, float("-inf"))
        gl.store(prob.LSE + bhq.to(gl.int64) * prob.NQ + rows, lse, mask=rows < prob.NQ)
