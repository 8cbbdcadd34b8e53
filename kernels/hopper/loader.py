"""The producer: one warp that streams K̂, V̂ᵀ, ΔS and split-channel (kc) tiles into a ring of shared-memory stages.

Stage s is filled when ``kv_empty[s]`` says every consumer warpgroup released it, and announced
on ``kv_ready[s]`` with the byte count the TMA engine will deliver. The consumers wait on ready,
read, and arrive on empty; the phase bit flips each time the ring wraps. The ring runs on across
the CTA's work items (``g`` counts tiles over all of them), so the next item's first tiles load
while the consumers finish the last one.
"""

from .gluon_api import gl, gluon, mbarrier, tma_load
from .scheduler import item_range, key_tiles, work_item


@gluon.jit
def tile_rows(prob, cfg, bhq, bhk):
    """The first rows of this work item's K̂, V̂ᵀ, ΔS and kc in their TMA descriptors."""
    k_row0 = (bhk * prob.NK_PAD).to(gl.int32)
    vt_row0 = (bhk * cfg.D_PAD).to(gl.int32)
    ds_row0 = (bhq * prob.NK_PAD).to(gl.int32)
    kc_row0 = ((prob.KC_ROW0 + bhk) * prob.NK_PAD).to(gl.int32)  # kc rows follow the ΔS rows in one buffer
    return k_row0, vt_row0, ds_row0, kc_row0


@gluon.jit
def load_tile(cfg, ring, k_desc, vt_desc, ds_desc, s, start, rows):
    """Key tile from key ``start`` into stage ``s``: K̂, V̂ᵀ, ΔS (and kc), announced on ``ready[s]``."""
    k_row0, vt_row0, ds_row0, kc_row0 = rows
    ready = ring.ready.index(s)
    mbarrier.expect(ready, k_desc.block_type.nbytes + vt_desc.block_type.nbytes
                    + (2 if cfg.SPLIT else 1) * ds_desc.block_type.nbytes)
    tma_load(k_desc, [k_row0 + start, 0], ready, ring.k.index(s))
    tma_load(vt_desc, [vt_row0, start], ready, ring.v.index(s))
    tma_load(ds_desc, [ds_row0 + start], ready, ring.ds.index(s))
    if cfg.SPLIT:
        tma_load(ds_desc, [kc_row0 + start], ready, ring.kc.index(s))


@gluon.jit
def load_kv(cfg, prob, ring, k_desc, vt_desc, ds_desc):
    first, step = item_range(prob.NUM_ITEMS, cfg.PERSISTENT)
    g = 0
    for t in range(first, prob.NUM_ITEMS, step):
        m_block, bhq = work_item(t, prob, cfg)
        b = bhq // prob.HQ
        bhk = b * (prob.HQ // prob.GROUPS) + (bhq % prob.HQ) // prob.GROUPS
        first, end = key_tiles(prob, cfg, b, m_block)
        rows = tile_rows(prob, cfg, bhq, bhk)
        for i in range(first, end):  # the consumers visit the same tiles (scheduler.py)
            s = g % cfg.STAGES
            mbarrier.wait(ring.empty.index(s), ((g // cfg.STAGES) & 1) ^ 1)  # first pass: passes at once
            load_tile(cfg, ring, k_desc, vt_desc, ds_desc, s, i * cfg.BLOCK_N, rows)
            g += 1
