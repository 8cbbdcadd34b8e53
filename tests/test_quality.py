"""hf_qattn.evaluation.quality (weight-free image/video metrics) and eval/pipeline_quality.py end to end."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hf_qattn.evaluation import quality

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_psnr_values(seed):
    a = torch.rand(2, 3, 16, 16)
    assert torch.isinf(quality.psnr(a, a)).all()
    zeros, tenth = torch.zeros(1, 3, 8, 8), torch.full((1, 3, 8, 8), 0.1)
    assert quality.psnr(zeros, tenth).item() == pytest.approx(20.0)  # 10·log10(1 / 0.01)


def test_ssim_values(seed):
    a = torch.rand(2, 3, 24, 24)
    assert torch.allclose(quality.ssim(a, a), torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(quality.ssim(a, a.flip(0)), quality.ssim(a.flip(0), a))  # symmetric
    noisy = [quality.ssim(a, (a + s * torch.randn_like(a)).clamp(0, 1)).mean().item() for s in (0.01, 0.1, 0.3)]
    assert noisy[0] > noisy[1] > noisy[2]
    # two flat images: SSIM reduces to its luminance term (2uw + C1) / (u² + w² + C1)
    u, w, c1 = 0.2, 0.6, 0.01 ** 2
    flat = quality.ssim(torch.full((1, 1, 16, 16), u), torch.full((1, 1, 16, 16), w)).item()
    assert flat == pytest.approx((2 * u * w + c1) / (u * u + w * w + c1))
    with pytest.raises(ValueError, match="at least 11"):
        quality.ssim(torch.rand(1, 1, 8, 8), torch.rand(1, 1, 8, 8))


def test_ssim_averages_the_windows_inside_the_image(seed):
    # 11×11 images hold one window: SSIM is the formula on the Gaussian-weighted statistics of the whole image
    # (torchmetrics' own mean would also take in the windows it centres on the reflection-padded border)
    a = torch.rand(2, 1, 11, 11, dtype=torch.float64)
    b = (a + 0.2 * torch.randn_like(a)).clamp(0, 1)
    x = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-x ** 2 / (2 * 1.5 ** 2))
    w = (g[:, None] * g[None, :]) / g.sum() ** 2
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    for i in range(2):
        mu_a, mu_b = (w * a[i, 0]).sum(), (w * b[i, 0]).sum()
        var_a, var_b = (w * a[i, 0] ** 2).sum() - mu_a ** 2, (w * b[i, 0] ** 2).sum() - mu_b ** 2
        cov = (w * a[i, 0] * b[i, 0]).sum() - mu_a * mu_b
        expected = (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
        assert quality.ssim(a, b)[i].item() == pytest.approx(expected.item(), rel=1e-12)


def test_psnr_and_ssim_without_torchmetrics_name_the_extra(monkeypatch):
    for name in ("torchmetrics", "torchmetrics.functional", "torchmetrics.functional.image"):
        monkeypatch.setitem(sys.modules, name, None)  # what an import sees when the package is not installed
    a = torch.rand(1, 3, 16, 16)
    for metric in (quality.psnr, quality.ssim):
        with pytest.raises(ImportError, match=r"pip install 'hf-qattn\[diffusers\]'"):
            metric(a, a)


def test_frame_cosine_and_temporal_flickering(seed):
    video = torch.rand(2, 5, 3, 8, 8)
    assert torch.allclose(quality.frame_cosine(video, video), torch.ones(2, 5, dtype=torch.float64))
    still = video[:, :1].expand(2, 5, 3, 8, 8)
    assert torch.equal(quality.temporal_flickering(still), torch.ones(2, dtype=torch.float64))
    blink = torch.zeros(1, 4, 3, 8, 8)
    blink[:, 1::2] = 1.0  # black, white, black, white: every pixel changes by 255
    assert quality.temporal_flickering(blink).item() == 0.0
    report = quality.report(video, video)
    assert math.isinf(report["psnr"]) and report["flicker"] == report["flicker_ref"]
    assert report["cos_min"] == pytest.approx(1.0, abs=1e-12)


def test_pipeline_quality_script_end_to_end(tmp_path):
    pytest.importorskip("diffusers")
    run = subprocess.run([sys.executable, os.path.join(REPO, "eval", "pipeline_quality.py"), "--out", str(tmp_path),
                          "--steps", "2", "--prompts", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = list(tmp_path.glob("pipeline-quality-*.md"))
    rows = [line.split(" | ") for line in path.read_text().splitlines() if line.startswith("| flux") or
            line.startswith("| wan")]
    assert len(rows) == 6
    for row in rows:
        mode, psnr, fallbacks = row[2], row[4], row[-1].strip(" |")
        assert fallbacks == "0"
        if mode == "sdpa":
            assert psnr == "inf"  # the same seed twice: identical pixels
        else:
            # qattn moves the pixels, and not by much (measured 60-93 dB on these pipelines)
            assert 40.0 < float(psnr) < math.inf
