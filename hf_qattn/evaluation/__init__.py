"""Measuring quantized attention against full precision: the engines behind ``hf-qattn eval-*`` and eval/.

- :mod:`.layer_accuracy`: per-layer attention accuracy on the Q, K, V a transformers model's layers receive;
- :mod:`.pipeline`: a diffusers pipeline run once per attention mode, each output compared with SDPA's;
- :mod:`.quality`: the weight-free image / video metrics of that comparison (PSNR, SSIM, frame cosine, flickering);
- :mod:`.lm_eval`: ``python -m hf_qattn.evaluation.lm_eval``, lm-eval's command line with
  ``attn_implementation="qattn"`` known.

Of hf_qattn, only the command line imports this package (tests/test_layout.py checks the direction).
"""
