"""Host side of the quantized KV cache kernels (see ``decode.py`` for the storage format).

``append`` quantizes new K/V tokens into a layer's buffers; ``decode`` runs attention of a few
query tokens (1..16 typically; any number works) against the cached tokens, reading the
quantized storage directly. Inputs are HND views by strides (B, H, N, D); the output is written
as (B, Nq, Hq, D), the layout transformers' attention functions return.
"""

from __future__ import annotations

import functools
import math

import torch

from . import tuning
from .fast_launch import fast
from .decode import append_kernel, decode_kernel

from .formats import KV_GROUP as GROUP, KV_V_TILE as V_TILE, LOG2E


def group_q_rounding(device) -> torch.dtype | None:
    """How the INT4 tile rounds q ⊙ scale before its dot with a group's nibbles on ``device`` (kernels/decode.py):
    bf16 in a compiled build, not at all under the interpreter (fp32). For references that model the kernel
    (``kv_cache.reference.decode_attention(group_q_round=)``)."""
    return None if tuning.interpreting() or torch.device(device).type != "cuda" else torch.bfloat16


def _check_buffers(buffers) -> tuple[bool, bool]:
    """(INT4, G8): the precision of ``buffers`` (``hf_qattn.kv_cache.reference.Buffers`` or any object with its
    fields): ``int4`` (4-bit K groups) or ``int8g`` (8-bit K and V groups), else per-token INT8 K and V. The
    kernels index group scales and recent tokens assuming contiguous rows, G8's V by K's strides, per-token V as
    whole channel-major tiles, and the equalizers as (B·Hk, D) rows."""
    int4, g8 = buffers.precision == "int4", buffers.precision == "int8g"
    vq = buffers.vq
    if not g8 and (vq.dim() != 5 or vq.shape[-1] != V_TILE or vq.stride(-1) != 1 or vq.stride(-2) != V_TILE):
        raise ValueError(f"{buffers.precision} buffers need per-token V in contiguous channel-major tiles "
                         f"(B, Hk, CAP / {V_TILE}, D, {V_TILE}); got vq of shape {tuple(vq.shape)}")
    grouped = [buffers.ks, buffers.k_recent] + ([buffers.vs, buffers.v_recent] if g8 else [])
    if (int4 or g8) and any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in grouped):
        raise ValueError(f"{buffers.precision} buffers need contiguous group scales (…, 2, D) and recent rows (…, G, D)")
    if g8 and (buffers.vs.stride() != buffers.ks.stride() or buffers.v_recent.stride() != buffers.k_recent.stride()):
        raise ValueError("int8g buffers need V's group scales and recent rows laid out as K's")
    equalized = ([buffers.k_eq] if not (int4 or g8) else []) + ([buffers.v_eq] if not g8 else [])
    if any(t is None or t.dtype != torch.bfloat16 or not t.is_contiguous() for t in equalized):
        raise ValueError(f"{buffers.precision} buffers need their per-token formats' equalizers k_eq / v_eq as "
                         "contiguous (B, Hk, D) bfloat16 tensors")
    return int4, g8


def append(k, v, k_bar, v_bar, buffers, pos0: int | torch.Tensor, launches: dict | None = None) -> None:
    """Quantize k, v (B, Hk, N, D) into slots [pos0, pos0 + N) of ``buffers`` (``reference.Buffers``): one launch.
    INT4 K is quantized a group at a time, when the group's last token arrives (``reference.append``).
    ``pos0`` may be a one-element int32 tensor on the device (read by the kernel: CUDA-graph replayable).
    ``launches``: as :func:`decode`'s."""
    b, hk, n, d = k.shape
    if n == 0:
        return
    int4, g8 = _check_buffers(buffers)
    device_pos = isinstance(pos0, torch.Tensor)
    interp = tuning.interpreting()
    if int4 or g8:  # a program per group touched: pos0's group and the ones the tokens reach (one more, unknown pos0)
        block_t = GROUP
        tiles = _cdiv(n, GROUP) + 1 if device_pos else (pos0 + n - 1) // GROUP - pos0 // GROUP + 1
    else:
        block_t = tuning.decode_config(interp)["APPEND_BLOCK_T"] if n > 16 else 16
        tiles = _cdiv(n, block_t)
    kq, ks, vq, vs, kr, vr, k_eq, v_eq = (buffers.kq, buffers.ks, buffers.vq, buffers.vs, buffers.k_recent,
                                          buffers.v_recent, buffers.k_eq, buffers.v_eq)
    group_strides = ks.stride()[:3] if int4 or g8 else (0, 0, 0)
    recent_strides = kr.stride()[:2] if int4 or g8 else (0, 0)
    args = (k, v, k_bar, v_bar, k_eq, v_eq, kq, ks, vq, vs, kr, vr, 0 if device_pos else pos0,
            pos0 if device_pos else None,
            *k.stride(), *v.stride(), *kq.stride()[:3], *vs.stride()[:2], *group_strides, *recent_strides,
            *vq.stride()[:3], hk, n)
    kwargs = dict(HEAD_DIM=d, D_PAD=tuning.padded_head_dim(d), BLOCK_T=block_t, INT4=int4, G8=g8, GRID_ROUND=interp,
                  DEVICE_POS=device_pos, num_warps=4)
    if launches is None:
        fast(append_kernel).launch((tiles, b * hk), args, kwargs)
    else:  # as decode's memo: the storage and centers by identity, k's and v's layouts, the device count's
        keep = (kq, ks, vq, vs, kr, vr, k_eq, v_eq, k_bar, v_bar, pos0 if device_pos else None)
        memo_key = (tuple(map(id, keep)), k.dtype, k.shape, k.stride(), k.data_ptr() % 16, v.dtype, v.stride(),
                    v.data_ptr() % 16, tuple(kwargs.items()))
        fast(append_kernel).launch_memo(launches, memo_key, keep, (tiles, b * hk), args, kwargs)


# Launch settings: tuning.decode_config (``decode`` in configs/kernels.json). Why each exists, and the
# eval/results file (H100) that measured it where one did:
# BLOCK_N, num_warps: the key tile and warps, fastest in the launch sweep
#   (decode-NVIDIA-H100-80GB-HBM3-2026-11-23.md).
# MAX_ROWS: rows of a tile at most (query heads of a KV group × query tokens); more query tokens make more chunks.
# WAVES: rounds of the programs the SMs hold at once (``resident_programs``) that the split count fills, whole: a
#   launch of 2.06 rounds runs a third round for 6 % of its programs (B8 Hk8: 17 splits, 1,088 programs of 4 an
#   SM; 892.6 µs a step at 128k against 736.1 with 8 splits, one round; H200, decode-splits-*-2026-11-28.md).
# MIN_SPLIT_TILES: key tiles a split reads at least (unless fewer fill the SMs): a short split is mostly merge work.
# MAX_SPLITS: the last split program merges the splits (four a step, kernels/decode.py), a tail that grows with them
#   (decode-NVIDIA-H100-80GB-HBM3-2026-11-23-waves8.md); INT8's and int8g's launches set 64 for their one- and
#   two-warp programs (B1 128k INT8 on an H200: 108.8 µs a step with 64 splits, 142.0 with 32;
#   decode-warps-NVIDIA-H200-2026-11-28.md).
# launch (head dims up to WIDE_ABOVE): warps and register cap by format. INT8 runs one warp a program (no
#   cross-warp reductions in a tile's softmax; 255 registers, four programs an SM by shared memory): B8 64k −15 %
#   against four warps; int8g two warps without a cap (three an SM: −7 to −10 %). What bounds the one-warp step is
#   open: the per-token scales in each tile's chain cost 10–13 % of a long step, not by their bytes. INT4 one warp
#   too, since its nibbles become bf16 by byte permutes (kernels/decode.py _bf16_128_plus_nibble; a tile's warp
#   instructions 3,036 → 1,321, offline): B8 64k 313 µs against 456 with four warps capped at 168 (−31 %), B1 128k
#   −26 %; at d64 two warps (BY_HEAD_DIM: a format's launch for one padded head dim): −42 % against −25 % with one
#   (decode-warps-NVIDIA-H200-2026-11-28.md section 7), capped at the 128 registers they take anyway, so that the
#   plan counts the eight programs an SM holds (by registers at that cap), not four (255 registers, uncapped);
#   int8g at d64 capped at 168 for the same reason (it takes 156–164).
#   Stages at d128 (BY_HEAD_DIM) so that an SM holds a multiple of four one-warp programs: its four schedulers
#   each issue for one warp, or two; a fifth warp doubles one scheduler's load, and that scheduler's programs
#   finish last. INT4 (issue-bound) five stages, four programs an SM: B8 64k / 128k 209–217 / 401–414 µs against
#   243–250 / 468–478 with four stages (five an SM by its 40 KB), −14 %; three stages (eight an SM) level at
#   128k, 2–3 % slower at 64k. INT8 four stages, four an SM: −1 to −2 % against three (six an SM); two stages
#   (eight an SM by registers) +1 to +4 % against four (decode-warps-NVIDIA-H200-2026-11-28.md section 12).
#   Two stages lose at d64 (section 8).
# launch_wide (past WIDE_ABOVE): four warps, no cap (the INT4 tile of several query tokens needs more than 168);
#   int8g one stage, where Triton 3.6 stages 128 KiB a stage at d256 (3 stages: 393 KiB of shared memory, past the
#   H100's 227 KiB; 1 stage: 96 KiB).
# V_STAGED (kernels/decode.py _fp16_1024_plus): int8g up to WIDE_ABOVE (its V groups are key-major). Per-token V
#   (INT8, INT4) is stored channel-major in 64-token tiles (formats.KV_V_TILE) and needs no staging: offline, the
#   INT8 d128 tile 892 → 755 instructions, 50 → 35 KB a program; INT4 1,370 → 1,197, 55.5 → 40 KB. H200, B8 d128:
#   INT4 −8 % / −9 % at 64k / 128k, INT8 level there (decode-warps-*-2026-11-28.md section 10).
# KEYS_AS_ROWS_UP_TO: tiles of at most this many query rows (a decode step of GQA ≤ 8) take the keys as the dots'
#   rows and the query rows as their columns, which an mma pads to 8 where it pads rows to 16: half the softmax's
#   elements and half the mma's of the 16-row tile. INT8 (one warp, d128: 1,259 → 928 instructions a tile, no spill
#   reloads in the loop): B8 64k −16 %, B1 128k −10 % a step (H200, decode-warps-*-2026-11-28.md section 6).
#   int8g (two warps) likewise: B8 64k 384–398 µs against 465–470 with the rows tile (−16 %), B1 128k 122.6 against
#   138.4 (−11 %; decode-NVIDIA-H200-2026-11-29.md and its previous run, section 6c); INT4 at one warp (above).
# BY_ROWS: a format's launch for tiles from so many padded rows up (several query tokens a step, GQA-16 and MQA
#   steps; the entry of the largest key not above the tile's rows), applied after BY_HEAD_DIM (a BY_ROWS inside
#   BY_HEAD_DIM replaces the format's at that head dim). A one-warp
#   program would hold 32 or 64 rows × 128 channels of fp32 output (INT8 64 rows: 25 KB of spills, offline sm_90
#   build), so those tiles take four warps on three stages (undoing d128's four / five, set for the one-warp tile).
#   At d128 uncapped (INT8 242–248 registers, no spills; INT8 capped at 128 and INT4 at 168 spilled 0.5–3.1 KB with
#   local loads in the loop):
#   B8 64k INT8 32 / 64 rows 516–520 / 517–529 µs against 665–666 / 822 capped at 128 (−22 / −36 %), INT4 633–643 /
#   911 against 663–673 / 1,385–1,389 at 168 (−4 / −34 %). INT4 d128's 16-row tile (four query tokens of a GQA-4
#   group) also on four warps, at 168 (three programs an SM; no loop spills offline, where one warp on five stages
#   spilled 1.6 KB with 60 local loads in its loop): 372–382 µs against 744–756 (−50 %), 3–4 % faster than uncapped;
#   INT8's 16-row tile stays on one warp (270–278 µs against 319–336 on four). At d64 the 16-row tiles keep the step's
#   launch (B8 64k INT8 196–203 µs, INT4 225, against 250–339 on four warps) and 32 / 64 rows keep four warps capped
#   (the plan counts programs by the cap: uncapped it would count two an SM where the kernel's own registers hold
#   more); not measured against uncapped there (decode-warps-*-2026-11-28.md section 13).
# SHARED: a program's shared memory with the default launch by the width of the cache's floats, format, padded head
#   dim and the tile's padded rows (8: a decode step's, the keys as the dots' rows; 16: GQA-16 steps, or a few query
#   tokens a step; 32 and 64: MQA steps, speculative steps) (Triton 3.6's sm90 builds), so that the
#   programs an SM holds count it (one-warp INT8 programs: 8 by registers, 4 by shared memory at d128; at d64 capped
#   at the 128 registers they take, so that the plan counts the 12 an SM holds by shared memory); not listed (d256):
#   registers only. The larger tiles take more (int8g d128's 32-row programs 62.5 KB: three an SM, where the step
#   tile's bytes would count four, and the plan's last round run short); INT8 d64's 16-row one-warp tile is uneven
#   on the schedulers (eleven an SM) and spills (section 12b).
#   The INT4 and int8g recent-token tiles are kept in the model's floats, so a float32 model's INT4 programs take
#   more (d128: 57.3 KB against 53.2, four an SM either way); INT8 has no such tile. (The decode kernel does not
#   pipeline that tile's loop: its stage buffers set INT4's bytes, 68 KB, and int8g's float32 ones, 137 KB, before;
#   section 8.)
# NUM_SPLITS: a fixed split count instead of the heuristic (the interpreter's 2, so the tests run the merge).
# APPEND_BLOCK_T: tokens an append program quantizes (16, the smallest tile, for a decode step's few tokens).


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: a constexpr function, whose call from Python costs microseconds of host time on every step
    return -(-a // b)


# an sm90 SM's shared memory, and what the driver reserves of it for each resident program
SM_SHARED_BYTES = 233472
PROGRAM_RESERVED_SHARED = 1024


def resident_programs(maxnreg: int, num_warps: int, shared: int = 0) -> int:
    """Decode programs an SM holds at once: its 65,536 registers over a program's (the cap a thread, or 255 with
    none, times its threads), and its shared memory over a program's ``shared`` bytes (0: not known, registers
    only)."""
    by_registers = 65536 // ((maxnreg or 255) * 32 * num_warps)
    by_shared = SM_SHARED_BYTES // (shared + PROGRAM_RESERVED_SHARED) if shared else by_registers
    return max(1, min(by_registers, by_shared))


def _plan(b: int, hk: int, groups: int, nq: int, nk: int, sms: int, resident: int, interp: bool, block_n: int,
          num_splits: int | None, waves: float | None, max_splits: int | None) -> tuple:
    """(qt, chunks, splits, split_len) of a decode launch over ``nk`` keys on ``sms`` SMs holding ``resident``
    programs each (``max_splits``: the format's cap, else kernels.json's MAX_SPLITS)."""
    qt, chunks, split_len = _plan_tiles(b, hk, groups, nq, max(1, _cdiv(nk, block_n)), sms, resident, interp, block_n,
                                        num_splits, waves, max_splits)
    return qt, chunks, _cdiv(max(nk, 1), split_len), split_len  # no empty trailing split


@functools.lru_cache(maxsize=4096)
def _plan_tiles(b: int, hk: int, groups: int, nq: int, tiles: int, sms: int, resident: int, interp: bool,
                block_n: int, num_splits: int | None, waves: float | None, max_splits: int | None) -> tuple:
    """(qt, chunks, split_len) for ``tiles`` key tiles: a cache grows a tile every ``block_n`` steps, so
    this is computed once per tile, not per step."""
    cfg = tuning.decode_config(interp)
    qt = tile_rows(groups, nq, interp)[0]
    chunks = _cdiv(nq, qt)
    if num_splits is None:
        num_splits = cfg["NUM_SPLITS"]
    if num_splits is None:
        programs = chunks * b * hk
        fill = _cdiv(sms, programs)  # splits for one program per SM
        # as many splits as whole rounds of resident programs hold: one more program would start a round alone
        want = max(1, int(sms * resident * (cfg["WAVES"] if waves is None else waves)) // programs)
        cap = cfg["MAX_SPLITS"] if max_splits is None else max_splits
        num_splits = min(want, max(fill, tiles // cfg["MIN_SPLIT_TILES"]), max(fill, cap))
    num_splits = max(1, min(num_splits, tiles))
    return qt, chunks, _cdiv(tiles, num_splits) * block_n


def tile_rows(groups: int, nq: int, interp: bool, keys_as_rows_up_to: int = 0) -> tuple[int, int, bool]:
    """(query tokens, rows, keys as rows) of a decode tile: the group's query heads times up to MAX_ROWS // groups
    query tokens, rows padded to a power of two ≥ 16 (an mma's rows), or, at most ``keys_as_rows_up_to`` of them
    (the format's KEYS_AS_ROWS_UP_TO), ≥ 8: the kernel then puts the keys on the dots' rows and these rows on their
    columns, which an mma pads to 8 (kernels/decode.py _attend_tile)."""
    qt = max(1, min(nq, tuning.decode_config(interp)["MAX_ROWS"] // groups))
    real = qt * groups
    keys_as_rows = real <= keys_as_rows_up_to
    return qt, max(8 if keys_as_rows else 16, 1 << (real - 1).bit_length()), keys_as_rows


def kernel_options(precision: str, head_dim: int, interpreting: bool, *, rows: int = 8,
                   num_warps: int | None = None, num_stages: int | None = None, maxnreg: int | None = None) -> dict:
    """The decode kernel's launch options for a cache of ``precision`` ("int8", "int4" or "int8g") and tiles of
    ``rows`` rows (:func:`tile_rows`): warps, stages where set, the register cap where there is one (kernels.json's
    ``decode`` fills what is not given)."""
    launch = _default_launch(precision, tuning.padded_head_dim(head_dim), interpreting, rows)
    if num_stages is None:
        num_stages = launch.get("num_stages")
    options = {"num_warps": launch["num_warps"] if num_warps is None else num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    options.update(tuning.register_cap(launch["maxnreg"] if maxnreg is None else maxnreg, interpreting))
    return options


@functools.lru_cache(maxsize=None)
def _default_launch(precision: str, d_pad: int, interpreting: bool, rows: int = 8) -> dict:
    """kernels.json's launch of ``precision`` at ``d_pad`` for tiles of ``rows`` rows (cached, read-only: a decode
    step's host path asks for it)."""
    settings = tuning.decode_config(interpreting)
    launch = settings["launch" if d_pad <= settings["WIDE_ABOVE"] else "launch_wide"][precision]
    launch = {**launch, **launch.get("BY_HEAD_DIM", {}).get(str(d_pad), {})}
    from_rows = [int(key) for key in launch.get("BY_ROWS", {}) if int(key) <= rows]
    return {**launch, **launch["BY_ROWS"][str(max(from_rows))]} if from_rows else launch


@functools.lru_cache(maxsize=None)
def default_shared_bytes(precision: str, head_dim: int, interpreting: bool,
                         cache_dtype: torch.dtype = torch.bfloat16, rows: int = 8) -> int:
    """A program's shared memory with the default launch of ``precision`` at ``head_dim`` for tiles of ``rows``
    padded rows (:func:`tile_rows`) over a cache whose recent-token tiles are ``cache_dtype`` (kernels.json's
    ``SHARED``, Triton's sm90 build), or 0 where not listed."""
    width = f"{cache_dtype.itemsize * 8}-bit"
    by_rows = tuning.decode_config(interpreting).get("SHARED", {}).get(width, {}).get(precision, {})
    return by_rows.get(str(tuning.padded_head_dim(head_dim)), {}).get(str(rows), 0)


def plan_launch(b: int, hk: int, groups: int, nq: int, nk: int, device: torch.device, options: dict, *,
                block_n: int | None = None, num_splits: int | None = None, waves: float | None = None,
                interpreting: bool | None = None, shared: int = 0, max_splits: int | None = None,
                block_m: int | None = None) -> dict:
    """Tile sizes and the split count of one decode call whose kernel launches with ``options``
    (:func:`kernel_options`: its warps and register cap, and its ``shared`` bytes where known
    (:func:`default_shared_bytes`), set how many programs an SM holds); ``interpreting``:
    ``tuning.interpreting()``, if the caller read it already; ``max_splits``: the format's cap on splits, if any;
    ``block_m``: the tile's rows (:func:`tile_rows`; left out, a tile with the query rows as the dots' rows)."""
    interp = (tuning.interpreting() if interpreting is None else interpreting) or device.type != "cuda"
    sms = 0 if interp else tuning.sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if block_n is None:
        block_n = tuning.decode_config(interp)["BLOCK_N"]
    resident = resident_programs(options.get("maxnreg", 0), options["num_warps"], shared)
    if block_m is None:
        block_m = tile_rows(groups, nq, interp)[1]
    qt, chunks, splits, split_len = _plan(b, hk, groups, nq, nk, sms, resident, interp, block_n, num_splits, waves,
                                          max_splits)
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, QT=qt, chunks=chunks, num_splits=splits, split_len=split_len)


def plan_decode(precision: str, q_shape: tuple, hk: int, nk: int, device: torch.device, *,
                block_n: int | None = None, num_splits: int | None = None, waves: float | None = None,
                num_warps: int | None = None, num_stages: int | None = None, maxnreg: int | None = None,
                interpreting: bool | None = None, cache_dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """(launch options, plan) of a decode call of queries ``q_shape`` (B, Hq, Nq, D) over ``nk`` keys of a cache of
    ``precision`` with ``hk`` kv heads whose recent-token tiles are ``cache_dtype`` (the model's floats): what
    :func:`decode` launches, for callers that report it. The plan's ``V_STAGED``: whether the kernel stages V's tile
    in fp16 in shared memory (the format's launch says); ``KEYS_AS_ROWS``: whether its dots take the keys as their rows
    (:func:`tile_rows`)."""
    b, hq, nq, d = q_shape
    interp = tuning.interpreting() if interpreting is None else interpreting
    on_cpu = interp or device.type != "cuda"
    d_pad = tuning.padded_head_dim(d)
    step_launch = _default_launch(precision, d_pad, on_cpu)
    _, rows, keys_as_rows = tile_rows(hq // hk, nq, on_cpu, step_launch.get("KEYS_AS_ROWS_UP_TO", 0))
    options = kernel_options(precision, d, on_cpu, rows=rows, num_warps=num_warps, num_stages=num_stages,
                             maxnreg=maxnreg)
    # the launch kernels.json sets is the one whose programs' shared memory it lists (by the tile's rows)
    default_launch = num_warps is None and num_stages is None and maxnreg is None and block_n is None
    shared = default_shared_bytes(precision, d, on_cpu, cache_dtype, rows) if default_launch else 0
    if precision in ("int4", "int8g"):
        block_n = GROUP  # a group a tile
    launch = _default_launch(precision, d_pad, on_cpu, rows)
    plan = plan_launch(b, hk, hq // hk, nq, nk, device, options, block_n=block_n, num_splits=num_splits,
                       waves=waves, interpreting=interp, shared=shared, max_splits=launch.get("MAX_SPLITS"),
                       block_m=rows)
    plan["V_STAGED"] = bool(launch.get("V_STAGED", False))
    plan["KEYS_AS_ROWS"] = keys_as_rows
    return options, plan


# Scratch of the split path, kept per device and grown as needed (no allocation per decode step):
# the partial (acc, m, l) of every split, and the merge's arrival counters, which the kernel leaves
# at zero. Launches on one stream use it one after the other; calls from several streams
# at once on one device would need one workspace per stream (not done).
_WORKSPACE: dict = {}


def _workspace(device: torch.device, rows: int, d_pad: int, tiles: int):
    key = (device.type, device.index)
    ws = _WORKSPACE.get(key)
    if ws is None or ws[0].shape[0] < rows or ws[0].shape[1] < d_pad or ws[3].numel() < tiles:
        old_rows, old_d, old_tiles = (0, 0, 0) if ws is None else (ws[0].shape[0], ws[0].shape[1], ws[3].numel())
        rows, d_pad, tiles = max(rows, old_rows), max(d_pad, old_d), max(tiles, old_tiles, 1024)
        part_o = torch.empty(rows, d_pad, device=device, dtype=torch.float32)
        part_m = torch.empty(rows, device=device, dtype=torch.float32)
        ws = (part_o, part_m, torch.empty_like(part_m), torch.zeros(tiles, device=device, dtype=torch.int32))
        _WORKSPACE[key] = ws
    return ws


def decode(q, buffers, v_bar, nk: int, *, sm_scale: float | None = None, causal: bool = True,
           kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None,
           length: torch.Tensor | None = None, window: int | None = None, chunk: int | None = None,
           sinks: torch.Tensor | None = None, softcap: float | None = None, k_bar: torch.Tensor | None = None,
           ring: int | None = None,
           out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None, waves: float | None = None,
           maxnreg: int | None = None, launches: dict | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, Nq, D) over the first ``nk`` tokens of ``buffers`` (``reference.Buffers``, or any
    object with its fields) → (B, Nq, Hq, D) in q's dtype.

    ``causal`` aligns the diagonal bottom-right (query i sees keys ≤ nk − Nq + i); with one query it
    changes nothing. ``kv_start`` / ``kv_end`` (B,) restrict each sequence to keys [start, end).
    ``length``: a one-element int32 tensor on the device holding the cached token count (≤ ``nk``, which
    is then the capacity the launch is planned for): the kernel reads it, so a captured CUDA graph
    replays correctly as the cache grows.
    ``window`` / ``chunk``: the query at position p (slot = position, queries aligned bottom-right) sees
    keys p − window < j ≤ p / keys of its chunk, j // chunk == p // chunk. ``sinks`` (Hq,): one logit per
    query head in the softmax denominator (natural log, units of sm_scale·q·k). ``softcap``: scores
    c·tanh(s / c). Sinks and soft-capping need the stored K's center ``k_bar`` (B, Hk, D) fp32: the kernel
    drops q·k̄ from every score (the softmax ignores a per-row constant), which they must not.
    ``ring``: the cache is a ring of that many slots and ``kv_start`` / ``kv_end`` are instead each sequence's
    first slot and slot count of a cyclic range (which may wrap around the ring's end).
    No host synchronization, no allocation but ``out`` when it is not given; one kernel launch (with
    several splits, the last split program to finish merges them).
    ``block_n``, ``num_warps``, ``num_stages``, ``num_splits`` / ``waves``, ``maxnreg`` (the register cap per
    thread, 0 for none) tune the launch; left out, they come from :func:`tuning.decode_config` (grouped formats read
    a group a tile: ``block_n`` is the group, ``KV_GROUP``; per-token formats: a power of two that divides V's tiles,
    ``KV_V_TILE``).
    ``launches``: a dict the caller keeps for ``buffers`` (a cache layer's, emptied when its storage moves), in
    which the launch is remembered, so that a decode step's next launch skips most of the host's work
    (``FastLauncher.launch_memo``).
    """
    b, hq, nq, d = q.shape
    kq, ks, vq, vs, kr, vr, k_eq, v_eq = (buffers.kq, buffers.ks, buffers.vq, buffers.vs, buffers.k_recent,
                                          buffers.v_recent, buffers.k_eq, buffers.v_eq)
    int4, g8 = _check_buffers(buffers)
    grouped = int4 or g8
    hk = kq.shape[1]
    if grouped:
        if block_n not in (None, GROUP):
            raise ValueError(f"block_n must be the group ({GROUP}) for {buffers.precision} storage; got {block_n}")
        if ring is not None:
            raise ValueError(f"{buffers.precision} storage is not kept in rings (sliding-window / chunked cache layers "
                             "keep INT8)")
    elif block_n is not None and (block_n < 16 or V_TILE % block_n):
        # a key tile reads whole V tiles' columns without a key mask, so it must lie inside one V tile
        raise ValueError(f"block_n must be a power of two from 16 to {V_TILE} (it divides per-token V's "
                         f"{V_TILE}-token tiles) for {buffers.precision} storage; got {block_n}")
    groups = hq // hk
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty(b, nq, hq, d, device=q.device, dtype=q.dtype)
    if nq == 0:
        return out
    interp = tuning.interpreting()
    d_pad = tuning.padded_head_dim(d)
    options, cfg = plan_decode(buffers.precision, q.shape, hk, nk, q.device, block_n=block_n, num_splits=num_splits,
                               waves=waves, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
                               interpreting=interp, cache_dtype=q.dtype if kr is None else kr.dtype)
    if (sinks is not None or softcap is not None) and k_bar is None:
        raise ValueError("k_bar (the stored K's center) is needed with sinks or softcap")
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    if ring is not None and (kv_start is None or kv_end is None):
        raise ValueError("ring needs kv_start and kv_end (first slot and count of each sequence's range)")
    has_range = kv_start is not None or kv_end is not None
    if has_range:
        kv_start = (torch.zeros(b, device=q.device, dtype=torch.int32) if kv_start is None
                    else kv_start.to(device=q.device, dtype=torch.int32).contiguous())
        kv_end = (torch.full((b,), nk, device=q.device, dtype=torch.int32) if kv_end is None
                  else kv_end.to(device=q.device, dtype=torch.int32).contiguous())
    splits = cfg["num_splits"]
    split = splits > 1
    if split:
        part_o, part_m, part_l, counter = _workspace(q.device, b * hq * nq * splits, d_pad, cfg["chunks"] * b * hk)
    else:
        part_o = part_m = part_l = counter = None
    score_k_bar = k_bar if (sinks is not None or softcap is not None) else None
    args = (q, kq, ks, vq, vs, kr, vr, v_bar, k_eq, v_eq, kv_start, kv_end, out, part_o, part_m, part_l, counter, length,
            score_k_bar, sinks, *q.stride(), *kq.stride()[:3], *vs.stride()[:2], *(ks.stride()[:3] if grouped else (0, 0, 0)),
            *(kr.stride()[:3] if grouped else (0, 0, 0)), *vq.stride()[:3], *out.stride(),
            hk, nq, nk, cfg["split_len"], splits, sm_scale * LOG2E,
            1.0 if softcap is None else float(softcap) * LOG2E, window or 0, chunk or 1, ring or 1)
    kwargs = dict(
        GROUPS=groups, QT=cfg["QT"], HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        INT4=int4, G8=g8, CAUSAL=bool(causal) and nq > 1, HAS_KV_RANGE=has_range and ring is None, SPLIT=split,
        INTERPRET=interp, DEVICE_LEN=length is not None, SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, WINDOW=window is not None, CHUNK=chunk is not None, RING=ring is not None,
        V_STAGED=cfg["V_STAGED"], KEYS_AS_ROWS=cfg["KEYS_AS_ROWS"], **options,
    )
    grid = (cfg["chunks"], b * hk, splits)
    if launches is None:
        fast(decode_kernel).launch(grid, args, kwargs)
    else:
        # what the launch specializes on besides the kwargs: the storage by identity (its tensors' dtypes,
        # alignment and strides), q's and out's layout and alignment, the optional tensors' alignment (their
        # dtypes are fixed above; the workspace comes aligned), the spans' int values
        keep = (kq, ks, vq, vs, kr, vr, k_eq, v_eq, v_bar, score_k_bar, length)
        memo_key = (tuple(map(id, keep)), q.dtype, q.shape, q.stride(), q.data_ptr() % 16, out.stride(),
                    out.data_ptr() % 16, *(None if t is None else t.data_ptr() % 16 for t in (kv_start, kv_end, sinks)),
                    window, chunk, ring, tuple(kwargs.items()))
        fast(decode_kernel).launch_memo(launches, memo_key, keep, grid, args, kwargs)
    return out
