"""Weight-free image/video quality of a quantized run against the full-precision run of the same seed.

Layout: images (N, C, H, W) and videos (N, F, C, H, W), float, values in [0, ``data_range``].

- :func:`psnr` — 10·log10(range² / MSE) per sample (inf when identical);
- :func:`ssim` — mean structural similarity per sample, Gaussian window 11 / σ 1.5 on every channel
  (Wang et al. 2004, the constants K1 = 0.01, K2 = 0.03), over the windows that lie inside the image;
- :func:`frame_cosine` — cosine similarity of each frame, flattened;
- :func:`temporal_flickering` — VBench's weight-free dimension: 1 − mean |frame t+1 − frame t| / 255
  on 8-bit frames, per video (1 = no change between frames);
- :func:`sample_metrics` — all of these per sample (what ``hf-qattn eval-pipeline`` reports), frames
  taken a few at a time so that long high-resolution videos fit in memory; :func:`report` — their means.

PSNR and SSIM are torchmetrics' (an optional dependency, imported on first use: ``pip install
'hf-qattn[diffusers]'``). Flickering is written here: VBench's formula is in no metrics library.
"""

from __future__ import annotations

import torch


def _image_metrics():
    """``torchmetrics.functional.image``, imported on first use."""
    try:
        from torchmetrics.functional import image
    except ImportError as error:
        raise ImportError("hf_qattn.evaluation.quality computes PSNR and SSIM with torchmetrics, which is not "
                          "installed: pip install 'hf-qattn[diffusers]' (or pip install torchmetrics)") from error
    return image


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """PSNR per sample of two tensors of one shape (N, ...), in float64; +inf where they are equal."""
    return _image_metrics().peak_signal_noise_ratio(a.double(), b.double(), data_range=data_range, reduction="none",
                                                    dim=tuple(range(1, a.dim())))


_SSIM_WINDOW, _SSIM_SIGMA = 11, 1.5


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Mean SSIM per image of (N, C, H, W) tensors (valid windows only; H and W ≥ 11)."""
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(f"ssim takes two (N, C, H, W) tensors of one shape; got {tuple(a.shape)}, {tuple(b.shape)}")
    if min(a.shape[-2:]) < _SSIM_WINDOW:
        raise ValueError(f"ssim needs images of at least 11×11 pixels; got {tuple(a.shape[-2:])}")
    # torchmetrics pads the image by reflection and its own mean takes in the windows centred on the border
    # too; the map it returns is cropped to the windows that lie inside the image, as Wang et al. average
    _, index = _image_metrics().structural_similarity_index_measure(
        a.double(), b.double(), gaussian_kernel=True, sigma=_SSIM_SIGMA, kernel_size=_SSIM_WINDOW,
        data_range=data_range, k1=0.01, k2=0.03, reduction="none", return_full_image=True)
    pad = (_SSIM_WINDOW - 1) // 2
    return index[..., pad:-pad, pad:-pad].flatten(1).mean(1)


def frame_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each frame: (N, F, ...) → (N, F); images (N, C, H, W) count as one frame."""
    if a.dim() == 4:
        a, b = a[:, None], b[:, None]
    return torch.nn.functional.cosine_similarity(a.double().flatten(2), b.double().flatten(2), dim=-1)


def temporal_flickering(video: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """VBench's temporal flickering score per video of (N, F, C, H, W) frames in [0, data_range]."""
    if video.dim() != 5 or video.shape[1] < 2:
        raise ValueError(f"temporal_flickering takes (N, F ≥ 2, C, H, W) videos; got {tuple(video.shape)}")
    frames = (video.double() / data_range * 255).round().clamp(0, 255)
    change = (frames[:, 1:] - frames[:, :-1]).abs().flatten(2).mean(-1).mean(-1)
    return 1 - change / 255


SAMPLE_METRICS = ("psnr", "ssim", "frame_cosine", "temporal_flickering")
_FRAME_CHUNK = 16  # frames per step of sample_metrics: bounds the float64 copies SSIM makes


def sample_metrics(reference: torch.Tensor, other: torch.Tensor, data_range: float = 1.0) -> dict[str, torch.Tensor]:
    """Per-sample metrics of ``other`` against ``reference`` (one shape: (N, C, H, W) or (N, F, C, H, W)),
    each a float64 tensor of N values, higher is better for all:

    - ``psnr``: mean over frames of each frame's PSNR (inf when identical);
    - ``ssim``: mean over frames of each frame's SSIM (left out below 11×11 pixels);
    - ``frame_cosine``: the lowest cosine similarity of a frame (an image is one frame);
    - ``temporal_flickering``: VBench's score of ``other`` itself (videos of ≥ 2 frames only).
    """
    if reference.shape != other.shape or reference.dim() not in (4, 5):
        raise ValueError("sample_metrics takes two images (N, C, H, W) or videos (N, F, C, H, W) of one shape; got "
                         f"{tuple(reference.shape)}, {tuple(other.shape)}")
    video = reference.dim() == 5
    ref = reference if video else reference[:, None]
    out = other if video else other[:, None]
    with_ssim = min(ref.shape[-2:]) >= 11
    rows = []
    for a, b in zip(ref, out):  # one sample: (F, C, H, W)
        chunks = [(a[i:i + _FRAME_CHUNK], b[i:i + _FRAME_CHUNK]) for i in range(0, a.shape[0], _FRAME_CHUNK)]
        row = {"psnr": torch.cat([psnr(x, y, data_range) for x, y in chunks]).mean(),
               "frame_cosine": torch.cat([frame_cosine(x[None], y[None])[0] for x, y in chunks]).min()}
        if with_ssim:
            row["ssim"] = torch.cat([ssim(x, y, data_range) for x, y in chunks]).mean()
        if video and a.shape[0] >= 2:
            row["temporal_flickering"] = temporal_flickering(b[None], data_range)[0]
        rows.append(row)
    return {key: torch.stack([row[key] for row in rows]) for key in SAMPLE_METRICS if key in rows[0]}


def report(reference: torch.Tensor, other: torch.Tensor, data_range: float = 1.0) -> dict[str, float]:
    """Means over samples of every metric that applies to the layout (videos: SSIM over all frames);
    ``cos_min`` is the lowest frame cosine of all, ``flicker_ref`` the reference's flickering score."""
    metrics = sample_metrics(reference, other, data_range)
    row = {"psnr": float(metrics["psnr"].mean()), "cos_min": float(metrics["frame_cosine"].min())}
    if "ssim" in metrics:
        row["ssim"] = float(metrics["ssim"].mean())
    if "temporal_flickering" in metrics:
        row["flicker"] = float(metrics["temporal_flickering"].mean())
        row["flicker_ref"] = float(temporal_flickering(reference, data_range).mean())
    return row
