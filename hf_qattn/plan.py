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
     "split_channel": [5],                       # layers whose K has an outlier channel (computed in float)
     "num_layers": 12, "num_steps": 50,          # the model / run the plan was made for
     "meta": {"ratio": 0.3, ...}}                 # free-form provenance (calibration settings)

A run with a different number of steps than ``num_steps`` maps step s of S to plan step
floor(s · num_steps / S): the plan is read by relative position in the denoising schedule.
"""

from __future__ import annotations

import math
import numbers
import re
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


_CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]*)")


def _index(key, where: str, limit: int | None) -> int:
    """A layer or step index: an int, or its canonical decimal string as JSON keeps it ("3"; not "03",
    " 3", 3.0 or True, which would not round-trip or would alias another key)."""
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        index = int(key)
    elif isinstance(key, str) and _CANONICAL_INT.fullmatch(key):
        index = int(key)
    else:
        raise PlanError(f"{where}: index must be an integer or its decimal string ('3', not '03' or 3.0); "
                        f"got {key!r}")
    if index < 0 or (limit is not None and index >= limit):
        bound = f"[0, {limit})" if limit is not None else ">= 0"
        raise PlanError(f"{where}: index {index} out of range {bound}")
    return index


def _indexed(entries, where: str, limit: int | None) -> dict:
    """``entries`` with canonical int keys; two keys naming one index (1 and "1") are an error."""
    if not isinstance(entries, Mapping):
        raise PlanError(f"{where} must be a dict of index → entry; got {type(entries).__name__}")
    out, spelled = {}, {}
    for key, value in entries.items():
        index = _index(key, where, limit)
        if index in out:
            raise PlanError(f"{where}: index {index} is given twice (keys {spelled[index]!r} and {key!r})")
        out[index], spelled[index] = value, key
    return out


def _count(value, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{where} must be a positive integer or null; got {value!r}")
    return int(value)


@dataclass
class QAttnPlan:
    default: str = DEFAULT_PRECISION
    layers: dict[int, str] = field(default_factory=dict)
    steps: dict[int, dict[int, str]] = field(default_factory=dict)
    num_layers: int | None = None
    num_steps: int | None = None
    meta: dict = field(default_factory=dict)
    # layers where calibration found a K channel that smoothing cannot tame (hf_qattn.quant.split_channel):
    # their kernels compute it in float outside the integer product (qattn's split_channel); elsewhere
    # the split path's cost is not paid
    split_channel: list[int] = field(default_factory=list)

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

    def splits(self, layer: int | None) -> bool:
        """Whether ``layer`` computes its K outlier channel apart (see ``split_channel``)."""
        return layer in self.split_channel

    # -- checks and (de)serialization ----------------------------------------------------------
    def validate(self, num_layers: int | None = None) -> "QAttnPlan":
        """Raise PlanError on anything malformed; ``num_layers`` bounds layer indices if given.

        Normalizes in place: index keys become ints (``"3"`` and ``3`` are one key; both at once is an
        error), legacy precision spellings their current names.
        """
        self.num_layers = _count(self.num_layers, "qattn_plan.num_layers")
        self.num_steps = _count(self.num_steps, "qattn_plan.num_steps")
        num_layers = _count(num_layers, "num_layers")
        if not isinstance(self.meta, Mapping):
            raise PlanError(f"qattn_plan.meta must be a dict; got {type(self.meta).__name__}")
        limit = num_layers if num_layers is not None else self.num_layers
        self.default = _precision(self.default, "qattn_plan.default")
        self.layers = {layer: _precision(prec, f"qattn_plan.layers[{layer}]")
                       for layer, prec in _indexed(self.layers, "qattn_plan.layers", limit).items()}
        steps = {}
        for step, entries in _indexed(self.steps, "qattn_plan.steps", self.num_steps).items():
            steps[step] = {layer: _precision(prec, f"qattn_plan.steps[{step}][{layer}]")
                           for layer, prec in _indexed(entries, f"qattn_plan.steps[{step}]", limit).items()}
        self.steps = steps
        if isinstance(self.split_channel, (str, bytes)) or not isinstance(self.split_channel, (list, tuple, set)):
            raise PlanError(f"qattn_plan.split_channel must be a list of layer indices; got {self.split_channel!r}")
        self.split_channel = sorted({_index(layer, "qattn_plan.split_channel", limit) for layer in self.split_channel})
        return self

    def to_dict(self) -> dict:
        data = {
            "version": PLAN_VERSION,
            "default": self.default,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
            "steps": {str(s): {str(k): v for k, v in sorted(e.items())} for s, e in sorted(self.steps.items())},
            "num_layers": self.num_layers,
            "num_steps": self.num_steps,
            "meta": dict(self.meta),
        }
        if self.split_channel:  # written only when there is one: plans without stay as they were
            data["split_channel"] = list(self.split_channel)
        return data

    @classmethod
    def from_dict(cls, data: Mapping, num_layers: int | None = None) -> "QAttnPlan":
        if isinstance(data, QAttnPlan):
            return data.validate(num_layers)
        if not isinstance(data, Mapping):
            raise PlanError(f"qattn_plan must be a dict (see hf_qattn.QAttnPlan); got {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"qattn_plan.version must be {PLAN_VERSION}; got {version!r}")
        unknown = set(data) - {"version", "default", "layers", "steps", "split_channel", "num_layers", "num_steps",
                               "meta"}
        if unknown:
            raise PlanError(f"qattn_plan has unknown keys {sorted(unknown)}")
        for key in ("layers", "steps", "meta"):
            if not isinstance(data.get(key, {}), Mapping):
                raise PlanError(f"qattn_plan.{key} must be a dict")
        plan = cls(  # the constructor checks types and indices (validate)
            default=data.get("default", DEFAULT_PRECISION),
            layers=dict(data.get("layers", {})),
            steps={s: (dict(e) if isinstance(e, Mapping) else e) for s, e in data.get("steps", {}).items()},
            num_layers=data.get("num_layers"),
            num_steps=data.get("num_steps"),
            meta=dict(data.get("meta", {})),
            split_channel=data.get("split_channel", []),
        )
        return plan.validate(num_layers)

    @classmethod
    def resolve(cls, value, *, num_layers: int | None = None, stored: bool = False) -> "QAttnPlan | None":
        """The plan ``value`` names, checked for a model of ``num_layers`` attention layers; None for None.

        The one reading of a plan argument or a stored plan, for every integration and the cache:

        - a :class:`QAttnPlan` (validated in place and returned), or a plan dict (:meth:`from_dict`);
        - one precision for every layer (``"int8"``, ``"int4"``, ``"unquantized"``; legacy spellings read
          as :data:`LEGACY_SPELLINGS`) — not when ``stored``: a config's ``qattn_plan`` is the dict
          :meth:`to_dict` writes (a string there is a PlanError, as every other malformed entry).

        A plan that says it was made for another number of layers (``num_layers`` in it) is a PlanError,
        as are indices out of range; anything else is a TypeError.
        """
        if value is None:
            return None
        if isinstance(value, QAttnPlan) or isinstance(value, Mapping) or stored:
            plan = cls.from_dict(value)  # a stored non-dict: PlanError, "must be a dict"
        elif isinstance(value, str):
            plan = cls(default=_precision(value, "plan"))
        else:
            raise TypeError(f"plan must be a QAttnPlan, a plan dict, or one of {PRECISIONS} for every layer; "
                            f"got {type(value).__name__}")
        num_layers = _count(num_layers, "num_layers")
        if num_layers is not None and plan.num_layers is not None and plan.num_layers != num_layers:
            # before the index check: a plan for another model says so, not which index is out of range
            raise PlanError(f"qattn_plan.num_layers is {plan.num_layers} but the model has {num_layers} attention "
                            "layers: the plan was made for another model")
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
        entries are marked (ties broken by key order, so the result is deterministic). A score that
        is not a number, or NaN (which would rank by dict order), raises ``ValueError`` naming the entry.
        """
        check_ratio(ratio)
        for key, score in scores.items():
            what = f"(step, layer) {key}" if isinstance(key, tuple) else f"layer {key}"
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or math.isnan(score):
                raise ValueError(f"the score of {what} must be a number, not NaN; got {score!r} "
                                 "(a NaN score usually means the calibration saw non-finite activations)")
        ranked = sorted(scores, key=lambda key: (scores[key], str(key)))
        marked = set(ranked[: round(ratio * len(ranked))])
        layers: dict[int, str] = {}
        steps: dict[int, dict[int, str]] = {}
        for key in scores:
            prec = "int8" if key in marked else "int4"
            if isinstance(key, tuple):
                steps.setdefault(_index(key[0], "steps", None), {})[_index(key[1], f"steps[{key[0]}]", None)] = prec
            else:
                layers[_index(key, "layers", None)] = prec
        return cls(default="int4", layers=layers, steps=steps, num_layers=num_layers, num_steps=num_steps,
                   meta={"ratio": ratio, **(meta or {})})

    def count(self) -> dict[str, int]:
        """How many explicit entries each precision has (for reports)."""
        entries = list(self.layers.values()) + [p for e in self.steps.values() for p in e.values()]
        return {prec: entries.count(prec) for prec in PRECISIONS}
