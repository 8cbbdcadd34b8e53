"""One zero-mean K outlier channel (issue 15, item 8): what fixes it, measured on the CPU.

    python eval/studies/outlier_channel_study.py

The input: B1 H2 N512 d64 fp16, Gaussian Q/K/V, K channel 5 = ±6e4 on alternating tokens (zero mean,
so smoothing cannot remove it). Printed: the cosine of each variant's output to float64 attention.

1. qattn-8b as shipped (reference path), and with ``split_channel=True`` (3., built in).
2. Moving a per-channel scale from K to Q (Q·diag(s), diag(1/s)·K, exact in real arithmetic) with
   s = max|K_c − k̄_c|^α / max|Q_c|^(1−α), for α = 0.5, 0.75, 1, then qattn-8b.
3. Splitting the outlier channel out of the INT8 product (channels whose max |K − k̄| exceeds 16× the
   median channel's): S = Q̂·K̂ᵀ over the other channels (INT8, per-token Q, per-128-key K, smoothing)
   + q_c·k_cᵀ in float32 — a rank-1 term per outlier channel, as ΔS is for smoothing. P·V unquantized.

Why 2 cannot work: the score term q_c·k_c is ~10⁴ times the others, and any split of it between Q and K
leaves one of them with a channel ≥ ~100× its other channels, so INT8 keeps < 1 bit of those.
"""

from __future__ import annotations

import torch

import hf_qattn
from hf_qattn.quant import quantize_int, smoothing_center


def make_input(seed: int = 0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 512, 64) for _ in range(3))
    k[..., ::2, 5] = 6e4
    k[..., 1::2, 5] = -6e4
    return tuple(t.half() for t in (q, k, v))


def cosine(out, ref) -> float:
    return float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))


def migrated(q, k, v, alpha: float):
    qf, kf = q.float(), k.float()
    k_range = (kf - kf.mean(2, keepdim=True)).abs().amax(2, keepdim=True)
    s = (k_range ** alpha / qf.abs().amax(2, keepdim=True) ** (1 - alpha)).clamp(min=1e-4)
    s = s / s.median(dim=-1, keepdim=True).values
    return hf_qattn.qattn(qf * s, kf / s, v.float(), sm_scale=q.shape[-1] ** -0.5)


def split_outliers(q, k, v, ratio: float = 16.0):
    qf, kf, vf = q.float(), k.float(), v.float()
    scale = q.shape[-1] ** -0.5
    channel_range = (kf - kf.mean(2, keepdim=True)).abs().amax(2)  # (B, H, D)
    outlier = channel_range > ratio * channel_range.median(-1, keepdim=True).values
    keep = ~outlier[:, :, None, :]
    exact = torch.einsum("bhnd,bhmd->bhnm", qf * ~keep, kf * ~keep) * scale
    qz, kz = qf * keep, kf * keep
    q_bar, k_bar = smoothing_center(qz), smoothing_center(kz)
    qs, ks = qz - q_bar[:, :, None], kz - k_bar[:, :, None]
    q_hat, q_scale = quantize_int(qs, 127.0, 1)
    k_hat, k_scale = quantize_int(ks, 127.0, 128)
    scores = (q_hat @ k_hat.transpose(-1, -2)) * q_scale[..., None] * k_scale[..., None, :] * scale
    scores = scores + (q_bar[:, :, None] @ ks.transpose(-1, -2)) * scale + exact
    return torch.softmax(scores, -1) @ vf, int(outlier.sum())


def main():
    q, k, v = make_input()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    print(f"qattn-8b as shipped:                 cos {cosine(hf_qattn.qattn(q, k, v), ref):.4f}")
    for alpha in (0.5, 0.75, 1.0):
        print(f"K→Q channel scale migration α={alpha:<4}: cos {cosine(migrated(q, k, v, alpha), ref):.4f}")
    print(f"qattn-8b, split_channel=True:         cos {cosine(hf_qattn.qattn(q, k, v, split_channel=True), ref):.4f}")
    out, count = split_outliers(q, k, v)
    print(f"outlier channel split out ({count} channel-heads), INT8 rest: cos {cosine(out, ref):.4f}")


if __name__ == "__main__":
    main()
