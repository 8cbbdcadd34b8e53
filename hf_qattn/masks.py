"""Which keys each query sees — the one masking rule the kernels, the reference and the fallback share.

A query row ``i`` of sequence ``b`` sees key ``j`` when

    kv_start[b] <= j < kv_end[b]                      (per-sequence key range: left/right padding)
    and (not causal or j <= i + (Nk - Nq))            (causal, aligned bottom-right like FlashAttention)

``kv_start`` / ``kv_end`` are optional int tensors of shape (batch,); absent means 0 / Nk. A row
that sees no key at all produces zeros (and log-sum-exp −inf), as in FlashAttention.
"""

from __future__ import annotations

import torch


def visible_keys(
    batch: int,
    nq: int,
    nk: int,
    *,
    is_causal: bool,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean mask (batch, 1, Nq, Nk), True where the key takes part."""
    cols = torch.arange(nk, device=device)
    mask = torch.ones(batch, 1, nq, nk, dtype=torch.bool, device=device)
    if is_causal:
        rows = torch.arange(nq, device=device)
        mask &= (cols[None, :] <= rows[:, None] + (nk - nq))[None, None]
    if kv_start is not None:
        mask &= (cols[None, :] >= kv_start.to(device).view(-1, 1)).view(batch, 1, 1, nk)
    if kv_end is not None:
        mask &= (cols[None, :] < kv_end.to(device).view(-1, 1)).view(batch, 1, 1, nk)
    return mask
