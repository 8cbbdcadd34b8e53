"""Tile scheduler: which query rows a CTA owns, and which key tiles every role of it visits.

The grid is (query blocks of BLOCK_M rows, batch·query-heads). Causal grids run the longest
rows first (the last query block sees the most keys), so the short blocks fill the tail of the
launch instead of one long block running alone at the end.

The loader and the consumers call the same function, so they agree on the tile sequence
without talking: tiles [0, end) of BLOCK_N keys, end covering every key left of kv_end and,
when causal, left of the last row's diagonal (aligned bottom-right).
"""

from .gluon_api import gl, gluon


@gluon.jit
def query_block(NQ, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(query block index, b·Hq + h) of this CTA."""
    pid = gl.program_id(0)
    if CAUSAL:
        pid = gl.cdiv(NQ, BLOCK_M) - 1 - pid  # longest first
    return pid, gl.program_id(1)


@gluon.jit
def key_tiles(KV_END, b, m_block, NQ, NK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              HAS_KV_RANGE: gl.constexpr):
    """How many key tiles, from key 0, the CTA of query block ``m_block`` in batch ``b`` visits.

    Keys left of kv_start are not skipped: their ΔS is −inf (the K/V pass wrote it), so they
    weigh nothing. Starting every CTA at tile 0 keeps the tile index a loop counter, which the
    register allocator needs (a loaded start spilled 700 bytes a thread); left padding rarely
    spans more than a tile or two.
    """
    hi = NK
    if HAS_KV_RANGE:
        hi = gl.load(KV_END + b)
    if CAUSAL:
        last_row = gl.minimum(m_block * BLOCK_M + BLOCK_M, NQ) - 1
        hi = gl.minimum(hi, last_row + (NK - NQ) + 1)
    return gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
