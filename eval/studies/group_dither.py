"""Study: why the int8g cache's error grew with the number of cached keys, and the dither that stops it (CPU).

    python eval/studies/group_dither.py [LENGTHS]        (default 4096,131072; from the repository root)

Inputs as eval/accuracy_length.py's zero-mean-V case (B1 H4 d128 bf16, K with channel offsets, seed = length, on
the CPU); the last 64 rows as causal queries; reference: float64 attention over the unquantized K and V. Each
row quantizes K or V (or both) per channel over 64-token groups at 8 bits around the channel mean, as the cache
does, in one of these ways, and reports the RelL1 of the output and the per-channel mean of V's rounding error
over all tokens (its rms; independent errors would give std / √N):
  * shipped: ``kv_cache.reference.quantize_groups(·, "int8g")`` (bf16 zero and scale, directed, and the
    dither of ``formats.KV_GROUP_DITHERED``);
  * undithered: the same without the dither (the format before it);
  * float32 parameters: zero and scale kept in float32, no dither.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/
import accuracy_length  # noqa: E402
from hf_qattn.kv_cache import reference  # noqa: E402

G = reference.GROUP


def _bf16(x, up):
    return reference._bf16_toward(x, up=up).float()


def quantized(x: torch.Tensor, way: str) -> torch.Tensor:
    """x (B, H, N, D) float64 → x quantized and read back (float64), per channel over groups of G tokens."""
    center = x.mean(2, keepdim=True)
    xc = (x - center).float()
    if way == "shipped":
        u, params = reference.quantize_groups(xc, "int8g")
        return reference.dequantize_groups(u, params, torch.float64, "int8g") + center
    b, h, n, d = xc.shape
    g = xc.reshape(b, h, n // G, G, d)
    low, high = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
    if way == "undithered":
        zero = _bf16(low, False)
        scale = _bf16((high - zero) / 255, True)
    else:  # float32 parameters
        zero, scale = low, (high - low) / 255
    u = torch.round((g - zero) / scale).clamp(0, 255)
    return (u * scale + zero).double().reshape(b, h, n, d) + center


def main(lengths: str = "4096,131072") -> None:
    torch.set_num_threads(2)
    print("| N | quantized | way | RelL1 | V's per-channel mean error, rms (independent: std/√N) |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in lengths.split(",")):
        q, k, v = accuracy_length.inputs(n, "v-zero", device="cpu")
        rows = torch.arange(n - 64, n)
        qf, kf, vf = q[:, :, rows].double(), k.double(), v.double()
        mask = torch.arange(n)[None, :] <= rows[:, None]

        def attend(keys, values):
            scores = (qf @ keys.transpose(-1, -2)) / qf.shape[-1] ** 0.5
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values

        ref = attend(kf, vf)
        for way in ("shipped", "undithered", "float32 parameters"):
            kq, vq = quantized(kf, way), quantized(vf, way)
            err = vq - vf
            bias = f"{err.mean(2).pow(2).mean().sqrt().item():.2e} ({err.std().item() / n ** 0.5:.2e})"
            for what, keys, values in (("K", kq, vf), ("V", kf, vq), ("K and V", kq, vq)):
                out = attend(keys, values)
                rel = ((out - ref).abs().sum() / ref.abs().sum()).item()
                print(f"| {n} | {what} | {way} | {rel:.4f} | {bias if what == 'V' else ''} |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
