"""The quantized KV cache for generation.

- :mod:`.cache`: :class:`QAttnCache` and its :class:`QAttnLayer` (INT8 / INT4 K, INT8 V, quantized once
  when appended); needs transformers;
- :mod:`.attention`: the attention over a layer's quantized storage, which the qattn attention function
  calls on the :class:`PackedKV` handles the cache returns (importable without transformers);
- :mod:`.reference`: the cache's quantization and attention math in plain PyTorch (the kernels'
  reference and the CPU path);
- :mod:`.captured`: :class:`CapturedDecodeStep`, a decode step over a static cache replayed from a CUDA graph;
- :mod:`.generate`: :func:`captured_generate`, transformers' ``custom_generate`` hook that runs ``generate``'s
  decode steps through it.

Nothing is imported here: ``hf_qattn.QAttnCache`` and ``hf_qattn.CapturedDecodeStep`` load on first use.
"""
