"""The one mask analysis both integrations use (hf_qattn.masks): exact or refused, never approximate."""

from __future__ import annotations

import pytest
import torch

from hf_qattn import masks
from hf_qattn.masks import MaskPattern, analyse_mask, cached_analysis, visible_keys


def _rebuilt(pattern: MaskPattern, batch: int, nq: int, nk: int) -> torch.Tensor:
    """The (batch, Nq, Nk) visibility a pattern stands for, keys past kv_len hidden."""
    pattern = pattern.for_batch(batch)
    full = torch.zeros(batch, nq, nk, dtype=torch.bool)
    full[..., : pattern.kv_len] = visible_keys(batch, nq, pattern.kv_len, is_causal=pattern.causal,
                                               kv_start=pattern.kv_start, kv_end=pattern.kv_end)[:, 0]
    return full


@pytest.mark.parametrize("additive", [False, True])
def test_recovers_every_kernel_pattern(additive, seed):
    for trial in range(40):
        batch, nq = int(torch.randint(1, 4, ())), int(torch.randint(1, 12, ()))
        nk = nq + int(torch.randint(0, 6, ()))
        causal = bool(torch.randint(0, 2, ()))
        start = torch.randint(0, nk, (batch,))
        end = torch.maximum(start + 1, torch.randint(1, nk + 1, (batch,)))
        mask = visible_keys(batch, nq, nk, is_causal=causal, kv_start=start, kv_end=end)
        if not mask.flatten(1).any(dim=1).all():
            continue
        given = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if additive else mask
        pattern = analyse_mask(given, batch, 3, nq, nk)
        assert isinstance(pattern, MaskPattern), (trial, pattern, causal, start, end, nq, nk)
        assert torch.equal(_rebuilt(pattern, batch, nq, nk), mask[:, 0])


@pytest.mark.parametrize("make_mask,expected", [
    # key padding as diffusers pipelines build it: (B, 1, 1, Nk) bool, additive -inf / -1e4 (bf16)
    (lambda: torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool).view(2, 1, 1, 5),
     (False, 5, [0, 1], [3, 5])),
    (lambda: torch.tensor([[0.0, 0.0, -float("inf"), -float("inf"), -float("inf")],
                           [0.0] * 5]).view(2, 1, 1, 5), (False, 5, None, [2, 5])),
    (lambda: (1 - torch.tensor([[1, 1, 1, 1, 0]] * 2, dtype=torch.float32)).mul(-10000.0)[:, None, :]
     .to(torch.bfloat16), (False, 4, None, None)),  # the last key hidden everywhere: cut off
    (lambda: torch.ones(2, 2, 3, 5, dtype=torch.bool), (False, 5, None, None)),
    # SDPA's top-left causal mask on 3 queries × 5 keys is bottom-right causal over the first 3 keys
    (lambda: torch.ones(3, 5, dtype=torch.bool).tril(), (True, 3, None, None)),
    (lambda: torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool), masks.REASON_PATTERN),
    (lambda: torch.stack([torch.ones(5, dtype=torch.bool), torch.arange(5) < 3]).view(1, 2, 1, 5),
     "differs between heads"),
    (lambda: torch.zeros(2, 1, 1, 5, dtype=torch.bool), "hides every key"),
    (lambda: torch.randn(2, 1, 1, 5), "adds a bias"),
    (lambda: torch.ones(2, 1, 1, 4, dtype=torch.bool), "does not broadcast"),
    (lambda: torch.ones(2, 1, 1, 5, dtype=torch.int64), "dtype"),
])
def test_recognition_and_reasons(make_mask, expected):
    found = analyse_mask(make_mask(), batch=2, heads=2, nq=3, nk=5)
    if isinstance(expected, str):
        assert isinstance(found, str) and expected in found
        return
    causal, kv_len, start, end = expected
    assert isinstance(found, MaskPattern) and (found.causal, found.kv_len) == (causal, kv_len)
    assert (found.kv_start.tolist() if found.kv_start is not None else None) == start
    assert (found.kv_end.tolist() if found.kv_end is not None else None) == end


def test_rejects_other_patterns(seed):
    n = 10
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    window = ((cols <= rows) & (cols > rows - 3))[None, None]
    assert analyse_mask(window, 1, 1, n, n) == masks.REASON_PATTERN
    random_mask = torch.rand(2, 1, n, n) > 0.5
    random_mask[..., 0] = True
    assert analyse_mask(random_mask, 2, 1, n, n) == masks.REASON_PATTERN
    per_head = torch.ones(1, 2, n, n, dtype=torch.bool)
    per_head[0, 1, :, 0] = False
    assert "differs between heads" in analyse_mask(per_head, 1, 2, n, n)


def test_analysis_cached_per_tensor_and_version(monkeypatch):
    calls = []
    real = masks.analyse_mask
    monkeypatch.setattr(masks, "analyse_mask", lambda *a: calls.append(1) or real(*a))
    mask = visible_keys(2, 6, 6, is_causal=True, kv_start=torch.tensor([0, 2]))
    first = cached_analysis(mask, 2, 4, 6, 6)
    assert cached_analysis(mask, 2, 4, 6, 6) is first and len(calls) == 1
    cached_analysis(mask, 2, 1, 6, 6)  # other shapes: analysed again
    assert len(calls) == 2
    mask[1, 0, :, 2] = False  # in-place change: the cached answer must not be reused
    assert cached_analysis(mask, 2, 4, 6, 6).kv_start.tolist() == [0, 3] and len(calls) == 3
