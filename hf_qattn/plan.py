"""QAttnPlan: which precision each attention layer (and, for diffusion, each denoising step) runs in.

Precisions: ``"int4"`` (INT4-range Q·Kᵀ, FP8 P·V), ``"int8"`` (INT8 Q·Kᵀ, FP8 P·V) and
``"unquantized"`` (leave this one in full precision: the model's own attention). The spelling
``"fp16"`` of older plans is read as ``"unquantized"`` (``"fp16"`` now only names the P·V format of
:func:`hf_qattn.qattn`). Lookup order for (step, layer): an explicit (step, layer) entry, then the
layer's entry, then ``default`` (:data:`DEFAULT_PRECISION`, ``"int8"``, when a plan names none — the
same precision every layer runs when there is no plan at all).

Stored as a JSON-friendly dict under the config key ``qattn_plan`` (``PLAN_CONFIG_KEY``), so
``save_pretrained`` writes it into config.json and ``from_pretrained`` reads it back::

    {"version": 1, "default": "int4",          # unlisted layers (DEFAULT_PRECISION when absent)
     "layers": {"3": "int8"},                    # layer index → precision
     "steps": {"0": {"5": "int8"}},              # step → layer index → precision (diffusion)
     "num_layers": 12, "num_steps": 50,          # the model / run the plan was made for
     "meta": {"ratio": 0.3, ...}}                 # free-form provenance (calibration settings)

A run with a different number of steps than ``num_steps`` maps step s of S to plan step
floor(s · num_steps / S): the plan is read by relative position in the denoising schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping

PLAN_VERSION = 1
PLAN_CONFIG_KEY = "qattn_plan"
UNQUANTIZED = "unquantized"
PRECISIONS = ("int4", "int8", UNQUANTIZED)
DEFAULT_PRECISION = "int8"  # without a plan, or for layers a plan leaves out: as accurate as the method gets
LEGACY_SPELLINGS = {"fp16": UNQUANTIZED}  # accepted when read, never written


class PlanError(ValueError):
    """A malformed plan: says which entry and what is accepted."""


def check_ratio(ratio, what: str = "entries") -> float:
    """The share of ``what`` (layers, or (step, layer) pairs) marked int8: a number in [0, 1], else ValueError."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be a number in [0, 1] (the share of {what} marked int8); got {ratio!r}")
    return float(ratio)


def _precision(value, where: str) -> str:
    value = LEGACY_SPELLINGS.get(value, value) if isinstance(value, str) else value
    if value not in PRECISIONS:
        raise PlanError(f"{where}: precision must be one of {PRECISIONS}; got {value!r}")
    return value


def _index(key, where: str, limit: int | None) -> int:
    try:
        index = int(key)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: index must be an integer; got {key!r}") from None
    if index < 0 or (limit is not None and index >= limit):
        bound = f"[0, {limit})" if limit is not None else ">= 0"
        raise PlanError(f"{where}: index {index} out of range {bound}")
    return index


@dataclass
class QAttnPlan:
    default: str = DEFAULT_PRECISION
    layers: dict[int, str] = field(default_factory=dict)
    steps: dict[int, dict[int, str]] = field(default_factory=dict)
    num_layers: int | None = None
    num_steps: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    # -- lookup ------------------------------------------------------------------------------
    def precision(self, layer: int | None, step: int | None = None, total_steps: int | None = None) -> str:
        """Precision of ``layer`` at denoising ``step`` (of ``total_steps`` in the current run)."""
        if step is not None and self.steps:
            plan_step = step
            if total_steps and self.num_steps and total_steps != self.num_steps:
                plan_step = math.floor(step * self.num_steps / total_steps)
            entry = self.steps.get(plan_step, {}).get(layer)
            if entry is not None:
                return entry
        return self.layers.get(layer, self.default)

    # -- checks and (de)serialization ----------------------------------------------------------
    def validate(self, num_layers: int | None = None) -> "QAttnPlan":
        """Raise PlanError on anything malformed; ``num_layers`` bounds layer indices if given."""
        limit = num_layers if num_layers is not None else self.num_layers
        self.default = _precision(self.default, "qattn_plan.default")
        for layer, prec in self.layers.items():
            _index(layer, "qattn_plan.layers", limit)
            self.layers[layer] = _precision(prec, f"qattn_plan.layers[{layer}]")
        for step, entries in self.steps.items():
            _index(step, "qattn_plan.steps", self.num_steps)
            for layer, prec in entries.items():
                _index(layer, f"qattn_plan.steps[{step}]", limit)
                entries[layer] = _precision(prec, f"qattn_plan.steps[{step}][{layer}]")
        return self

    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "default": self.default,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
            "steps": {str(s): {str(k): v for k, v in sorted(e.items())} for s, e in sorted(self.steps.items())},
            "num_layers": self.num_layers,
            "num_steps": self.num_steps,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping, num_layers: int | None = None) -> "QAttnPlan":
        if isinstance(data, QAttnPlan):
            return data.validate(num_layers)
        if not isinstance(data, Mapping):
            raise PlanError(f"qattn_plan must be a dict (see hf_qattn.QAttnPlan); got {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"qattn_plan.version must be {PLAN_VERSION}; got {version!r}")
        unknown = set(data) - {"version", "default", "layers", "steps", "num_layers", "num_steps", "meta"}
        if unknown:
            raise PlanError(f"qattn_plan has unknown keys {sorted(unknown)}")
        for key in ("layers", "steps", "meta"):
            if not isinstance(data.get(key, {}), Mapping):
                raise PlanError(f"qattn_plan.{key} must be a dict")
        for key in ("num_layers", "num_steps"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise PlanError(f"qattn_plan.{key} must be a positive integer or null; got {value!r}")
        steps = data.get("steps", {})
        for step, entries in steps.items():
            if not isinstance(entries, Mapping):
                raise PlanError(f"qattn_plan.steps[{step}] must be a dict of layer → precision")
        plan = cls(
            default=data.get("default", DEFAULT_PRECISION),
            layers={_index(k, "qattn_plan.layers", None): v for k, v in data.get("layers", {}).items()},
            steps={_index(s, "qattn_plan.steps", None): {_index(k, f"qattn_plan.steps[{s}]", None): v
                                                         for k, v in e.items()} for s, e in steps.items()},
            num_layers=data.get("num_layers"),
            num_steps=data.get("num_steps"),
            meta=dict(data.get("meta", {})),
        )
        return plan.validate(num_layers)

    @classmethod
    def from_scores(
        cls,
        scores: Mapping[Hashable, float],
        ratio: float,
        *,
        num_layers: int | None = None,
        num_steps: int | None = None,
        meta: dict | None = None,
    ) -> "QAttnPlan":
        """The paper's mixing rule: the lowest-scoring ``ratio`` share of entries → int8, the rest int4.

        Keys are layer indices, or (step, layer) pairs for diffusion. ``round(ratio · n)``
        entries are marked (ties broken by key order, so the result is deterministic).
        """
        check_ratio(ratio)
        ranked = sorted(scores, key=lambda key: (scores[key], str(key)))
        marked = set(ranked[: round(ratio * len(ranked))])
        layers: dict[int, str] = {}
        steps: dict[int, dict[int, str]] = {}
        for key in scores:
            prec = "int8" if key in marked else "int4"
            if isinstance(key, tuple):
                steps.setdefault(int(key[0]), {})[int(key[1])] = prec
            else:
                layers[int(key)] = prec
        return cls(default="int4", layers=layers, steps=steps, num_layers=num_layers, num_steps=num_steps,
                   meta={"ratio": ratio, **(meta or {})})

    def count(self) -> dict[str, int]:
        """How many explicit entries each precision has (for reports)."""
        entries = list(self.layers.values()) + [p for e in self.steps.values() for p in e.values()]
        return {prec: entries.count(prec) for prec in PRECISIONS}
