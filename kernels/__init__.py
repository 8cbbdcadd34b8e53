"""GPU kernels of hf_qattn (Triton), installed as ``hf_qattn.kernels``.

``quantize.py`` smooths and quantizes K and V in one pass; ``attention.py`` is the attention
kernel (Q is quantized inside it); ``tuning.py`` picks tile sizes from ``configs/kernels.json``;
``launch.py`` runs the two kernels for one attention call. Import needs Triton; running needs a
CUDA GPU or ``TRITON_INTERPRET=1`` (the tests run the real kernels on the CPU that way).
"""
