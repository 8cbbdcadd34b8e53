"""The producer: one warp that streams K̂, V̂ᵀ and ΔS tiles into a ring of shared-memory stages.

Stage s is filled when ``kv_empty[s]`` says both consumer warpgroups released it, and announced
on ``kv_ready[s]`` with the byte count the TMA engine will deliver. The consumers wait on ready,
read, and arrive on empty; the phase bit flips each time the ring wraps.
"""

from .gluon_api import gl, gluon, mbarrier, tma_load


@gluon.jit
def load_kv(k_desc, vt_desc, ds_desc, k_smem, v_smem, ds_smem, kv_ready, kv_empty, k_row0, vt_row0, ds_row0, end,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for i in range(end):
        s = i % STAGES
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)  # first pass: passes at once
        ready = kv_ready.index(s)
        mbarrier.expect(ready, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + ds_desc.block_type.nbytes)
        start = i * BLOCK_N
        tma_load(k_desc, [k_row0 + start, 0], ready, k_smem.index(s))
        tma_load(vt_desc, [vt_row0, start], ready, v_smem.index(s))
        tma_load(ds_desc, [ds_row0 + start], ready, ds_smem.index(s))
