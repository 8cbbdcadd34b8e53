"""Tile configurations from ``configs/kernels.json`` (shipped as ``hf_qattn.configs``), chosen per call.

A configuration is the default entry updated, in order, by every rule whose named keys all match
the call: ``arch`` (``"sm90"``…, or ``"interpreter"`` under TRITON_INTERPRET), ``head_dim`` (padded),
``causal``, ``pv`` and ``qk``. The benchmark writes better rules back into the file, not into code.
The Hopper kernel's settings (``hopper``) and the quantized-cache kernels' (``decode``) are a default
with overrides by head dim, or for the interpreter.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources

import torch

from . import formats


@functools.lru_cache(maxsize=None)
def table() -> dict:
    try:
        text = resources.files("hf_qattn.configs").joinpath("kernels.json").read_text()
    except ModuleNotFoundError:  # a source checkout that is not installed: configs/ beside kernels/
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                               "kernels.json")) as f:
            text = f.read()
    return json.loads(text)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def arch_of(device: torch.device) -> str:
    if interpreting() or device.type != "cuda":
        return "interpreter"
    major, minor = capability(device.index if device.index is not None else torch.cuda.current_device())
    return f"sm{major}{minor}"


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    """Compute capability of a CUDA device, asked once (it is on every call's path)."""
    return torch.cuda.get_device_capability(device_index)


padded_head_dim = formats.padded_head_dim


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, asked once (the launchers size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def attention_config(arch: str, head_dim: int, causal: bool, pv: str = "fp8", qk: str = "int8") -> dict:
    """The tile configuration for one call (a fresh dict; the lookup itself is cached)."""
    return dict(_attention_config(arch, padded_head_dim(head_dim), causal, pv, qk))


@functools.lru_cache(maxsize=None)
def _attention_config(arch: str, head_dim: int, causal: bool, pv: str, qk: str) -> dict:
    entry = table()["attention"]
    config = dict(entry["default"])
    call = {"arch": arch, "head_dim": padded_head_dim(head_dim), "causal": causal, "pv": pv, "qk": qk}
    for rule in entry["rules"]:
        if all(rule[key] == value for key, value in call.items() if key in rule):
            config.update({key: value for key, value in rule.items() if key not in call})
    return config


def _by_head_dim(name: str, d_pad: int) -> dict:
    """kernels.json's entry ``name``: its defaults, with those of the padded head dim over them."""
    entry = table()[name]
    return {**entry["default"], **entry["head_dim"].get(str(d_pad), {})}


@functools.lru_cache(maxsize=None)
def hopper_config(head_dim: int) -> dict:
    """The sm90 Gluon kernel's settings for this head dim (``hopper`` in kernels.json); cached, read-only."""
    return _by_head_dim("hopper", padded_head_dim(head_dim))


@functools.lru_cache(maxsize=None)
def centers_config(d_pad: int) -> dict:
    """The centers launch's shape for this padded head dim (``centers`` in kernels.json); cached, read-only."""
    return _by_head_dim("centers", d_pad)


def hopper_stages(head_dim: int, solo: bool) -> int:
    """Ring stages of a SOLO CTA or of a warp-specialized one (kernels.json STAGES "solo" / "warp_specialized",
    by head dim: three SOLO CTAs an SM must share its shared memory; the warp-specialized CTA holds an SM)."""
    return hopper_config(head_dim)["STAGES"]["solo" if solo else "warp_specialized"]


def hopper_solo(head_dim: int, *, persistent: bool) -> bool:
    """Whether the sm90 kernel runs SOLO CTAs (kernels/hopper/mainloop.py attend_solo): one warpgroup that loads
    its own key tiles and runs each tile's steps in turn, three CTAs an SM, its FP32 output in registers — where
    the head dim's SOLO is set (kernels.json: head dims up to 128; a 64×256 FP32 output does not fit its 168
    registers) and the grid is not persistent (a SOLO CTA has one work item). On an H200 it ran the kernel alone
    2–12 % faster than the warp-specialized CTAs the launch picked otherwise, full and causal, d64 and d128, 4k
    to 75.6k keys (eval/results/solo-*.md); every variant's build holds no local memory in its loops with
    Triton 3.6 and 3.9 (tests/test_hopper.py)."""
    return bool(hopper_config(head_dim)["SOLO"]) and not persistent


def hopper_register_cap(head_dim: int, solo: bool, variant: bool = False) -> int:
    """The sm90 kernel's cap on registers a thread: the head dim's SOLO_REGISTERS for a SOLO CTA, "variants" for a
    call with a window, chunk, sinks or soft-cap (``variant``), "plain" otherwise (kernels.json: 168 lets three CTAs
    share an SM's 64K, 3 × 128 × 168, so three warpgroups' steps overlap without sharing a ring, and a 64×128 FP32
    output, S and P·V's fresh accumulator fit them; 128, four CTAs, where a head dim's loops fit it: plain d64);
    none for the warp-specialized CTA (its warp_specialize splits the SM's registers between its roles)."""
    return hopper_config(head_dim)["SOLO_REGISTERS"]["variants" if variant else "plain"] if solo else 0


def hopper_cta_shape(head_dim: int, *, persistent: bool, variant: bool, solo: bool | None = None,
                     pv_tiles: int | None = None, stages: int | None = None) -> tuple[bool, int, int, int]:
    """(SOLO, consumer warpgroups, ring stages, register cap) of the sm90 kernel's CTA for a call — one decision for
    the launch and the offline build. ``solo`` None: :func:`hopper_solo` decides, unless ``pv_tiles`` is given (only
    the warp-specialized CTA has that setting); an explicit SOLO that cannot run is refused (:func:`check_solo`).
    ``stages``: the head dim's unless given; ``variant``: the call has a window, chunk, sinks or soft-cap."""
    if solo is None:
        solo = pv_tiles is None and hopper_solo(head_dim, persistent=persistent)
    elif solo:
        check_solo(head_dim, persistent=persistent)
    return (solo, 1 if solo else 2, stages or hopper_stages(head_dim, solo),
            hopper_register_cap(head_dim, solo, variant=variant))


def check_solo(head_dim: int, *, persistent: bool) -> None:
    """Refuse a SOLO CTA asked for explicitly where it cannot run: past head dim 128 (a 64×D FP32 output and a
    fresh P·V accumulator do not fit 168 registers) or on a persistent grid (a SOLO CTA runs one work item)."""
    if padded_head_dim(head_dim) > 128:
        raise ValueError(f"solo: SOLO CTAs serve head dims up to 128, got {head_dim}")
    if persistent:
        raise ValueError("solo: SOLO CTAs run one work item each; persistent must be False")


def hopper_causal_split(head_dim: int, *, causal: bool, variant_span: bool, keys: int) -> bool:
    """Whether the sm90 kernel splits a causal call's main loop at the diagonal (kernels/hopper/mainloop.py): from
    the head dim's CAUSAL_SPLIT_FROM keys on (kernels.json), never with a window or chunk (their tiles are masked
    at both ends)."""
    return causal and not variant_span and keys >= hopper_config(head_dim)["CAUSAL_SPLIT_FROM"]


def hopper_s_float_by_add(head_dim: int, *, causal: bool, variant: bool, softcap: bool, split: bool) -> bool:
    """Whether the sm90 kernel turns its int32 scores into float32 by an integer add instead of I2F
    (kernels/hopper/mainloop.py _softmax): the head dim's S_FLOAT_BY_ADD for the call's kind — "variants" (a
    window, chunk, sinks or soft-cap), "causal" or "full" (kernels.json) — and never with a soft-cap, whose tanh
    needs the true scores, nor with K's split channel (opt-in): Triton 3.9 builds its causal d128 loop with the
    row offset reloaded from local memory twice a tile (3.6: none)."""
    kind = "variants" if variant else "causal" if causal else "full"
    return not (softcap or split) and bool(hopper_config(head_dim)["S_FLOAT_BY_ADD"][kind])


@functools.lru_cache(maxsize=None)
def break_even(arch: str, head_dim: int, causal: bool) -> int:
    """Queries and keys (each) from which the quantized kernels beat full-precision attention on ``arch`` at this
    head dim (``break_even`` in kernels.json); 0 where none is listed (every call runs quantized)."""
    entry = table()["break_even"].get(arch, {}).get(str(padded_head_dim(head_dim)), {})
    return int(entry.get("causal" if causal else "full", 0))


@functools.lru_cache(maxsize=None)
def decode_config(interpreter: bool) -> dict:
    """The quantized-cache kernels' settings (``decode`` in kernels.json): the GPU's, or with the interpreter's
    overrides; cached, read-only."""
    entry = table()["decode"]
    return {**entry["default"], **(entry["interpreter"] if interpreter else {})}


def center_sample() -> int:
    return int(table()["center_sample"])


def v_center_sample() -> int:
    return int(table()["v_center_sample"])


def register_cap(maxnreg: int, interp: bool | None = None) -> dict:
    """The launch option capping a kernel's registers a thread (0: none; the interpreter takes no such option;
    ``interp``: :func:`interpreting`, if the caller read it already)."""
    return {"maxnreg": maxnreg} if maxnreg and not (interpreting() if interp is None else interp) else {}


def quantize_num_warps(block_n: int, head_dim: int) -> int:
    """Warps for the K/V quantization kernel: one per 1024 elements of its tile (≈ 90 registers a
    thread for two fp32 tiles, so several programs share an SM), between 4 and 16."""
    return max(4, min(16, block_n * padded_head_dim(head_dim) // 1024))


def reference_settings(config: dict) -> dict:
    """Keywords for :func:`hf_qattn.reference.quantized_attention` that simulate ``config`` tile for tile."""
    q_group = config["Q_GROUP"]
    return {
        "block_m": config["BLOCK_M"],
        "block_n": config["BLOCK_N"],
        "warp_rows": q_group,
        "q_granularity": "token" if q_group == 1 else "block" if q_group == config["BLOCK_M"] else "warp",
        "k_granularity": "token" if config["K_TOKEN_SCALE"] else "block",
        "v_granularity": "block",
        "center_sample": center_sample(),
        "v_center_sample": v_center_sample(),
    }


def v_dither(softcap: bool) -> bool:
    """Whether the sm90 kernel quantizes V with its tile dither (kernels/formats.py): always but under a soft
    cap, where the one more per-row term left a main loop spilling (d256 with every variant; offline_build);
    soft-capped models (Gemma 2) hold 8k tokens, and the error the dither removes shows from 32k."""
    return not softcap


def hopper_reference_settings(softcap: bool = False) -> dict:
    """Keywords for :func:`hf_qattn.reference.quantized_attention` that simulate the sm90 Gluon kernel:
    Q per token, K per 128-key tile, V per channel over all keys (with the tile dither unless ``softcap``)."""
    return {"block_m": 128, "block_n": hopper_config(128)["BLOCK_N"], "warp_rows": 16, "q_granularity": "token",
            "k_granularity": "block", "v_granularity": "channel-dither" if v_dither(softcap) else "channel",
            "center_sample": center_sample(), "v_center_sample": v_center_sample()}

