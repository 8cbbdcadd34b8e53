"""The producer: one warp that streams K̂, V̂ᵀ, ΔS and split-channel (kc) tiles into a ring of shared-memory stages.

Stage s is filled when ``kv_empty[s]`` says both consumer warpgroups released it, and announced
on ``kv_ready[s]`` with the byte count the TMA engine will deliver. The consumers wait on ready,
read, and arrive on empty; the phase bit flips each time the ring wraps. The ring runs on across
the CTA's work items (``g`` counts tiles over all of them), so the next item's first tiles load
while the consumers finish the last one.
"""

from .gluon_api import gl, gluon, mbarrier, tma_load
from .scheduler import item_range, key_tiles, work_item


@gluon.jit
def load_kv(k_desc, vt_desc, ds_desc, k_smem, v_smem, ds_smem, kc_smem, kv_ready, kv_empty, KV_END,
            HQ, GROUPS, NQ, NK, NK_PAD, NUM_ITEMS, KC_ROW0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            D_PAD: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_RANGE: gl.constexpr,
            PERSISTENT: gl.constexpr, SPLIT: gl.constexpr):
    first, step = item_range(NUM_ITEMS, PERSISTENT)
    g = 0
    for t in range(first, NUM_ITEMS, step):
        m_block, bhq = work_item(t, NQ, BLOCK_M, CAUSAL)
        b = bhq // HQ
        bhk = b * (HQ // GROUPS) + (bhq % HQ) // GROUPS
        end = key_tiles(KV_END, b, m_block, NQ, NK, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_RANGE)
        k_row0 = (bhk * NK_PAD).to(gl.int32)
        vt_row0 = (bhk * D_PAD).to(gl.int32)
        ds_row0 = (bhq * NK_PAD).to(gl.int32)
        kc_row0 = ((KC_ROW0 + bhk) * NK_PAD).to(gl.int32)  # kc rows follow the ΔS rows in one buffer
        for i in range(end):
            s = g % STAGES
            mbarrier.wait(kv_empty.index(s), ((g // STAGES) & 1) ^ 1)  # first pass: passes at once
            ready = kv_ready.index(s)
            mbarrier.expect(ready, k_desc.block_type.nbytes + vt_desc.block_type.nbytes
                            + (2 if SPLIT else 1) * ds_desc.block_type.nbytes)
            start = i * BLOCK_N
            tma_load(k_desc, [k_row0 + start, 0], ready, k_smem.index(s))
            tma_load(vt_desc, [vt_row0, start], ready, v_smem.index(s))
            tma_load(ds_desc, [ds_row0 + start], ready, ds_smem.index(s))
            if SPLIT:
                tma_load(ds_desc, [kc_row0 + start], ready, kc_smem.index(s))
            g += 1
