"""What calibration measures, shared by the transformers and diffusers calibration drivers
(``hf_qattn.integrations.*.calibration``):

- :mod:`.metrics`: accuracy of an attention output against a reference (CosSim, RelL1, RMSE);
- :mod:`.scoring`: the score of a precision on a layer's own Q, K, V, and its running sums;
- :mod:`.plots`: the calibration plots (per-layer scores or sensitivities, step × layer heatmaps).
"""
