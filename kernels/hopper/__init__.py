"""The Hopper (sm90) attention kernel family, written in Gluon and warp-specialized like FA3.

One kernel, its roles one module each:

    gluon_api.py   every Gluon name used here, imported once (Gluon's API moves between releases)
    params.py      the kernel's arguments in three aggregates: Config (constexpr), Problem (tensors, strides,
                   sizes), Ring (the shared-memory stages and their barriers), passed to every role whole
    scheduler.py   which query rows a CTA owns and which key tiles it visits (shared by the roles)
    loader.py      the producer warp: K̂ / V̂ᵀ tiles through a multi-stage TMA ring of mbarriers
    mainloop.py    the consumer warpgroups: Q quantized in registers, INT8 Q·Kᵀ wgmma, online
                   softmax, FP8 P·V wgmma, issued in FA3's order so softmax overlaps the MMAs
    epilogue.py    normalize, undo the smoothing and V scale, store O (and the log-sum-exp)
    attention.py   the kernel: shared memory, barriers, and the warp_specialize of the roles

Variants are constexpr switches of that one kernel (causal, per-token K scales, head dim, stages, and
the attention variants: sliding window, chunks, sinks, soft-capping), not files. Import ``attention`` only after :func:`gluon_api.missing` returned None.
"""
