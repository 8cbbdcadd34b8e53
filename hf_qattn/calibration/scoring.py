"""Score a precision on the very Q, K, V a layer sees: the measurement behind every mixing plan.

The score is CosSim · (1 − RelL1) of ``qattn`` at that precision against full-precision
attention (float32 SDPA on the same inputs, same mask). Calibration keeps only these numbers,
never the tensors: :class:`ScoreSums` accumulates them at one place (a layer, or a (step, layer)
pair), for both calibrations (transformers and diffusers), which share the constants below.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..api import qattn
from .metrics import Accuracy, accuracy
from ..reference import sdpa_attention

CALIBRATION_QK = "int4"  # calibration scores the 4-bit kernel; the lowest scores get int8
METRIC = "cos_sim*(1-rel_l1)"
# What a score is, for people reading a table or a plot of them
SCORE_MEANING = ("INT4 score = CosSim·(1 − RelL1) of 4-bit attention against full precision on the layer's own "
                 "inputs: 1 is exact, higher is better; the lowest-scoring layers are the ones marked int8")
METHOD = "sageattn-mix"


def describe(**extra) -> dict:
    """What a calibration result or plan records about how its scores were made."""
    return {"method": METHOD, "metric": METRIC, "qk_scored": CALIBRATION_QK, **extra}


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
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> Accuracy:
    """Accuracy of ``qattn(..., qk=qk)`` against float32 attention on the same inputs, with the same attention
    variant (sliding window, chunk, sinks, soft-cap: :func:`hf_qattn.qattn`'s keywords) on both sides."""
    variants = dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    out = qattn(q, k, v, qk=qk, is_causal=is_causal, sm_scale=sm_scale, layout=layout,
                kv_start=kv_start, kv_end=kv_end, **variants)
    hnd = [t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v)]
    ref = sdpa_attention(*(t.float() for t in hnd), is_causal=is_causal, sm_scale=sm_scale,
                         kv_start=kv_start, kv_end=kv_end, **variants)
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


class ScoreSums:
    """Running sums at one place: ``add`` one score (of one input, or the mean of one prompt's calls
    with its worst call as ``worst``); :meth:`score` gives the :class:`Score` over everything added."""

    __slots__ = ("count", "total", "worst", "cos_sim", "rel_l1")

    def __init__(self):
        self.count, self.total, self.worst, self.cos_sim, self.rel_l1 = 0, 0.0, math.inf, 0.0, 0.0

    def add(self, score: float, cos_sim: float, rel_l1: float, worst: float | None = None) -> None:
        self.count += 1
        self.total += score
        self.worst = min(self.worst, score if worst is None else worst)
        self.cos_sim += cos_sim
        self.rel_l1 += rel_l1

    def score(self) -> Score:
        n = self.count
        return Score(mean=self.total / n, worst=self.worst, count=n, cos_sim=self.cos_sim / n, rel_l1=self.rel_l1 / n)


class CalibrationOutcome:
    """What both calibrations return shares this: it unpacks as ``plan, scores``, and its JSON form
    starts with how the scores were made and ends with the calls that were not scored."""

    def __iter__(self):
        yield self.plan
        yield self.scores

    def _json(self, **body) -> dict:
        return {"metric": METRIC, "qk": CALIBRATION_QK, **body, "skipped": dict(self.skipped)}
