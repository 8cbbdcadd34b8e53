"""The epilogue: O = acc / l · δV + v̄ in the output dtype, and optionally the log-sum-exp.

The 448 of P's FP8 scale is in both acc and l, so it cancels. A row that saw no key has l = 0
and gets zeros (lse −inf); a row that met NaN/Inf keeps it (l is NaN, which is not 0).
"""

from .. import formats
from .gluon_api import gl, gluon

_LOG2E = gl.constexpr(formats.LOG2E)
_FP8_MAX = gl.constexpr(formats.FP8_E4M3_MAX)
_SCALE_FLOOR = gl.constexpr(formats.SCALE_FLOOR)


@gluon.jit
def store_output(prob, cfg, acc, l_i, m_i, b, h, bhq, bhk, row0, BM: gl.constexpr, o_layout: gl.constexpr):
    row: gl.constexpr = gl.SliceLayout(1, o_layout)
    col: gl.constexpr = gl.SliceLayout(0, o_layout)
    l = gl.convert_layout(l_i, row)
    seen = l != 0.0
    inv_l = gl.where(seen, 1.0 / l, 0.0)
    rows = row0 + gl.arange(0, BM, layout=row)
    cols = gl.arange(0, cfg.D_PAD, layout=col)
    inside = (rows < prob.NQ)[:, None] & (cols < cfg.HEAD_DIM)[None, :]
    v_bar = gl.load(prob.V_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
    # V_SCALE holds V's range per channel (max V, max −V): max |V − v̄| as the K/V pass computed it
    v_absmax = gl.maximum(gl.load(prob.V_SCALE + bhk * 2 * cfg.D_PAD + cols) - v_bar,
                          v_bar + gl.load(prob.V_SCALE + (bhk * 2 + 1) * cfg.D_PAD + cols))
    v_scale = gl.maximum(v_absmax, _SCALE_FLOOR) / _FP8_MAX
    out = gl.where(seen[:, None], acc * inv_l[:, None] * v_scale[None, :] + v_bar[None, :], 0.0)
    base = prob.O + b.to(gl.int64) * prob.stride_ob + h.to(gl.int64) * prob.stride_oh
    gl.store(base + rows.to(gl.int64)[:, None] * prob.stride_on + cols[None, :] * prob.stride_od,
             out.to(prob.O.dtype.element_ty), mask=inside)
    if cfg.RETURN_LSE:
        # K was smoothed, so the lse of the true scores adds sm_scale·q·k̄ back; q is read again here
        # rather than kept from the prologue (two registers a row all loop long spilled)
        q = gl.load(prob.Q + b.to(gl.int64) * prob.stride_qb + h.to(gl.int64) * prob.stride_qh
                    + rows.to(gl.int64)[:, None] * prob.stride_qn + cols[None, :] * prob.stride_qd, mask=inside,
                    other=0.0)
        k_bar = gl.load(prob.K_BAR + bhk * cfg.HEAD_DIM + cols, mask=cols < cfg.HEAD_DIM, other=0.0)
        shift = gl.sum(q.to(gl.float32) * k_bar[None, :], axis=1) * prob.sm_scale
        m = gl.convert_layout(m_i, row)
        lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0)) - cfg.P_LOG2) / _LOG2E + shift, float("-inf"))
        gl.store(prob.LSE + bhq.to(gl.int64) * prob.NQ + rows, lse, mask=rows < prob.NQ)
