"""Score a precision on the very Q, K, V a layer sees: the measurement behind every mixing plan.

The score is CosSim · (1 − RelL1) of ``qattn`` at that precision against full-precision
attention (float32 SDPA on the same inputs, same mask). Calibration keeps only these numbers,
never the tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .api import qattn
from .metrics import Accuracy, accuracy
from .reference import sdpa_attention


def attention_accuracy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qk: str = "int4",
    is_causal: bool = False,
    sm_scale: float | None = None,
    layout: str = "HND",
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
) -> Accuracy:
    """Accuracy of ``qattn(..., qk=qk)`` against float32 attention on the same inputs."""
    out = qattn(q, k, v, qk=qk, is_causal=is_causal, sm_scale=sm_scale, layout=layout,
                kv_start=kv_start, kv_end=kv_end)
    hnd = [t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v)]
    ref = sdpa_attention(*(t.float() for t in hnd), is_causal=is_causal, sm_scale=sm_scale,
                         kv_start=kv_start, kv_end=kv_end)
    if layout == "NHD":
        ref = ref.transpose(1, 2)
    return accuracy(out, ref)


@dataclass
class Score:
    """A precision's score at one place (a layer, or a (step, layer) pair) over calibration inputs:
    the mean and the worst of CosSim·(1 − RelL1), how many inputs counted, and the mean CosSim and RelL1."""

    mean: float
    worst: float
    count: int
    cos_sim: float
    rel_l1: float

    def as_dict(self) -> dict:
        return asdict(self)
