"""Which keys each query sees — the one masking rule the kernels, the reference and the fallback share,
and the one analysis that turns an attention mask into that rule (for both integrations).

A query row ``i`` of sequence ``b`` sees key ``j`` when

    j < kv_len                                        (keys past kv_len are dropped: e.g. empty static-cache slots)
    and kv_start[b] <= j < kv_end[b]                  (per-sequence key range: left/right padding)
    and (not causal or j <= i + (kv_len - Nq))        (causal, aligned bottom-right like FlashAttention)

``kv_start`` / ``kv_end`` are optional int tensors of shape (batch,); absent means 0 / kv_len. A row
that sees no key at all produces zeros (and log-sum-exp −inf), as in FlashAttention.

A causal pattern may narrow that further by a sliding ``window`` or a ``chunk`` (qattn's keywords, their
rule in :func:`visible_keys`): the analysis takes them as the caller's candidates (what
the model says its layer does) and keeps them only where the mask needs them, after checking it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# An additive mask entry at or below this hides its key: exp(-5000 + score range) underflows to 0
# in float32 for any realistic score range, so -1e4 (the old diffusers convention, -9984 in bf16),
# finfo.min and -inf all count as "hidden"; any other non-zero value is a bias the kernels lack.
HIDDEN_BELOW = -5.0e3

REASON_PATTERN = "attention mask pattern other than causal + per-sequence key range"


def visible_keys(
    batch: int,
    nq: int,
    nk: int,
    *,
    is_causal: bool,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean mask (batch, 1, Nq, Nk), True where the key takes part: the one statement of qattn's key rules.

    Query row i sits at key position p = i + Nk − Nq (bottom-right). Causal: keys j ≤ p. ``window`` W: keys
    j > p − W; ``chunk`` C: keys with j // C == p // C (both need ``is_causal``, which :func:`hf_qattn.qattn`
    checks; together: both rules). ``kv_start`` / ``kv_end``: sequence b sees keys [start, end)."""
    cols = torch.arange(nk, device=device)
    mask = torch.ones(batch, 1, nq, nk, dtype=torch.bool, device=device)
    p = torch.arange(nq, device=device)[:, None] + (nk - nq)
    if is_causal:
        mask &= (cols[None, :] <= p)[None, None]
    if window is not None:
        mask &= (cols[None, :] > p - window)[None, None]
    if chunk is not None:
        mask &= (torch.div(cols[None, :], chunk, rounding_mode="floor")
                 == torch.div(p, chunk, rounding_mode="floor"))[None, None]
    if kv_start is not None:
        mask &= (cols[None, :] >= kv_start.to(device).view(-1, 1)).view(batch, 1, 1, nk)
    if kv_end is not None:
        mask &= (cols[None, :] < kv_end.to(device).view(-1, 1)).view(batch, 1, 1, nk)
    return mask


@dataclass(frozen=True)
class MaskPattern:
    """What the kernels need to reproduce a mask: keys [0, kv_len), ``causal``, per-sequence ranges, and on
    causal patterns a sliding ``window`` or a ``chunk`` where the mask is narrower than causal ∧ range.

    ``chunk_shift`` (an int tensor (batch,), or None): chunks that do not start at key 0 of the call —
    transformers starts a left-padded sequence's chunks at its first token, and a multi-token step over a
    cache at the cache's offset. Sequence b's chunks start where key index + chunk_shift[b] is a multiple
    of ``chunk``; :meth:`realigned` moves its tokens so that qattn's chunks (counted from key 0) are those.
    """

    causal: bool
    kv_len: int
    kv_start: torch.Tensor | None = None
    kv_end: torch.Tensor | None = None
    window: int | None = None
    chunk: int | None = None
    chunk_shift: torch.Tensor | None = None

    def for_batch(self, batch: int) -> "MaskPattern":
        """The pattern of a batch-1 mask broadcast over ``batch`` sequences."""
        def grow(t):
            return t if t is None or t.shape[0] == batch else t.expand(batch).contiguous()

        return MaskPattern(self.causal, self.kv_len, grow(self.kv_start), grow(self.kv_end), self.window, self.chunk,
                           grow(self.chunk_shift))

    def realigned(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """(query, key, value, pattern, undo) for a pattern with a ``chunk_shift``, (B, H, N, D) tensors with
        ``kv_len`` keys: sequence b's queries and keys moved ``chunk_shift[b]`` slots later in zero-filled
        buffers ``max(chunk_shift)`` tokens longer, so its chunks start at multiples of ``chunk`` as qattn
        counts them. Positions stay aligned bottom-right (both lengths grow alike), the new key range hides
        the filler, and ``undo(out)`` takes the (B, Hq, Nq + extra, D) output's real rows back."""
        shift = self.chunk_shift.to(device=query.device, dtype=torch.long)
        extra = int(shift.max())

        def place(t):
            b, h, n, d = t.shape
            index = (torch.arange(n, device=t.device) + shift[:, None]).view(b, 1, n, 1).expand(b, h, n, d)
            return t.new_zeros(b, h, n + extra, d).scatter_(2, index, t), index

        (query, rows), (key, _), (value, _) = place(query), place(key), place(value)
        start = shift if self.kv_start is None else self.kv_start.to(shift) + shift
        end = (self.kv_len if self.kv_end is None else self.kv_end.to(shift)) + shift
        pattern = MaskPattern(self.causal, self.kv_len + extra, start.to(torch.int32), end.to(torch.int32),
                              self.window, self.chunk)
        return query, key, value, pattern, lambda out: out.gather(2, rows)

    def keys(self, key: torch.Tensor, value: torch.Tensor, token_dim: int = 2):
        """key and value cut to the first ``kv_len`` tokens (views)."""
        if key.shape[token_dim] == self.kv_len:
            return key, value
        return key.narrow(token_dim, 0, self.kv_len), value.narrow(token_dim, 0, self.kv_len)

    def qattn_options(self) -> dict:
        return dict(is_causal=self.causal, kv_start=self.kv_start, kv_end=self.kv_end, window=self.window,
                    chunk=self.chunk)


def analyse_mask(mask: torch.Tensor, batch: int, heads: int, nq: int, nk: int, window: int | None = None,
                 chunk: int | None = None) -> MaskPattern | str:
    """Express an attention mask as causal ∧ key range (a :class:`MaskPattern`), or say why it is not one.

    ``window`` / ``chunk``: the sliding window or chunk the caller's layer uses (e.g. transformers'
    ``sliding_window``), or None. A causal pattern then also tries causal ∧ range ∧ that rule, and takes
    it (the pattern's ``window`` / ``chunk`` set) only where the plain one does not reproduce the mask:
    a prompt shorter than the window needs none. A mask of another rule (a bidirectional window, chunks
    that start elsewhere than at key 0) is refused like any other.

    ``mask`` broadcasts to (batch, heads, Nq, Nk): bool keeps True; floating point is additive, keeps 0
    and hides values ≤ ``HIDDEN_BELOW``. The pattern is checked against :func:`visible_keys` element
    for element, so it is only ever returned when it reproduces the mask exactly. Its ranges have one
    row per mask row (1 or ``batch``): :meth:`MaskPattern.for_batch` widens them.
    """
    try:
        full_shape = torch.broadcast_shapes(tuple(mask.shape), (batch, heads, nq, nk))
    except RuntimeError:
        full_shape = None
    if mask.dim() > 4 or full_shape != (batch, heads, nq, nk):
        return f"attention mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Nq, Nk)"
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        if not bool((visible | (mask <= HIDDEN_BELOW)).all()):
            return "attention mask adds a bias (values other than 0 and -inf)"
    else:
        return f"attention mask of dtype {mask.dtype}"
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
    if visible.shape[1] != 1:
        if not torch.equal(visible, visible[:, :1].expand_as(visible)):
            return "attention mask differs between heads"
    grid = visible[:, 0].expand(visible.shape[0], nq, nk)  # (1 or B, Nq, Nk)
    rows = grid.shape[0]
    seen = grid.any(dim=1)  # (rows, Nk): keys some query sees
    if not bool(seen.any(dim=-1).all()):
        return "attention mask hides every key of a sequence"
    cols = torch.arange(nk, device=mask.device)
    kv_start = torch.where(seen, cols, nk).amin(dim=-1)
    kv_end = torch.where(seen, cols + 1, 0).amax(dim=-1)
    max_end = int(kv_end.max())
    # Causal: the diagonal sits where the last key of a row minus its index peaks (a row cut by
    # kv_end only lowers it), so the key length that aligns it bottom-right is nq + that offset.
    last = torch.where(grid, cols, -1).amax(dim=-1)
    offset = (last - torch.arange(nq, device=mask.device)).masked_fill(last < 0, -nk - nq).max()
    candidates = [(False, max_end), (True, nq + int(offset))]
    spans = [(None, None)] + ([(window, chunk)] if window is not None or chunk is not None else [])
    for causal, kv_len in candidates:  # non-causal first: with one query row both read the same
        if not max_end <= kv_len <= nk or (causal and nq > kv_len):
            continue
        start = None if bool((kv_start == 0).all()) else kv_start.to(torch.int32)
        end = None if bool((kv_end == kv_len).all()) else kv_end.to(torch.int32)
        if grid[..., kv_len:].any():
            continue
        for rule_window, rule_chunk in spans if causal else spans[:1]:  # plain first: a variant only where needed
            candidate = visible_keys(rows, nq, kv_len, is_causal=causal, kv_start=start, kv_end=end,
                                              window=rule_window, chunk=rule_chunk, device=mask.device)[:, 0]
            if torch.equal(candidate, grid[..., :kv_len]):
                return MaskPattern(causal, kv_len, start, end, rule_window, rule_chunk)
        if causal and chunk is not None:
            shift = _chunk_shift(grid[..., :kv_len], kv_start, chunk)
            if bool((shift != 0).any()) and torch.equal(
                    _shifted_chunk_keys(nq, kv_len, start, end, window, chunk, shift), grid[..., :kv_len]):
                return MaskPattern(causal, kv_len, start, end, window, chunk, shift.to(torch.int32))
    return REASON_PATTERN


def _chunk_shift(grid: torch.Tensor, kv_start: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per mask row, the shift s with chunks starting where key + s is a multiple of ``chunk``, read off a
    chunk start the rows show (a query's first visible key past the sequence's first key); 0 where none
    shows. A guess: the caller checks it against the whole mask."""
    nk = grid.shape[-1]
    first = torch.where(grid, torch.arange(nk, device=grid.device), nk).amin(dim=-1)  # (rows, Nq); nk: sees none
    boundary = torch.where((first > kv_start[:, None]) & (first < nk), first, -1).amax(dim=-1)
    return torch.where(boundary >= 0, (-boundary) % chunk, 0)


def _shifted_chunk_keys(nq, kv_len, kv_start, kv_end, window, chunk, shift) -> torch.Tensor:
    """(rows, Nq, kv_len): causal ∧ range ∧ window ∧ chunks whose starts are shifted per row, through the
    rule itself (each row's keys and queries moved ``shift`` slots later, as :meth:`MaskPattern.realigned`
    moves them for qattn)."""
    out = []
    for row, s in enumerate(shift.tolist()):
        start = (0 if kv_start is None else int(kv_start[row])) + s
        end = (kv_len if kv_end is None else int(kv_end[row])) + s
        grid = visible_keys(1, nq, kv_len + s, is_causal=True, kv_start=torch.tensor([start]),
                                     kv_end=torch.tensor([end]), window=window, chunk=chunk,
                                     device=shift.device)[0, 0]
        out.append(grid[:, s:])
    return torch.stack(out)


def cached_analysis(mask: torch.Tensor, batch: int, heads: int, nq: int, nk: int, window: int | None = None,
                    chunk: int | None = None) -> MaskPattern | str:
    """:func:`analyse_mask`, remembered on the mask tensor: a model passes the same mask to every layer,
    and the analysis costs device synchronisations. The answer is reused for the same shapes at the
    same version counter (an in-place change is seen); inference-mode tensors keep no version counter
    and are analysed afresh at every call."""
    if mask.is_inference():
        return analyse_mask(mask, batch, heads, nq, nk, window, chunk)
    key = (mask._version, batch, heads, nq, nk, window, chunk)
    cached = getattr(mask, "_qattn_pattern", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = analyse_mask(mask, batch, heads, nq, nk, window, chunk)
    try:
        mask._qattn_pattern = (key, found)
    except (AttributeError, RuntimeError):  # tensor subclasses that refuse attributes: analyse again next time
        pass
    return found
