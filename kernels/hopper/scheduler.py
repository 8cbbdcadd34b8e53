"""Tile scheduler: which (query block, batch·query-head) work items a CTA owns, and which key tiles
every role of it visits.

Work items are numbered head by head, query blocks of BLOCK_M rows fastest (neighbouring items share
K/V in L2); causal heads run their longest block first, so short blocks fill the tail of the launch.
A CTA takes items ``first, first + step, ...``: with PERSISTENT one CTA per SM walks many items, so
the loader already streams the next item's first key tiles while the consumers write the last
item's output, and no CTA is launched, set up or torn down per item; without it each CTA has one item.

The loader and the consumers call the same functions, so they agree on the item and tile sequence
without talking: tiles [first, end) of BLOCK_N keys, end covering every key left of kv_end and, when
causal, left of the last row's diagonal (aligned bottom-right); first is 0, or with a sliding window or
chunks the tile of the first key the item's first row sees (``first_key``): tiles left of it are skipped.
"""

from .gluon_api import gl, gluon


@gluon.jit
def item_range(NUM_ITEMS, PERSISTENT: gl.constexpr):
    """(first item, step) of this CTA."""
    if PERSISTENT:
        return gl.program_id(0), gl.num_programs(0)
    else:
        return gl.program_id(0), NUM_ITEMS


@gluon.jit
def work_item(t, prob, cfg):
    """(query block index, b·Hq + h) of item ``t``."""
    num_m = gl.cdiv(prob.NQ, cfg.BLOCK_M)
    m_block = t % num_m
    if cfg.CAUSAL:
        m_block = num_m - 1 - m_block  # longest first
    return m_block, t // num_m


@gluon.jit
def first_key(prob, cfg, pos):
    """The first key a query at key position ``pos`` (row + NK − NQ) may see under WINDOW and CHUNK: keys j
    with pos − window < j, and with j // chunk == pos // chunk (the causal rule gives j ≤ pos). Not below 0
    for pos ≥ 0; a row at a negative position sees no key anyway (causal)."""
    lo = 0
    if cfg.WINDOW:
        lo = pos - prob.window + 1
    if cfg.CHUNK:
        chunk_start = (gl.maximum(pos, 0) // prob.chunk) * prob.chunk
        if cfg.WINDOW:
            lo = gl.maximum(lo, chunk_start)
        else:
            lo = chunk_start
    return lo


@gluon.jit
def key_tiles(prob, cfg, b, m_block):
    """The key tiles [first, end) the CTA of query block ``m_block`` in batch ``b`` visits.

    Keys left of kv_start are not skipped: their ΔS is −inf (the K/V pass wrote it), so they
    weigh nothing. Starting every CTA at tile 0 keeps the tile index a loop counter, which the
    register allocator needs (a loaded start spilled 700 bytes a thread); left padding rarely
    spans more than a tile or two. A window or chunk start is no load but arithmetic on the
    item's first row, and skipping the tiles left of it is where those variants gain their speed.
    """
    hi = prob.NK
    if cfg.HAS_KV_RANGE:
        hi = gl.load(prob.KV_END + b)
    if cfg.CAUSAL:
        last_row = gl.minimum(m_block * cfg.BLOCK_M + cfg.BLOCK_M, prob.NQ) - 1
        hi = gl.minimum(hi, last_row + (prob.NK - prob.NQ) + 1)
    end = gl.cdiv(gl.maximum(hi, 0), cfg.BLOCK_N)
    first = 0
    if cfg.WINDOW or cfg.CHUNK:
        first = gl.minimum(gl.maximum(first_key(prob, cfg, m_block * cfg.BLOCK_M + (prob.NK - prob.NQ)), 0)
                           // cfg.BLOCK_N, end)  # first ≤ end: an item that sees no key visits no tile
    return first, end
