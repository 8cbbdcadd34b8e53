"""The quantized-cache kernels (kernels/decode.py) against float64 references.

Two yardsticks per case:
- attention in float64 over the very same quantized storage (``hf_qattn.kv_cache.reference.decode_attention``):
  the kernel may differ only by its fp16 rounding of q̂ and of P·δV (and bf16 in the INT4 tile) and the output dtype's;
- exact float64 attention over the unquantized K/V: the quantization error of the cache format.
Mutated copies of the kernel (diagonal moved, v̄ dropped, splits merged without their weights)
must fail the first check — that is what makes its tolerance meaningful.

On a GPU the launch's key tile is 64 tokens: tests that want several splits of these short caches pass
``block_n=16`` (INT8; the grouped formats, INT4 K and int8g K and V, are read a 64-token group a tile).
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from hf_qattn import reference  # noqa: E402
from hf_qattn.kv_cache import reference as kv_reference  # noqa: E402
from hf_qattn.kernels import decode, decode_launch, tuning  # noqa: E402
from mutants import mutant_module  # noqa: E402  (tests/mutants.py)
from hf_qattn.calibration.metrics import accuracy  # noqa: E402

if not (torch.cuda.is_available() or tuning.interpreting()):
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def outlier_kv(b, hk, n, d):
    """K with large per-channel offsets (what smoothing is for), V with milder ones; in both, channels whose
    spreads differ by up to ~10× (what the per-token formats' equalizers are for)."""
    k = torch.randn(b, hk, n, d) * torch.randn(1, hk, 1, d).mul(0.6).exp() + 6.0 * torch.randn(1, hk, 1, d)
    v = torch.randn(b, hk, n, d) * torch.randn(1, hk, 1, d).mul(0.6).exp() + 1.5 * torch.randn(1, hk, 1, d)
    return k.to(DEVICE), v.to(DEVICE)


def fill(k, v, precision, capacity=None):
    """Storage buffers (slack past the tokens, as in a growing cache; INT4: whole groups) holding garbage, then
    filled by the append kernel, the centers and equalizers fixed by these tokens (as a cache's first fill)."""
    b, hk, n, d = k.shape
    k_bar, v_bar = kv_reference.centers(k, v)
    buf = kv_reference.allocate(b, hk, capacity or n + 5, d, precision, DEVICE, k.dtype)
    if n:
        kv_reference.set_equalizers(buf, k, v, k_bar, v_bar)
    buf.kq.fill_(99)  # garbage past the tokens
    buf.ks.fill_(1e6)
    buf.vq.fill_(200)  # uint8 in every format
    buf.vs.fill_(1e6)
    for recent in (buf.k_recent, buf.v_recent):
        if recent is not None:
            recent.fill_(1e6)
    decode_launch.append(k, v, k_bar, v_bar, buf, 0)
    return dict(buf=buf, k_bar=k_bar, v_bar=v_bar)


def tiles(precision: str) -> dict:
    """16-key tiles, so that short caches make several splits on a GPU too; grouped formats read their 64-token
    groups."""
    return {"block_n": 16} if precision == "int8" else {}


def mismatch(out, ref) -> str | None:
    """Why the kernel's output is not the float64 result over the same storage, or None."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return "non-finite output"
    scale = ref.abs().max().clamp_min(1e-6)
    tol = (3e-3 + 2 * torch.finfo(torch.float16 if out.dtype == torch.float32 else torch.bfloat16).eps) * scale
    diff = (out - ref).abs().max()
    if diff > tol:
        return f"max |kernel − reference| = {diff:.4g} > {tol:.4g}"
    return None


# (b, hq, hk, nq, nk, d, dtype, precision, kv range, splits) — nk never a multiple of the 16-token tile
CASES = [
    (2, 4, 4, 1, 37, 64, torch.bfloat16, "int8", False, None),   # MHA, one query
    (1, 8, 2, 1, 70, 64, torch.float16, "int4", False, 3),       # GQA 4, INT4
    (2, 8, 1, 1, 45, 32, torch.bfloat16, "int8", True, None),    # MQA 8, left padding
    (1, 8, 1, 4, 53, 64, torch.float16, "int8", False, 1),       # GQA 8, q_len 4, one split
    (2, 4, 1, 7, 61, 40, torch.float32, "int4", True, None),     # head dim padded, ranges, INT4
    (1, 4, 1, 16, 33, 32, torch.bfloat16, "int8", False, 2),     # q_len 16: several query chunks
    (2, 6, 2, 3, 90, 64, torch.bfloat16, "int4", True, 4),       # GQA 3, several splits
    (1, 2, 2, 2, 19, 128, torch.float16, "int8", False, None),   # d128
    (1, 16, 2, 11, 29, 32, torch.bfloat16, "int4", False, 2),    # GQA 8 · q_len 11 → query chunks
    (2, 8, 2, 2, 200, 64, torch.bfloat16, "int4", True, 3),      # INT4: 3 groups and 8 recent tokens, 3 splits
    (1, 8, 2, 1, 200, 64, torch.bfloat16, "int8g", True, 3),     # 8-bit K and V groups: 3 groups, 8 recent, splits
    (2, 4, 4, 3, 70, 128, torch.float16, "int8g", False, None),  # d128, a group and 6 recent tokens, 3 queries
    (2, 4, 1, 7, 61, 40, torch.float32, "int8g", True, 2),       # head dim padded, only recent tokens
    (1, 8, 2, 1, 150, 64, torch.bfloat16, "int8", True, 6),      # five splits of ten tiles: the merge, 4 a step, twice
]


def _id(case):
    b, hq, hk, nq, nk, d, dtype, prec, rng, splits = case
    return f"b{b}-hq{hq}-hk{hk}-nq{nq}-nk{nk}-d{d}-{str(dtype)[6:]}-{prec}{'-range' if rng else ''}-s{splits}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_matches_float64(seed, case):
    b, hq, hk, nq, nk, d, dtype, precision, ranged, splits = case
    k, v = outlier_kv(b, hk, nk, d)
    q = (torch.randn(b, hq, nq, d) + 2.0 * torch.randn(1, hq, 1, d)).to(DEVICE, dtype)
    st = fill(k, v, precision)
    kv_start = kv_end = None
    if ranged:  # left padding of a random length per sequence, and a shortened end for one of them
        kv_start = torch.randint(0, nk // 2, (b,), device=DEVICE)
        kv_end = torch.full((b,), nk, device=DEVICE)
        kv_end[-1] = nk - 3
    tile = tiles(precision) if splits and splits > 1 else {}  # several splits on a GPU too
    out = decode_launch.decode(q, st["buf"], st["v_bar"], nk,
                               causal=True, kv_start=kv_start, kv_end=kv_end, num_splits=splits, **tile)
    assert out.shape == (b, nq, hq, d) and out.dtype == dtype
    ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], nk, causal=True, kv_start=kv_start, kv_end=kv_end,
                                        group_q_round=decode_launch.group_q_rounding(DEVICE))
    assert mismatch(out, ref) is None, mismatch(out, ref)
    # against exact attention on the unquantized K/V: the error of the cache format itself
    exact = reference.exact_attention(q, k.to(dtype), v.to(dtype), is_causal=nq > 1, kv_start=kv_start,
                                      kv_end=kv_end).transpose(1, 2)
    rel = accuracy(out, exact).rel_l1
    assert rel < FORMAT_REL_L1[precision], rel


# The formats' own error, relative L1 against exact attention over these inputs: per-token INT8 K and FP8 V
# (FP8's 3 mantissa bits dominate), 4-bit K groups, 8-bit K and V groups (a step of a channel's range / 255).
FORMAT_REL_L1 = {"int8": 0.015, "int4": 0.1, "int8g": 0.015}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equalizers_keep_the_quiet_channels_of_outlier_heads(seed, dtype):
    """Per-token INT8 with a few outlier channels (spreads 30× the others', as LLMs' K and V have): the first fill's
    equalizers (formats.KV_EQ_FLOOR) leave the quiet channels their levels, so the cache's attention error against
    exact attention is well under what the same per-token format has without them (σ = 1), and the kernel matches
    the float64 reference over the equalized storage."""
    b, hk, hq, n, d = 2, 2, 8, 300, 64
    spread = torch.ones(1, hk, 1, d)
    spread[..., :4] = 30.0
    k = (torch.randn(b, hk, n, d) * spread + 5.0 * torch.randn(1, hk, 1, d)).to(DEVICE)
    v = (torch.randn(b, hk, n, d) * spread).to(DEVICE)
    q = torch.randn(b, hq, 1, d, device=DEVICE, dtype=dtype) * 0.5
    exact = reference.exact_attention(q, k.to(dtype), v.to(dtype)).transpose(1, 2)
    errors = {}
    for equalized in (True, False):
        st = fill(k, v, "int8")
        if not equalized:
            st["buf"].k_eq.fill_(1.0)
            st["buf"].v_eq.fill_(1.0)
            decode_launch.append(k, v, st["k_bar"], st["v_bar"], st["buf"], 0)
        out = decode_launch.decode(q, st["buf"], st["v_bar"], n)
        ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], n)
        assert mismatch(out, ref) is None, (equalized, mismatch(out, ref))
        errors[equalized] = accuracy(out, exact).rel_l1
    assert errors[True] < 0.5 * errors[False], errors


def test_rows_without_keys_are_zero(seed):
    """A causal query chunk longer than the sequence's visible keys: rows that see nothing are zeros, not NaN."""
    k, v = outlier_kv(1, 2, 20, 32)
    st = fill(k, v, "int8")
    q = torch.randn(1, 4, 6, 32, device=DEVICE)
    kv_start = torch.tensor([17], device=DEVICE)  # query i sees keys [17, 14 + i]: the first three rows see none
    out = decode_launch.decode(q, st["buf"], st["v_bar"], 20,
                               kv_start=kv_start, num_splits=2, block_n=16)
    assert torch.isfinite(out).all()
    assert (out[:, :3] == 0).all() and (out[:, 3:].abs().sum(-1) > 0).all()
    ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], 20, kv_start=kv_start)
    assert mismatch(out, ref) is None, mismatch(out, ref)


def test_bad_launch_arguments_and_storage_are_refused():
    """A key tile must lie inside one of per-token V's tiles (its V load has no key mask), grouped formats read a
    group a tile, and storage in another V layout is refused, not misread."""
    k, v = outlier_kv(1, 2, 20, 32)
    st = fill(k, v, "int8")
    q = torch.randn(1, 4, 1, 32, device=DEVICE)
    for block_n in (8, 128, 48):
        with pytest.raises(ValueError, match="block_n must be a power of two from 16 to 64"):
            decode_launch.decode(q, st["buf"], st["v_bar"], 20, block_n=block_n)
    token_major = st["buf"]._replace(vq=kv_reference.token_major(st["buf"].vq).flatten(2, 3))
    with pytest.raises(ValueError, match="channel-major tiles"):
        decode_launch.decode(q, token_major, st["v_bar"], 20)
    grouped = fill(k, v, "int4")
    with pytest.raises(ValueError, match="block_n must be the group"):
        decode_launch.decode(q, grouped["buf"], grouped["v_bar"], 20, block_n=16)


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_split_merge_matches_reference_call_after_call(seed, precision):
    """The splits merged in the decode launch (by the last split program to arrive) match the reference,
    and a second call gives the same bits: the arrival counters are left at zero for the next launch."""
    n = 75 if precision == "int8" else 300  # several tiles: 16 keys (INT8), 64 (grouped)
    k, v = outlier_kv(2, 2, n, 64)
    st = fill(k, v, precision)
    q = torch.randn(2, 8, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    args = (q, st["buf"], st["v_bar"], n)
    ref = kv_reference.decode_attention(*args)
    first = None
    for _ in range(2):
        out = decode_launch.decode(*args, num_splits=4, **tiles(precision))
        assert mismatch(out, ref) is None, mismatch(out, ref)
        assert not any(ws[3].any() for ws in decode_launch._WORKSPACE.values())
        if first is None:
            first = out
    assert torch.equal(out, first)


def test_split_merge_propagates_non_finite_query(seed):
    """A NaN query row stays NaN through the in-launch merge (``l != 0``, not ``l > 0``); other rows are finite."""
    import math

    k, v = outlier_kv(1, 2, 40, 32)
    st = fill(k, v, "int8")
    q = torch.randn(1, 4, 2, 32, device=DEVICE)
    q[0, 1, 0, 3] = math.nan
    out = decode_launch.decode(q, st["buf"], st["v_bar"], 40, num_splits=3,
                               block_n=16)
    assert torch.isnan(out[0, 0, 1]).all()
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(out[0, 0, 0]).all()


@pytest.mark.parametrize("resident", [4, 3, 2])
@pytest.mark.parametrize("b,hk,nq,nk", [(1, 8, 1, 1024), (8, 8, 1, 1024), (8, 8, 1, 65536), (1, 8, 1, 131072),
                                        (64, 8, 1, 4096), (1, 1, 1, 17), (4, 8, 16, 8191), (1, 1, 1, 131072),
                                        (2, 8, 1, 16384), (4, 8, 1, 65536), (16, 8, 1, 32768), (48, 8, 1, 8192)])
def test_split_count_fills_whole_rounds_of_resident_programs(b, hk, nq, nk, resident):
    """The split heuristic on a 132-SM GPU holding ``resident`` programs an SM: one split when B·Hk fills a round,
    else as many as whole rounds (WAVES) hold — never a round started by a few programs alone — and at least one
    program an SM where the keys allow; never more splits than key tiles, none empty."""
    sms, block_n = 132, 64
    cfg = tuning.decode_config(False)
    qt, chunks, splits, split_len = decode_launch._plan(b, hk, 4, nq, nk, sms, resident, False, block_n, None, None,
                                                        None)
    tiles = -(-nk // block_n)
    programs = chunks * b * hk
    slots = cfg["WAVES"] * sms * resident
    assert 1 <= splits <= tiles and split_len % block_n == 0
    assert (splits - 1) * split_len < nk  # no empty split
    assert splits == 1 or programs * splits <= slots
    # about one program per SM when L allows (splits are whole tiles: rounding may leave a few idle)
    assert programs * splits >= 0.9 * min(sms, programs * tiles)
    # the last split program merges splits one by one: no more than MAX_SPLITS unless the GPU needs them
    assert splits <= max(cfg["MAX_SPLITS"], -(-sms // programs))
    if (b, hk, nk, resident) == (8, 8, 65536, 4):  # H200 B8 INT8 64k: 8 splits one round, 17 ran three (see _plan)
        assert splits == 8


def test_resident_programs_follow_registers_and_shared_memory():
    """The split plan's programs an SM: 65,536 registers over (cap × threads), no cap counting 255 a thread, and the
    SM's shared memory over a program's (plus the driver's 1 KB), where known."""
    assert [decode_launch.resident_programs(cap, 4) for cap in (128, 168, 0)] == [4, 3, 2]
    assert decode_launch.resident_programs(128, 8) == 2
    assert decode_launch.resident_programs(0, 1) == 8
    assert decode_launch.resident_programs(0, 1, 50176) == 4  # one-warp INT8 d128: shared memory binds
    assert decode_launch.resident_programs(0, 2, 71680) == 3  # two-warp int8g d128
    assert decode_launch.resident_programs(168, 4, 37376) == 3  # registers bind


def test_tiles_of_many_rows_take_four_warps():
    """One warp a program serves a decode step's tile; a tile of 32 or 64 rows (8 or 16 query tokens of a GQA-4
    group) would hold its fp32 output in 128–256 registers a thread: kernels.json's BY_ROWS launches it on four
    warps and three stages (not the four / five of a step's one-warp tile at d128), uncapped at d128 and capped at
    d64 (where the plan counts programs by the cap); INT4 d128's 16-row tile on four warps at 168, INT8's on the
    step's one warp; past WIDE_ABOVE the wide launch whatever the rows."""
    assert decode_launch.tile_rows(4, 16, False) == (16, 64, False)
    options = decode_launch.kernel_options
    assert options("int8", 128, False, rows=8) == options("int8", 128, False, rows=16) == {"num_warps": 1,
                                                                                           "num_stages": 4}
    for rows in (32, 64):
        assert options("int8", 128, False, rows=rows) == options("int4", 128, False, rows=rows) == {
            "num_warps": 4, "num_stages": 3}
        assert options("int8", 64, False, rows=rows) == {"num_warps": 4, "num_stages": 3, "maxnreg": 128}
        assert options("int4", 64, False, rows=rows) == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert options("int4", 128, False, rows=16) == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert options("int4", 64, False, rows=16) == {"num_warps": 2, "maxnreg": 128}
    assert options("int8", 256, False, rows=64) == {"num_warps": 4}
    assert decode_launch._default_launch("int8", 128, False, 64)["MAX_SPLITS"] == 32


def test_few_query_rows_put_the_keys_on_the_dots_rows():
    """Tiles of at most KEYS_AS_ROWS_UP_TO query rows (GQA-4 and GQA-8 decode steps, two tokens of GQA-4) take the
    keys as the dots' rows, padded to 8 rows, in every format; more rows keep the query rows as the dots' rows,
    padded to 16."""
    for groups, nq, rows, keys in ((4, 1, 8, True), (8, 1, 8, True), (2, 1, 8, True), (4, 2, 8, True),
                                   (4, 3, 16, False), (16, 1, 16, False), (4, 16, 64, False)):
        for precision in ("int8", "int4", "int8g"):
            _, plan = decode_launch.plan_decode(precision, (1, 8 * groups, nq, 128), 8, 4096, torch.device("cpu"))
            assert (plan["BLOCK_M"], plan["KEYS_AS_ROWS"]) == (rows, keys), (groups, nq, precision, plan)


@pytest.mark.parametrize("precision", ["int4", "int8g"])
@pytest.mark.parametrize("nq,causal", [(1, False), (2, True)])
def test_grouped_tiles_with_the_keys_as_rows_match_the_reference(seed, precision, nq, causal):
    """The grouped formats' tiles with the keys as the dots' rows against the reference: whole groups, the
    incomplete group's recent tokens, the split merge, a causal diagonal over two query tokens."""
    k, v = outlier_kv(2, 2, 141, 64)
    st = fill(k, v, precision)
    q = torch.randn(2, 8, nq, 64, device=DEVICE, dtype=k.dtype)
    _, plan = decode_launch.plan_decode(precision, q.shape, 2, 141, q.device)
    assert plan["KEYS_AS_ROWS"] and plan["BLOCK_M"] == 8
    for splits in (1, 2):
        out = decode_launch.decode(q, st["buf"], st["v_bar"], 141, causal=causal, num_splits=splits)
        ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], 141, causal=causal)
        assert mismatch(out, ref) is None, (splits, mismatch(out, ref))


def test_a_formats_launch_can_change_at_one_head_dim():
    """kernels.json's BY_HEAD_DIM: INT4 runs two warps at head dim 64 (and 33–64, padded), one at 128; tiles of 32
    rows take four warps at any head dim (BY_ROWS)."""
    for d, warps in ((64, 2), (48, 2), (128, 1), (96, 1)):
        assert decode_launch.kernel_options("int4", d, False)["num_warps"] == warps, d
        assert decode_launch.kernel_options("int4", d, False, rows=32)["num_warps"] == 4, d
    assert decode_launch.kernel_options("int8", 64, False)["num_warps"] == 1


def test_the_plan_reads_the_shared_memory_of_the_models_float_width():
    """INT4's recent-token tile is kept in the model's floats, so a float32 model's INT4 program takes more shared
    memory (kernels.json's 32-bit row), and the plan counts the programs an SM holds from that row (at d128 four
    either way); INT8's and int8g's builds take the same bytes at both widths."""
    counts = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for precision in ("int8", "int4", "int8g"):
            options = decode_launch.kernel_options(precision, 128, False)
            shared = decode_launch.default_shared_bytes(precision, 128, False, dtype)
            assert shared > 0
            counts[dtype, precision] = decode_launch.resident_programs(options.get("maxnreg", 0), options["num_warps"],
                                                                       shared)
    width = {dtype: decode_launch.default_shared_bytes("int4", 128, False, dtype) for dtype in (torch.bfloat16,
                                                                                                torch.float32)}
    assert width[torch.float32] > width[torch.bfloat16]
    assert counts[torch.bfloat16, "int4"] == counts[torch.float16, "int4"] == counts[torch.float32, "int4"] == 4
    assert counts[torch.float32, "int8"] == counts[torch.bfloat16, "int8"] == 4
    assert counts[torch.float32, "int8g"] == counts[torch.bfloat16, "int8g"] == 4


def test_the_plan_counts_the_programs_of_the_tile_it_launches(monkeypatch):
    """A tile of more rows takes another launch (kernels.json's BY_ROWS) and more shared memory (SHARED by rows):
    INT4 d128's 16-row tile (four query tokens of a GQA-4 group, or a GQA-16 step) runs four warps at 168 registers,
    three programs an SM where the step's one-warp launch holds four; int8g d128's 32-row tile 62.5 KB, three where
    the step tile's 51.2 KB hold four. The plan counts three, so its splits fill whole rounds of the programs that
    fit (an H100's 132 SMs)."""
    monkeypatch.setattr(tuning, "sm_count", lambda index: 132)

    def resident(precision, nq, groups=4):
        options, plan = decode_launch.plan_decode(precision, (8, 8 * groups, nq, 128), 8, 65536,
                                                  torch.device("cuda", 0), interpreting=False)
        shared = decode_launch.default_shared_bytes(precision, 128, False, torch.bfloat16, plan["BLOCK_M"])
        return plan["BLOCK_M"], decode_launch.resident_programs(options.get("maxnreg", 0), options["num_warps"],
                                                                shared), plan["num_splits"]

    assert resident("int4", 1) == (8, 4, 8)  # 132 SMs × 4 over 64 (batch · kv head) programs: 8 splits, one round
    assert resident("int4", 4) == resident("int4", 1, groups=16) == (16, 3, 6)  # 132 × 3 over 64: 6 splits
    assert resident("int8g", 8) == (32, 3, 6)  # two warps: 4 by registers, 3 by shared memory


@pytest.mark.parametrize("width", ["16-bit", "32-bit"])
def test_default_launch_keeps_an_sms_schedulers_even(width):
    """The programs an SM holds by the plan's count (kernels.json's launch and SHARED, a decode step's 8-row tile)
    make a multiple of four warps: an SM's four schedulers each issue for the warps given to it, and a scheduler with
    one warp more than the others finishes its programs last (INT4 d128 with four one-warp programs an SM ran 14 %
    faster than with five; kernels/decode_launch.py's launch notes)."""
    cfg = tuning.decode_config(False)
    for precision, by_dim in cfg["SHARED"][width].items():
        for d, by_rows in by_dim.items():
            options = decode_launch.kernel_options(precision, int(d), False, rows=8)
            held = decode_launch.resident_programs(options.get("maxnreg", 0), options["num_warps"], by_rows["8"])
            assert held * options["num_warps"] % 4 == 0, (precision, d, options, held)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads the compiled GPU kernel")
@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nq", [1, 4, 8, 16], ids=["rows8", "rows16", "rows32", "rows64"])
def test_default_launch_holds_the_programs_its_plan_counts(seed, precision, d, dtype, nq):
    """The programs an SM holds by the compiled decode kernel's own registers and shared memory are the ones the
    split plan counts from kernels.json (``launch``, ``SHARED`` by the tile's rows: a step of a GQA-4 model, and
    4 / 8 / 16 query tokens a step) for a model of ``dtype`` (the recent-token tiles are kept in it): a Triton that
    builds the kernel larger would leave the plan's last round short of room."""
    from hf_qattn.kernels import fast_launch

    if not fast_launch.enabled():
        pytest.skip("the compiled kernel is read from the fast launcher's memo")
    k, v = outlier_kv(2, 2, 4096, d)
    st = fill(k.to(dtype), v.to(dtype), precision)  # a model's cache (recent tokens in its floats)
    q = torch.randn(2, 8, nq, d, device=DEVICE, dtype=dtype)
    memo = {}
    decode_launch.decode(q, st["buf"], st["v_bar"], 4096, launches=memo)
    options, plan = decode_launch.plan_decode(precision, q.shape, 2, 4096, q.device, cache_dtype=dtype)
    assert plan["num_splits"] > 1 and plan["BLOCK_M"] == {1: 8, 4: 16, 8: 32, 16: 64}[nq]
    (kernel, *_), = memo.values()
    regs = -(-kernel.n_regs // 8) * 8  # registers are given out in eights a thread
    held = decode_launch.resident_programs(regs, kernel.metadata.num_warps, kernel.metadata.shared)
    shared = decode_launch.default_shared_bytes(precision, d, False, dtype, plan["BLOCK_M"])
    listed = decode_launch.resident_programs(options.get("maxnreg", 0), options["num_warps"], shared)
    assert shared > 0 and held == listed, (kernel.n_regs, kernel.metadata.shared, shared)


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_token_count_read_from_device_memory(seed, precision):
    """A static cache's path: the append kernel takes its first slot, and the decode kernel the cached token
    count, from a device tensor (so a CUDA graph replays them as the cache grows). The storage is the one
    host-side positions write, bit for bit; decoding planned for the whole capacity reads only the first
    ``length`` tokens (the slots past them hold garbage: reading one would blow the result up), with the
    causal diagonal of several queries placed by the device count."""
    b, hk, hq, d, cap = 2, 2, 8, 64, 128
    k, v = outlier_kv(b, hk, 90, d)
    k_bar, v_bar = kv_reference.centers(k[:, :, :30], v[:, :, :30])
    stores = []
    for device_pos in (False, True):
        st = fill(k[:, :, :0], v[:, :, :0], precision, capacity=cap)  # garbage everywhere
        buf = st["buf"]
        kv_reference.set_equalizers(buf, k[:, :, :30], v[:, :, :30], k_bar, v_bar)
        length = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        for lo, hi in ((0, 30), (30, 31), (31, 50), (50, 64), (64, 65), (65, 90)):  # prefill, steps, chunks
            pos = length if device_pos else lo
            decode_launch.append(k[:, :, lo:hi], v[:, :, lo:hi], k_bar, v_bar, buf, pos)
            length.add_(hi - lo)
        stores.append(buf)
    for host, dev in zip(stores[0][1:], stores[1][1:]):  # every tensor of the two storages, bit for bit
        if host is not None:
            assert torch.equal(host.view(torch.int8), dev.view(torch.int8))
    for nq in (1, 4):
        q = torch.randn(b, hq, nq, d, device=DEVICE, dtype=torch.bfloat16)
        out = decode_launch.decode(q, stores[1], v_bar, cap, causal=True, length=length)
        ref = kv_reference.decode_attention(q, stores[1], v_bar, 90, causal=True)
        assert mismatch(out, ref) is None, (nq, mismatch(out, ref))


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_append_matches_reference_and_appends_in_place(seed, precision):
    """Appending in pieces (a prefill, single tokens, chunks; INT4 groups completed across appends) with the
    centers of the first equals the reference's appends; slots past the tokens stay untouched."""
    k, v = outlier_kv(2, 3, 141, 48)
    st = fill(k[:, :, :30], v[:, :, :30], precision, capacity=150)
    ref = kv_reference.allocate(2, 3, st["buf"].kq.shape[2], 48, precision, DEVICE, k.dtype)
    kv_reference.set_equalizers(ref, k[:, :, :30], v[:, :, :30], st["k_bar"], st["v_bar"])
    kv_reference.append(k[:, :, :30], v[:, :, :30], st["k_bar"], st["v_bar"], ref, 0)
    for lo, hi in ((30, 63), (63, 64), (64, 65), (65, 141)):
        decode_launch.append(k[:, :, lo:hi], v[:, :, lo:hi], st["k_bar"], st["v_bar"], st["buf"], lo)
        kv_reference.append(k[:, :, lo:hi], v[:, :, lo:hi], st["k_bar"], st["v_bar"], ref, lo)
    buf, n, group = st["buf"], 141, kv_reference.GROUP
    whole = n // group * group  # grouped: the slots of the whole groups, quantized; the rest in the recent rows
    for name, grouped in (("k", kv_reference.k_grouped(precision)), ("v", kv_reference.v_grouped(precision))):
        values, scales = getattr(buf, name + "q"), getattr(buf, name + "s")
        want_values, want_scales = getattr(ref, name + "q"), getattr(ref, name + "s")
        if grouped:  # bit for bit, and the incomplete group's rows
            assert torch.equal(values[:, :, :whole], want_values[:, :, :whole]), name
            assert torch.equal(scales[:, :, : n // group], want_scales[:, :, : n // group]), name
            recent, want_recent = getattr(buf, name + "_recent"), getattr(ref, name + "_recent")
            assert torch.equal(recent[:, :, : n - whole], want_recent[:, :, : n - whole]), name
            assert (values[:, :, whole:] == (99 if name == "k" else 200)).all()  # slots past them untouched
        else:  # per token, bit for bit (V's channel-major tiles as rows of slots)
            if name == "v":
                values, want_values = (kv_reference.token_major(t).flatten(2, 3) for t in (values, want_values))
            assert torch.equal(values[:, :, :n], want_values[:, :, :n]) and torch.equal(scales[:, :, :n], want_scales[:, :, :n])
            assert (values[:, :, n:] == (99 if name == "k" else 200)).all()
            assert torch.equal(getattr(buf, name + "_eq"), getattr(ref, name + "_eq"))
    # the storage decodes back to the inputs within the format's resolution: half a grid step (the recent rows
    # exact to their dtype's rounding)
    for name, original, center in (("k", k, st["k_bar"]), ("v", v, st["v_bar"])):
        grouped = (kv_reference.k_grouped if name == "k" else kv_reference.v_grouped)(precision)
        back = getattr(kv_reference, "dequantize_" + name)(buf, 48, n) + center[:, :, None]
        scales = getattr(buf, name + "s")
        if grouped:
            step = scales[:, :, : n // group, 0].float().repeat_interleave(group, dim=2)
            step = torch.cat([step, step.new_zeros(2, 3, n - whole, 48)], dim=2)
        else:  # the token's step, per channel times its equalizer
            step = scales[:, :, :n, None] * getattr(buf, name + "_eq")[:, :, None, :]
        assert ((back - original).abs() <= 0.5 * step * 1.0001 + 1e-5).all(), name


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("token", [3, 29])  # of the 30 appended: slot 103 (INT4: a group completed), 129 (still open)
def test_a_non_finite_token_reaches_attention_as_nan(seed, precision, where, bad, token):
    """One appended token with a NaN or ±Inf in K or V (after the centers were fixed): the queries of that
    sequence's KV head come out NaN, the other sequence stays finite (the GPU's max ignores NaN, so a scale taken
    from it would quantize the bad value away). Quantized, a bad value poisons its token's (or INT4 group's) scale:
    every such query is NaN. A group still open holds K exactly, so +Inf there acts as in full precision:
    NaN where q points at it (score +∞), an ignored key where q points away (−∞). int8g's V is grouped per
    channel: a bad value poisons its channel's scale, or (open group) is held exactly — either way only that
    channel of the output is non-finite, as in full precision."""
    k, v = outlier_kv(2, 2, 130, 32)
    st = fill(k[:, :, :100], v[:, :, :100], precision, capacity=192)
    poisoned = (k if where == "k" else v)[:, :, 100:].clone()
    poisoned[0, 0, token, 5] = bad  # sequence 0, KV head 0
    new_k, new_v = (poisoned, v[:, :, 100:]) if where == "k" else (k[:, :, 100:], poisoned)
    decode_launch.append(new_k, new_v, st["k_bar"], st["v_bar"], st["buf"], 100)
    q = torch.randn(2, 4, 1, 32, device=DEVICE)
    out = decode_launch.decode(q, st["buf"], st["v_bar"], 130)  # (B, Nq, Hq, D); heads 0–1 read KV head 0
    if precision == "int8g" and where == "v":
        assert not torch.isfinite(out[0, 0, :2, 5]).any()
        assert torch.isfinite(out[0, 0, :2, :5]).all() and torch.isfinite(out[0, 0, :2, 6:]).all()
        assert torch.isfinite(out[0, :, 2:]).all() and torch.isfinite(out[1]).all()
        return
    nan_rows = torch.ones(2, dtype=torch.bool, device=DEVICE)
    if precision != "int8" and token == 29 and where == "k" and bad == float("inf"):
        nan_rows = q[0, :2, 0, 5] > 0
    assert torch.equal(torch.isnan(out[0, 0, :2]).all(-1), nan_rows), (out[0, 0, :2, 0], q[0, :2, 0, 5])
    assert torch.isfinite(out[0, 0, :2][~nan_rows]).all()
    assert torch.isfinite(out[0, :, 2:]).all() and torch.isfinite(out[1]).all()


# --- mutants: the check above must catch a broken kernel -------------------------------------------
MUTATIONS = {
    "causal diagonal top-left": ("diag = NK - NQ", "diag = NK * 0"),
    "v̄ dropped": ("acc / tl.where(seen, l_i, 1.0)[:, None] + v_bar[None, :]", "acc / tl.where(seen, l_i, 1.0)[:, None]"),
    "splits merged unweighted": ("a_t = tl.math.exp2(m_t - m_use[None, :])", "a_t = tl.where(ok, 1.0, 0.0)"),
    "split merge skips a split": ("for t0 in range(0, NUM_SPLITS, MERGE):", "for t0 in range(1, NUM_SPLITS, MERGE):"),
    "int4 row term dropped": ("qk = qk + _per_query(row, KEYS_AS_ROWS)",
                              "qk = qk + 0.0 * _per_query(row, KEYS_AS_ROWS)"),
    # the interpreter's fp32 path, or the GPU's nibble → bf16 bit trick (the high nibble with the next byte's low one)
    "int4 high nibble unmasked": (("(packed >> 4) & 15", "(packed >> 4)") if DEVICE == "cpu"
                                  else ("shr.u32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F;", "shr.u32 t, $2, 4;")),
    "int4 recent tokens skipped": ("for start in tl.range(tl.maximum(lo, packed_hi), hi, BLOCK_N, num_stages=1):",
                                   "for start in tl.range(hi, hi, BLOCK_N, num_stages=1):"),
    "int8g V zero point dropped": ("+ _per_query(p_sum, KEYS_AS_ROWS) * _per_key_or_channel(zero",
                                   "+ 0.0 * _per_query(p_sum, KEYS_AS_ROWS) * _per_key_or_channel(zero"),
    "int8g K zero point dropped": ("+ _per_query(q_zero, KEYS_AS_ROWS)) * _per_query(q_amax",
                                   ") * _per_query(q_amax"),
    "int8g K row scale dropped": ("* _per_query(q_amax, KEYS_AS_ROWS))", "* 1.0)"),
    "int8g K fp16 offset wrong (GPU)": ("offset = tl.full([BLOCK_N], 1024.0, tl.float32)",
                                        "offset = tl.full([BLOCK_N], 1000.0, tl.float32)"),
    "int8g V scale dropped": ("(pv * _per_key_or_channel(scale, KEYS_AS_ROWS)", "(pv * 0.01"),
    "K's equalizers not folded into q": ("q_unit = q_unit * tl.load(K_EQ", "q_unit = q_unit + 0.0 * tl.load(K_EQ"),
    "V's equalizers dropped": ("v_eq = tl.load(V_EQ + bh * HEAD_DIM + offs_d, mask=d_ok, other=0.0)",
                               "v_eq = 1.0 + 0.0 * tl.load(V_EQ + bh * HEAD_DIM + offs_d, mask=d_ok, other=0.0)"),
    "per-token V's 127 dropped": ("_per_key_or_channel(v_scale * 127.0, KEYS_AS_ROWS)",
                                  "_per_key_or_channel(v_scale, KEYS_AS_ROWS)"),
    "per-token K: q's two parts joined wrong (GPU)": ("k_t, out_dtype=tl.int32) * 254,", "k_t, out_dtype=tl.int32),"),
    "per-token V's fp16 offset wrong (GPU)": ("- (1024.0 + V_OFFSET) * _per_query(p_w_sum",
                                              "- (1000.0 + V_OFFSET) * _per_query(p_w_sum"),
    "per-token V's storage offset kept (CPU)": ("vt.to(tl.float32) - V_OFFSET", "vt.to(tl.float32)"),
    "keys as rows: q's two parts joined wrong (GPU)": ("q_unit, out_dtype=tl.int32) * 254,",
                                                       "q_unit, out_dtype=tl.int32),"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutants_fail_the_check(seed, tmp_path, monkeypatch, name):
    if "(GPU)" in name and DEVICE == "cpu":
        pytest.skip("the mutated line is on the GPU path (the interpreter's dot runs in fp32)")
    if "(CPU)" in name and DEVICE != "cpu":
        pytest.skip("the mutated line is on the interpreter's path")
    precision = next((p for p in ("int8g", "int4") if p in name), "int8")
    n = 45 if precision == "int8" else 100  # grouped: a group and 36 recent tokens
    k, v = outlier_kv(1, 2, n, 32)
    # 10 query rows a tile (the query rows as the dots' rows), and 4 (INT8: the keys as the dots' rows)
    qs = [torch.randn(1, 4, nq, 32, device=DEVICE, dtype=torch.float16) for nq in (5, 2)]
    st = fill(k, v, precision)
    splits = 3 if "split" in name else 1

    def run():  # 16-key tiles: 45 keys make three, so the splits happen on a GPU too
        for q in qs:
            out = decode_launch.decode(q, st["buf"], st["v_bar"], n, num_splits=splits, **tiles(precision))
            ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], n)
            if mismatch(out, ref) is not None:
                return mismatch(out, ref)
        return None

    assert run() is None
    mutant = mutant_module(tmp_path, decode, *MUTATIONS[name])
    monkeypatch.setattr(decode_launch, "decode_kernel", mutant.decode_kernel)
    assert run() is not None, f"the mutant '{name}' passed the check"


DITHER_MUTATIONS = {
    "K": ("offset = offset + group_dither(tl.arange(0, BLOCK_N))", "offset = offset"),
    "V": ("pv = pv - _per_query(p_phi, KEYS_AS_ROWS)", "pv = pv - 0.0 * _per_query(p_phi, KEYS_AS_ROWS)"),
}


@pytest.mark.parametrize("left_out", [None, *DITHER_MUTATIONS])
def test_int8g_reads_values_back_with_their_dither(seed, tmp_path, monkeypatch, left_out):
    """int8g's stored values are read back as u − φ_row (formats.KV_GROUP_DITHERED). One whole group whose K and
    V are multiples of the identity, and q constant: every key scores alike, so the weights are uniform (each
    output row is them, ×4) unless K's dither is dropped (the scores then spread by up to Σ q ⊙ scale ≈ 2), and
    V's dither is up to a step of the output. The decode matches the reference, and with either dither left out
    of the decode kernel it does not."""
    n = d = kv_reference.GROUP
    eye = torch.eye(n, device=DEVICE)[None, None]
    k, v = 8.0 * eye + 0.01 * torch.randn(1, 1, n, d, device=DEVICE), 4.0 * eye
    q = torch.ones(1, 2, 1, d, device=DEVICE, dtype=torch.float16)
    st = fill(k, v, "int8g")
    if left_out is not None:
        mutant = mutant_module(tmp_path, decode, *DITHER_MUTATIONS[left_out])
        monkeypatch.setattr(decode_launch, "decode_kernel", mutant.decode_kernel)
    out = decode_launch.decode(q, st["buf"], st["v_bar"], n, sm_scale=1.0)
    problem = mismatch(out, kv_reference.decode_attention(q, st["buf"], st["v_bar"], n, sm_scale=1.0))
    if left_out is None:
        assert problem is None, problem
    else:
        assert problem is not None, f"the decode kernel without {left_out}'s dither passed the check"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled GPU kernels")
def test_a_growing_cache_compiles_no_new_decode_kernel():
    """Decode steps over a cache whose key count passes multiples of 16 (as a generation does) reuse the
    first step's compiled kernel: no compile in the middle of a generation."""
    k, v = outlier_kv(1, 2, 200, 64)
    st = fill(k, v, "int8", capacity=256)
    q = torch.randn(1, 4, 1, 64, device=DEVICE, dtype=torch.float16)
    kernel_cache = decode.decode_kernel.device_caches[torch.cuda.current_device()][0]

    def step(nk):
        decode_launch.decode(q, st["buf"], st["v_bar"], nk)

    step(129)  # more than two 64-key tiles: split, as every later step
    compiled = len(kernel_cache)
    for nk in (144, 145, 160, 176, 177, 192, 200):
        step(nk)
    assert len(kernel_cache) == compiled


@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_head_dim_256_with_several_query_tokens(seed, precision):
    """d256, three query tokens, GQA 16:1, splits: compiles on the GPU (the d128 register cap made ptxas refuse
    INT4) and matches the reference."""
    k, v = outlier_kv(2, 1, 300, 256)
    st = fill(k, v, precision)
    q = torch.randn(2, 16, 3, 256, device=DEVICE, dtype=torch.bfloat16)
    out = decode_launch.decode(q, st["buf"], st["v_bar"], 300, **(tiles(precision) if DEVICE == "cpu" else {}))
    ref = kv_reference.decode_attention(q, st["buf"], st["v_bar"], 300)
    assert mismatch(out, ref) is None



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bound launches skip Triton's path on a GPU only")
@pytest.mark.parametrize("precision", ["int8", "int4", "int8g"])
def test_bound_launches_of_a_cache_layer_match_triton_launches(seed, precision, monkeypatch):
    """A cache layer's eager steps launch from its memo of bound launches (``launches``): the same storage and
    outputs, bit for bit, as Triton's own launches (``HF_QATTN_FAST_LAUNCH=0``) of the same steps, over steps that
    grow (and so move) the storage and change the split count; and the memo's direct path is taken."""
    from hf_qattn.kernels import fast_launch
    from hf_qattn.kv_cache.cache import QAttnLayer

    k, v = (t.to(torch.bfloat16) for t in outlier_kv(1, 2, 150, 64))
    bound, triton_path = QAttnLayer(precision), QAttnLayer(precision)
    launcher = fast_launch.fast(decode.decode_kernel)
    direct = launcher.direct

    def step(layer, k1, v1, q, fast: str):
        monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", fast)
        layer._append(k1, v1)
        store = layer.storage()
        return store, decode_launch.decode(q, store, store.v_bar, store.length, launches=store.launches)

    for layer, fast in ((bound, "1"), (triton_path, "0")):
        monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", fast)
        layer.update(k, v)
    for i in range(60):
        k1, v1 = (torch.randn(1, 2, 1, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 8, 1, 64, device=DEVICE, dtype=torch.bfloat16)
        store, got = step(bound, k1, v1, q, "1")
        want_store, want = step(triton_path, k1, v1, q, "0")
        assert torch.equal(got, want), f"output of step {i}"
        for a, b in zip(store[1:7], want_store[1:7]):
            if a is not None:
                assert torch.equal(a, b), f"storage after step {i}"
    assert launcher.direct >= direct + 50


def test_the_reference_models_the_int4_tiles_rounding_of_q_times_scale(seed):
    """group_q_round: the scores of INT4 K's whole groups become Σ round(q ⊙ scale)·u + q·zero (the GPU tile's
    arithmetic), the recent rows' stay exact; checked against that sum written out, on scores large enough that
    the rounding moves the output."""
    b, hq, hk, nq, nk, d = 1, 4, 2, 1, 150, 64
    k, v = outlier_kv(b, hk, nk, d)
    q = (4.0 * torch.randn(b, hq, nq, d)).to(DEVICE)  # float32: the reference's output is not rounded to bf16
    st = fill(k, v, "int4")
    buf = st["buf"]
    whole = nk // kv_reference.GROUP * kv_reference.GROUP
    u = kv_reference.unpack_nibbles(buf.kq[:, :, :whole], d).double().reshape(b, hk, -1, kv_reference.GROUP, d)
    params = buf.ks[:, :, : whole // kv_reference.GROUP].double()
    scale, zero = params[:, :, :, 0], params[:, :, :, 1]
    qd = q.double().reshape(b, hk, hq // hk, nq, d)
    qs = (qd[:, :, :, :, None, :] * scale[:, :, None, None]).to(torch.bfloat16).double()
    grouped = (torch.einsum("bhgqnd,bhntd->bhgqnt", qs, u)
               + torch.einsum("bhgqd,bhnd->bhgqn", qd, zero)[..., None]).reshape(b, hq, nq, whole)
    recent = torch.einsum("bhgqd,bhtd->bhgqt", qd, buf.k_recent[:, :, : nk - whole].double()).reshape(b, hq, nq, -1)
    probs = torch.softmax(torch.cat([grouped, recent], -1) / d ** 0.5, -1)
    v_all = kv_reference.dequantize_v(buf, d, nk, torch.float64).repeat_interleave(hq // hk, 1)
    written_out = probs @ v_all + st["v_bar"].double().repeat_interleave(hq // hk, 1)[:, :, None, :]
    modeled = kv_reference.decode_attention(q, buf, st["v_bar"], nk, group_q_round=torch.bfloat16,
                                            dtype=torch.float64).double().transpose(1, 2)
    exact = kv_reference.decode_attention(q, buf, st["v_bar"], nk, dtype=torch.float64).double().transpose(1, 2)
    tol = 1e-5 * written_out.abs().max()  # the reference's float32 output
    assert (modeled - written_out).abs().max() <= tol
    assert (exact - written_out).abs().max() > 30 * tol  # the rounding matters on these scores
