"""Synthetic Q, K, V with the channel-wise outliers of real attention inputs (shared by the eval scripts).

Recipe, per head (state it wherever the numbers are reported):
  * every channel c has its own spread σ_c ~ LogNormal(0, 0.5) and a shared offset μ_c ~ N(0, 1);
  * K: 4 outlier channels carry an offset of ±U(8, 16) shared by all tokens — the channel bias
    that makes per-block INT quantization of K fail without smoothing;
  * Q: 4 outlier channels of its own carry ±U(4, 8), and Q is scaled by 2 so attention is peaked
    rather than near-uniform;
  * V: offsets μ_c·2 (a mean that smoothing V removes), spreads as above.
Tokens are i.i.d. N(μ, σ²) per channel. Deterministic for a given ``seed`` (and ``draw_on``).
"""

from __future__ import annotations

import torch


def outlier_qkv(batch, heads, tokens, head_dim, *, kv_heads=None, seed=0, dtype=torch.float16, device="cpu",
                draw_on=None):
    """(q, k, v) in HND. ``draw_on``: a device to draw the per-token noise on, with its own generator (a 128k-token
    tensor drawn on the CPU takes seconds); the per-head parameters are drawn on the CPU either way. Default: all on
    the CPU, one generator (the inputs of the results recorded so far)."""
    kv_heads = kv_heads or heads
    gen = torch.Generator().manual_seed(seed)
    noise = None if draw_on is None else torch.Generator(device=draw_on).manual_seed(seed)

    def tensor(h, offset_scale, outliers=None):
        sigma = torch.exp(0.5 * torch.randn(h, 1, head_dim, generator=gen))
        mu = offset_scale * torch.randn(h, 1, head_dim, generator=gen)
        if outliers is not None:
            (lo, hi), first = outliers
            for head in range(h):
                channels = torch.randperm(head_dim, generator=gen)[first:first + 4]
                sign = torch.where(torch.rand(4, generator=gen) < 0.5, -1.0, 1.0)
                mu[head, 0, channels] = sign * (lo + (hi - lo) * torch.rand(4, generator=gen))
        if noise is None:
            return mu + sigma * torch.randn(batch, h, tokens, head_dim, generator=gen)
        x = torch.randn(batch, h, tokens, head_dim, generator=noise, device=draw_on, dtype=torch.float32)
        return x.mul_(sigma.to(draw_on)).add_(mu.to(draw_on))

    q = 2.0 * tensor(heads, 1.0, ((4.0, 8.0), 4))
    k = tensor(kv_heads, 1.0, ((8.0, 16.0), 0))
    v = tensor(kv_heads, 2.0)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))
