"""Generate with a diffusers pipeline once per attention mode and compare each output with the SDPA one.

The engine of ``hf-qattn eval-pipeline`` and of ``eval/pipeline_quality.py`` (one implementation):

- :func:`run` generates every :class:`Call` (keyword arguments and a seed) under every mode, the
  reference first: ``sdpa`` (the pipeline unpatched, full precision), ``int8`` / ``int4``
  (``hf_qattn.patch(pipe, plan=...)`` with that precision in every layer) and ``plan`` (the plan
  stored in each denoiser's config by ``calibrate-pipeline``, or one given). Every output is compared
  with the reference output of the same call (same seed) by :func:`hf_qattn.evaluation.quality.sample_metrics`;
  only one call's outputs are held at a time. A mode given twice runs twice (labels ``int8#2``...).
- :func:`pixels` turns what a pipeline returns (``images`` or ``frames``; tensors, arrays or PIL
  images) into float tensors in [0, 1]: images (N, C, H, W), videos (N, F, C, H, W), and says which.
- :func:`vbench_stem` names a sample the way VBench expects, :func:`save_sample` writes it (PNG, or
  MP4 through imageio / torchvision when installed, else one PNG per frame in a folder).
- :func:`summarize` gives each mode's mean and worst of every metric.

Generators are CPU ``torch.Generator`` objects seeded per call, so a call's initial noise is the same
in every mode and on every device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import quality
from ..progress import track
from ..stats import fallback_stats, reset_fallback_stats

MODES = ("sdpa", "int8", "int4", "plan")
REFERENCE = "sdpa"
METRICS = quality.SAMPLE_METRICS  # all higher-is-better: a mode's worst is its lowest
VBENCH_NAME_CHARS = 180  # VBench-2.0 names a video by the first 180 characters of its prompt
_NAME_BYTES = 255  # what most file systems allow in one name


@dataclass
class Call:
    """One generation: ``kwargs`` for the pipeline (e.g. ``{"prompt": ...}``), its seed, and the
    ``name`` / ``index`` it is reported and saved under (VBench: the prompt and the sample index)."""

    name: str
    index: int
    seed: int
    kwargs: dict = field(default_factory=dict)


@dataclass
class Result:
    """What :func:`run` measured: one row per (call, mode) in ``rows``; per mode label the calls by
    path and fallbacks (``stats``) and the plans that ran (``plans``); ``kind`` is image or video."""

    kind: str
    labels: list[str]
    rows: list[dict]
    stats: dict[str, dict] = field(default_factory=dict)
    plans: dict[str, dict] = field(default_factory=dict)
    shape: tuple = ()


def mode_labels(modes: Sequence[str]) -> list[str]:
    """Labels of ``modes`` in order: a mode given again gets ``#2``, ``#3``, ..."""
    seen: Counter = Counter()
    labels = []
    for mode in modes:
        seen[mode] += 1
        labels.append(mode if seen[mode] == 1 else f"{mode}#{seen[mode]}")
    return labels


def mode_context(pipe, mode: str, plan=None):
    """The context a mode generates in: nothing for ``sdpa``; else ``hf_qattn.patch`` (for ``plan``:
    ``plan``, where None means each denoiser's stored plan). Entering it returns the patch or None."""
    if mode == REFERENCE:
        return contextlib.nullcontext()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    from ..integrations.diffusers import patch

    return patch(pipe, plan=plan if mode == "plan" else mode)


# -- pipeline output → pixels --------------------------------------------------------------------

def _as_tensor(value, channels_last: bool) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().float().cpu()
    elif isinstance(value, (list, tuple)) and value and not hasattr(value[0], "shape") and \
            not isinstance(value[0], (list, tuple)):  # PIL images
        import numpy as np

        return torch.stack([_as_tensor(np.asarray(image.convert("RGB"), dtype=np.float32) / 255, True)
                            for image in value])
    elif isinstance(value, (list, tuple)):
        return torch.stack([_as_tensor(item, channels_last) for item in value])
    else:  # numpy: diffusers' "np" output is channels-last
        tensor = torch.from_numpy(value).float()
        channels_last = True
    if channels_last and tensor.dim() >= 3:
        tensor = tensor.movedim(-1, -3)
    return tensor


def pixels(output, kind: str | None = None) -> tuple[torch.Tensor, str]:
    """(pixels, kind) of a pipeline output: images (N, C, H, W) or videos (N, F, C, H, W), float in [0, 1].

    ``kind`` ``None`` detects it: a ``frames`` field is video, ``images`` is image. ``"video"`` reads a
    4-D tensor as the frames of one video; ``"image"`` accepts videos of a single frame only.
    """
    if hasattr(output, "frames"):
        value, found = output.frames, "video"
    elif hasattr(output, "images"):
        value, found = output.images, "image"
    elif isinstance(output, (tuple, list)) and output:
        value, found = output[0], None
    else:
        raise ValueError(f"the pipeline returned {type(output).__name__}, which holds no images or frames")
    tensor = _as_tensor(value, channels_last=False)
    if tensor.dim() == 3:
        tensor = tensor[None]
    kind = kind or found or ("video" if tensor.dim() == 5 else "image")
    if kind == "video" and tensor.dim() == 4:
        tensor = tensor[None]
    if kind == "image" and tensor.dim() == 5:
        if tensor.shape[1] != 1:
            raise ValueError(f"the pipeline returns videos of {tensor.shape[1]} frames, not images")
        tensor = tensor[:, 0]
    if tensor.dim() != (5 if kind == "video" else 4):
        raise ValueError(f"cannot read the pipeline's output of shape {tuple(tensor.shape)} as {kind}s")
    return tensor, kind


def generate(pipe, call: Call, steps: int, kind: str | None = None, **common) -> tuple[torch.Tensor, str]:
    """Run ``pipe`` on one call (its seed on a CPU generator) and return :func:`pixels` of the output."""
    generator = torch.Generator("cpu").manual_seed(call.seed)
    with torch.no_grad():
        output = pipe(**common, **call.kwargs, num_inference_steps=steps, generator=generator, output_type="pt")
    return pixels(output, kind)


# -- the loop ------------------------------------------------------------------------------------

def _add_stats(total: dict, stats: dict) -> None:
    for group in ("calls", "fallbacks"):
        counts = total.setdefault(group, {})
        for key, value in stats.get(group, {}).items():
            counts[key] = counts.get(key, 0) + value


def run(pipe, calls: Sequence[Call], modes: Sequence[str], *, steps: int, plan=None, kind: str | None = None,
        save: Callable[[str, Call, torch.Tensor, str], object] | None = None, progress: bool = True,
        **common) -> Result:
    """Generate every call under every mode and compare each output with the ``sdpa`` output of that call.

    Args:
        pipe: a diffusers pipeline (its own progress bar is best disabled).
        calls: the generations; their ``kwargs`` and ``common`` go to the pipeline.
        modes: from :data:`MODES`, in report order; ``sdpa`` must be among them (the reference; its
            first occurrence is generated first for every call and compared with itself).
        steps: denoising steps per call.
        plan: the plan of mode ``plan`` (None: each denoiser's stored plan).
        kind: ``"image"`` / ``"video"``, or None to detect from the output.
        save: called as ``save(label, call, pixels, kind)`` after each generation; what it returns is
            kept in the row as ``file``.
        progress: a progress bar over the generations (tqdm when installed, else a stderr line).
    """
    labels = mode_labels(modes)
    if REFERENCE not in modes:
        raise ValueError(f"modes must include {REFERENCE!r}, the reference every output is compared with")
    order = sorted(range(len(modes)), key=lambda i: labels[i] != REFERENCE)  # the reference first
    tasks = [(call, labels[i], modes[i]) for call in calls for i in order]
    result = Result(kind=kind or "", labels=labels, rows=[], stats={label: {} for label in labels})
    reference, position = None, {}
    for call, label, mode in track(tasks, "hf-qattn eval-pipeline", progress):
        reset_fallback_stats()
        with mode_context(pipe, mode, plan) as handle:
            if handle is not None and label not in result.plans:
                result.plans[label] = {name: p.to_dict() for name, p in handle.plans.items()}
            image, result.kind = generate(pipe, call, steps, kind or (result.kind or None), **common)
        stats = fallback_stats()
        _add_stats(result.stats[label], stats)
        if label == REFERENCE:
            reference = image
        result.shape = tuple(image.shape[1:])
        metrics = quality.sample_metrics(reference, image)
        row = {"prompt": call.name, "index": call.index, "seed": call.seed, "mode": label,
               **{key: float(value.mean()) for key, value in metrics.items()},
               "calls": sum(stats["calls"].values()), "fallbacks": sum(stats["fallbacks"].values())}
        if save is not None:
            row["file"] = save(label, call, image, result.kind)
        position[id(row)] = (len(position) // len(modes), labels.index(label))
        result.rows.append(row)
    result.rows.sort(key=lambda row: position[id(row)])  # by call, then in the order of `modes`
    return result


def summarize(rows: Sequence[dict], labels: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode label, per metric: the ``mean`` over its rows and the ``worst`` (lowest) row."""
    summary = {}
    for label in labels:
        mine = [row for row in rows if row["mode"] == label]
        summary[label] = {}
        for metric in METRICS:
            values = [row[metric] for row in mine if row.get(metric) is not None]
            if values:
                summary[label][metric] = {"mean": sum(values) / len(values), "worst": min(values)}
    return summary


# -- files ---------------------------------------------------------------------------------------

def vbench_stem(prompt: str, index: int) -> str:
    """``{prompt}-{index}``, the name VBench gives sample ``index`` of ``prompt`` (add ``.mp4`` / ``.png``).

    VBench names files by the prompt verbatim: its standard mode looks for exactly
    ``f"{prompt}-{i}.mp4"``, its ``custom_input`` mode reads the prompt back by cutting ``-<digits>``
    off the name, and VBench-2.0 keeps the first 180 characters of a long prompt. So the prompt is
    kept as it is (surrounding whitespace stripped, as VBench strips its prompt lines), cut to 180
    characters; only what a file name cannot hold changes: ``/``, NUL and other control characters
    become ``_``, and a name over 255 bytes of UTF-8 is cut further.
    """
    text = prompt.strip()[:VBENCH_NAME_CHARS]
    text = "".join("_" if char == "/" or ord(char) < 32 or ord(char) == 127 else char for char in text)
    suffix = f"-{index}"
    room = _NAME_BYTES - len(suffix) - len(".mp4")
    while len(text.encode("utf-8")) > room:
        text = text[:-1]
    return text + suffix


def video_writer() -> str:
    """How videos are written: ``"imageio"`` (imageio + imageio-ffmpeg), ``"torchvision"`` (with PyAV),
    or ``"png-frames"`` (one PNG per frame in a folder) when neither is installed."""
    def have(*names):
        return all(importlib.util.find_spec(name) is not None for name in names)

    if have("imageio", "imageio_ffmpeg"):
        return "imageio"
    if have("torchvision", "av"):
        return "torchvision"
    return "png-frames"


def _uint8(frames: torch.Tensor):
    """(…, C, H, W) floats in [0, 1] → numpy uint8 (…, H, W, C)."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1).numpy()


def save_sample(folder, stem: str, sample: torch.Tensor, kind: str, fps: int = 8, writer: str | None = None) -> str:
    """Write one sample (an image (C, H, W) or a video (F, C, H, W)) as ``folder/stem.png``,
    ``folder/stem.mp4`` or, with writer ``png-frames``, ``folder/stem/00000.png``...; returns the
    path written, relative to ``folder``."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    if kind == "image":
        Image.fromarray(_uint8(sample)).save(os.path.join(folder, stem + ".png"))
        return stem + ".png"
    writer = writer or video_writer()
    frames = _uint8(sample)
    if writer == "imageio":
        import imageio

        imageio.mimwrite(os.path.join(folder, stem + ".mp4"), list(frames), fps=fps)
        return stem + ".mp4"
    if writer == "torchvision":
        import torchvision

        torchvision.io.write_video(os.path.join(folder, stem + ".mp4"), torch.from_numpy(frames), fps=fps)
        return stem + ".mp4"
    if writer != "png-frames":
        raise ValueError(f"writer must be imageio, torchvision or png-frames; got {writer!r}")
    os.makedirs(os.path.join(folder, stem), exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(os.path.join(folder, stem, f"{i:05d}.png"))
    return stem + "/"


# -- VBench --------------------------------------------------------------------------------------

VBENCH_DIMENSIONS = ("subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
                     "dynamic_degree", "aesthetic_quality", "imaging_quality", "object_class", "multiple_objects",
                     "human_action", "color", "spatial_relationship", "scene", "temporal_style", "appearance_style",
                     "overall_consistency")
# VBench's video-quality dimensions, which score any prompt's videos (its custom_input mode)
VBENCH_DEFAULT = ("temporal_flickering", "subject_consistency", "background_consistency", "motion_smoothness",
                  "dynamic_degree", "aesthetic_quality", "imaging_quality")
# dimensions that score against annotations of VBench's own prompt suite: not for custom prompts
VBENCH_SUITE_ONLY = ("object_class", "multiple_objects", "color", "spatial_relationship", "scene", "appearance_style")
# the files each dimension loads from VBench's cache folder in its local mode (VBench 0.1.5's layout);
# VBench downloads missing ones itself, which this module never lets it do
VBENCH_WEIGHTS = {
    "temporal_flickering": (),
    "subject_consistency": ("dino_model/dino_vitbase16_pretrain.pth", "dino_model/facebookresearch_dino_main"),
    "background_consistency": ("clip_model/ViT-B-32.pt",),
    "aesthetic_quality": ("clip_model/ViT-L-14.pt", "aesthetic_model/emb_reader/sa_0_4_vit_l_14_linear.pth"),
    "imaging_quality": ("pyiqa_model/musiq_spaq_ckpt-358bb6af.pth",),
    "motion_smoothness": ("amt_model/amt-s.pth",),
    "dynamic_degree": ("raft_model/models/raft-things.pth",),
    "human_action": ("umt_model/l16_ptk710_ftk710_ftk400_f16_res224.pth",),
    "temporal_style": ("ViCLIP/ViClip-InternVid-10M-FLT.pth",),
    "overall_consistency": ("ViCLIP/ViClip-InternVid-10M-FLT.pth",),
}


def vbench_cache_dir() -> str:
    """Where VBench keeps its weights: ``$VBENCH_CACHE_DIR``, else ``~/.cache/vbench``."""
    return os.environ.get("VBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vbench")


def vbench_skips(dimensions: Sequence[str], kind: str, writer: str) -> dict[str, str | None]:
    """Per dimension, why it cannot run here (None: it can): images, a suite-only dimension, no
    ``vbench`` package, videos saved as PNG frames, or weights missing from :func:`vbench_cache_dir`."""
    have_vbench = importlib.util.find_spec("vbench") is not None
    skips = {}
    for dimension in dimensions:
        missing = [path for path in VBENCH_WEIGHTS.get(dimension, ())
                   if not os.path.exists(os.path.join(vbench_cache_dir(), path))]
        if kind != "video":
            skips[dimension] = "images: VBench scores videos"
        elif dimension in VBENCH_SUITE_ONLY:
            skips[dimension] = "needs VBench's own prompt suite and its annotations (vbench_standard mode)"
        elif not have_vbench:
            skips[dimension] = ("VBench missing: the vbench package is not importable here (it pins transformers "
                                "4.33 and numpy < 2, so it usually has its own environment: run it there on the "
                                "saved folders)")
        elif writer == "png-frames":
            skips[dimension] = "videos saved as PNG frames (no MP4 writer installed), which VBench does not read"
        elif missing:
            skips[dimension] = (f"weights missing: {', '.join(os.path.join(vbench_cache_dir(), p) for p in missing)} "
                                "(VBench would download them; fetch them once, or set VBENCH_CACHE_DIR)")
        else:
            skips[dimension] = None
    return skips


def vbench_command(videos: str, dimension: str, output: str) -> str:
    """The ``vbench`` command line that scores one folder on one dimension, for another environment."""
    import shlex

    return (f"vbench evaluate --videos_path {shlex.quote(videos)} --dimension {dimension} --mode custom_input "
            f"--output_path {shlex.quote(output)}")


def run_vbench(folders: dict[str, str], dimensions: Sequence[str], output: str, device) -> dict[str, dict]:
    """Score each mode's folder of videos on ``dimensions`` with VBench (custom_input mode, local
    weights). Returns per dimension ``{"scores": {label: score}, "failed": {label: reason}}``: a VBench
    error is reported in one line per mode, never as a traceback."""
    import json

    results: dict[str, dict] = {dimension: {"scores": {}, "failed": {}} for dimension in dimensions}
    if not dimensions:
        return results
    try:
        import vbench
        from vbench import VBench
    except Exception as error:  # noqa: BLE001 -- any import failure means VBench does not run here
        for dimension in dimensions:
            results[dimension]["failed"] = {label: f"VBench does not import: {type(error).__name__}: "
                                                   f"{_first_line(error)}" for label in folders}
        return results
    full_info = os.path.join(os.path.dirname(vbench.__file__), "VBench_full_info.json")
    for label, folder in folders.items():
        for dimension in dimensions:  # one dimension at a time, so that one failing spares the others
            name = f"{label}.{dimension}"
            try:
                VBench(str(device), full_info, output).evaluate(videos_path=folder, name=name,
                                                                dimension_list=[dimension], local=True,
                                                                mode="custom_input")
                with open(os.path.join(output, f"{name}_eval_results.json"), encoding="utf-8") as file:
                    results[dimension]["scores"][label] = float(json.load(file)[dimension][0])
            except Exception as error:  # noqa: BLE001
                results[dimension]["failed"][label] = f"{type(error).__name__}: {_first_line(error)}"
    return results


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
