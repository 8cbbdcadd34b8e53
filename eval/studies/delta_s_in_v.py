"""Could Q smoothing's per-key score term ΔS ride in V instead of in every score? (CPU study, reference only.)

    python eval/studies/delta_s_in_v.py [--windows 2] [--smollm2-tokens 512] [--models smollm2,synthetic]

Why: the sm90 kernel's softmax issues six instructions a score (convert, FFMA ·δ + ΔS, max, − m, exp2, row sum)
where SageAttention2's issues five: ΔS = q̄·(k_j − k̄) differs by key, so the row maximum must be taken after it
and the exponent needs its own subtraction (eval/results/solo-*.md). Since softmax weights are
exp2(s̃_ij + ΔS_j) = exp2(s̃_ij)·w_j, the per-key factor w_j = 2^(ΔS_j − max ΔS) could scale V's rows in the K/V
pass (V′_j = w_j·(V_j − v̄), quantized to FP8 per channel as V is now), and l sum p·w: the scores then need no
per-key term, and the loop could take Sage2's five instructions. V is shared by a KV head's query heads, so q̄ must
be one per KV group (the mean of its heads' centers; any q̄ keeps the math exact). The risk is V′'s range: keys
with small w_j lose FP8 precision, or flush to zero, though a query may still weigh them.

Each input is scored against float64 ``reference.exact_attention`` (CosSim, RelL1, RMSE of the output) in four
settings, all with the sm90 kernel's granularities (``tuning.hopper_reference_settings()``): the shipped math
(``reference.quantized_attention``, q̄ per query head), no Q smoothing, Q smoothed by one q̄ a KV group (ΔS in the
scores, as shipped), and that q̄ with ΔS folded into V (this file's ``folded_attention``, the same tile loop as
the reference's). Inputs as eval/studies/q_smoothing_int8.py's: SmolLM2-135M's attention calls on WikiText-2 windows
(GQA 9/3, causal), eval/synthetic.py's channel-outlier inputs at d64 / d128.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import torch

EVAL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EVAL)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_accuracy as ka  # noqa: E402
from q_smoothing_int8 import load_records, synthetic_records  # noqa: E402

from hf_qattn import quant  # noqa: E402
from hf_qattn.kernels import tuning  # noqa: E402
from hf_qattn.reference import LOG2E, _repeat_kv, visible_keys  # noqa: E402


def group_q_center(q: torch.Tensor, groups: int, sample: int) -> torch.Tensor:
    """One q̄ a KV group: the mean of its query heads' centers, repeated to every query head (B, Hq, D)."""
    q_bar = quant.smoothing_center(q.float(), sample)
    b, hq, d = q_bar.shape
    shared = q_bar.view(b, hq // groups, groups, d).mean(2, keepdim=True)
    return shared.expand(b, hq // groups, groups, d).reshape(b, hq, d)


def folded_attention(q, k, v, *, is_causal, sm_scale, block_n, q_granularity, k_granularity, warp_rows, block_m,
                     center_sample, v_center_sample, v_granularity, **_):
    """The sm90 kernel's math with one q̄ a KV group and ΔS folded into V as per-key weights (HND, INT8, FP8)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    groups = hq // hk
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    c = scale * LOG2E
    qf, kf, vf = q.float(), k.float(), v.float()
    q_bar = group_q_center(qf, groups, center_sample)
    k_bar = quant.smoothing_center(kf, center_sample)
    v_bar = quant.smoothing_center(vf, v_center_sample)
    qs, ks, vs = qf - q_bar[:, :, None], kf - k_bar[:, :, None], vf - v_bar[:, :, None]
    delta_s = torch.einsum("bhd,bhnd->bhn", q_bar[:, ::groups], ks) * c  # (B, Hk, Nk), base 2
    w = torch.exp2(delta_s - delta_s.amax(-1, keepdim=True))  # ≤ 1: V′ = w·V stays within V's range
    q_hat, dq = quant.quantize_int(qs, quant.INT_MAX["int8"], quant.group_rows(q_granularity, block_m, warp_rows))
    k_hat, dk = quant.quantize_int(ks, quant.INT_MAX["int8"], quant.group_rows(k_granularity, block_n, warp_rows))
    v_hat, dv_scale = quant.quantize_v(vs * w[..., None], "fp8_e4m3", v_granularity, block_n)
    k_hat, dk, v_hat, dv_scale, w = (_repeat_kv(x, groups) for x in (k_hat, dk, v_hat, dv_scale, w))
    visible = visible_keys(b, nq, nk, is_causal=is_causal, kv_start=None, kv_end=None, window=None, chunk=None,
                           device=q.device)
    q_coef = dq * c
    p_log2 = math.log2(quant.P_SCALE["fp8_e4m3"])
    dither = v_granularity == "channel-dither"
    m = torch.full((b, hq, nq), -math.inf)
    l = torch.zeros(b, hq, nq)
    acc = torch.zeros(b, hq, nq, v.shape[-1])
    for tile, j0 in enumerate(range(0, nk, block_n)):
        j1 = min(j0 + block_n, nk)
        qk_int = torch.matmul(q_hat.double(), k_hat[:, :, j0:j1].double().transpose(-1, -2)).float()
        s = (qk_int * (q_coef[..., None] * dk[:, :, None, j0:j1])).masked_fill(~visible[..., j0:j1], -math.inf)
        phi = quant.v_dither(tile) if dither else 1.0
        m_new = torch.maximum(m, s.amax(-1) + math.log2(phi))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        p_scaled = torch.exp2(s - (m_safe - (p_log2 + math.log2(phi)))[..., None])
        alpha = torch.exp2(m - m_safe)
        l = l * alpha + (p_scaled * w[:, :, None, j0:j1]).sum(-1) * (1.0 / phi)
        tile_out = torch.matmul(quant.quantize_p(p_scaled, "fp8_e4m3"), v_hat[:, :, j0:j1])
        acc = acc * alpha[..., None] + tile_out * dv_scale[:, :, 0 if dither else tile][:, :, None, :]
        m = m_new
    seen = l != 0
    l_safe = torch.where(seen, l, 1.0)
    v_bar = _repeat_kv(v_bar[:, :, None], groups)
    return torch.where(seen[..., None], acc / l_safe[..., None] + v_bar, 0.0).to(q.dtype)


SETTINGS = ("shipped", "no smooth_q", "q̄ a group", "q̄ a group, ΔS in V")


def score(records: list[dict]) -> dict:
    """{setting: {layer: [Accuracy per window]}}."""
    kw = tuning.hopper_reference_settings()
    results: dict = {s: {} for s in SETTINGS}
    for record in records:
        q, k, v = record["q"], record["k"], record["v"]
        common = dict(is_causal=record["causal"], sm_scale=record["scale"])
        exact = ka.reference.exact_attention(q, k, v, **common)
        groups = q.shape[1] // k.shape[1]
        q_group = group_q_center(q, groups, kw["center_sample"])
        outs = {
            "shipped": ka.reference.quantized_attention(q, k, v, qk="int8", pv="fp8_e4m3", **common, **kw),
            "no smooth_q": ka.reference.quantized_attention(q, k, v, qk="int8", pv="fp8_e4m3", smooth_q=False,
                                                            **common, **kw),
            "q̄ a group": ka.reference.quantized_attention(
                q, k, v, qk="int8", pv="fp8_e4m3", **common, **kw,
                centers=(q_group, quant.smoothing_center(k.float(), kw["center_sample"]),
                         quant.smoothing_center(v.float(), kw["v_center_sample"]))),
            "q̄ a group, ΔS in V": folded_attention(q, k, v, is_causal=record["causal"], sm_scale=record["scale"], **kw),
        }
        for name, out in outs.items():
            results[name].setdefault(record["layer"], []).append(ka.accuracy(out, exact))
    return results


def table(model: str, results: dict) -> str:
    lines = [f"### {model}\n", "| setting | CosSim avg | CosSim worst | RelL1 avg | RelL1 worst | worst layer (RelL1 avg) | n |",
             "|---|---|---|---|---|---|---|"]
    for name in SETTINGS:
        per = results[name]
        a = [x for xs in per.values() for x in xs]
        worst = max(per, key=lambda L: sum(x.rel_l1 for x in per[L]) / len(per[L]))
        worst_l1 = sum(x.rel_l1 for x in per[worst]) / len(per[worst])
        lines.append(f"| {name} | {sum(x.cos_sim for x in a) / len(a):.6f} | {min(x.cos_sim for x in a):.6f} | "
                     f"{sum(x.rel_l1 for x in a) / len(a):.5f} | {max(x.rel_l1 for x in a):.5f} | "
                     f"{worst} ({worst_l1:.5f}) | {len(a)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--smollm2-tokens", type=int, default=512)
    parser.add_argument("--models", default="smollm2,synthetic")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, threads {torch.get_num_threads()}; "
          f"command: python {' '.join(['eval/studies/delta_s_in_v.py'] + sys.argv[1:])}")
    print(f"settings (sm90 Gluon kernel): {tuning.hopper_reference_settings()}")
    start = time.perf_counter()
    suites: dict[str, list[dict]] = {}
    for name in (m.strip() for m in args.models.split(",")):
        if name == "smollm2":
            suites[name] = load_records(name, args.windows, args.smollm2_tokens)
        elif name == "synthetic":
            suites.update(synthetic_records())
    for model, records in suites.items():
        print(table(model, score(records)), flush=True)
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
