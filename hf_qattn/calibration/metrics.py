"""Accuracy metrics of an attention output against a reference (both flattened, computed in float64).

CosSim = <o, r> / (|o| |r|),  Relative L1 = Σ|o − r| / Σ|r|,  RMSE = sqrt(mean((o − r)²)),
and the plan score of the mixing calibration, CosSim · (1 − RelL1) — higher is better, 1 is exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Accuracy:
    cos_sim: float
    rel_l1: float
    rmse: float

    @property
    def score(self) -> float:
        return self.cos_sim * (1.0 - self.rel_l1)

    def as_dict(self) -> dict:
        return {**asdict(self), "score": self.score}


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> Accuracy:
    """Compare ``out`` with ``ref`` (same shape). A NaN or inf in ``out`` makes every metric NaN."""
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    o = out.detach().reshape(-1).double()
    r = ref.detach().reshape(-1).to(o.device).double()
    if o.numel() == 0:
        return Accuracy(1.0, 0.0, 0.0)
    if not torch.isfinite(o).all():  # a NaN or inf output never passes for close
        return Accuracy(float("nan"), float("nan"), float("nan"))
    diff = o - r
    norm = o.norm() * r.norm()
    cos = (o @ r / norm).item() if norm > 0 else float(torch.equal(o, r))
    ref_l1 = r.abs().sum()
    rel_l1 = (diff.abs().sum() / ref_l1).item() if ref_l1 > 0 else diff.abs().sum().item()
    rmse = diff.pow(2).mean().sqrt().item()
    return Accuracy(cos, rel_l1, rmse)
