"""Bisect the Hopper kernel's zero-mean-V error at long N: its own quantized operands, in float64. (GPU study.)

    bash eval/device_run.sh python3 eval/studies/operand_error.py

Takes the K/V pass's output for the Hopper kernel (K̂, δK, V̂ᵀ permuted, V's range, ΔS, centers), quantizes Q
as the kernel's prologue does (per token), and computes attention from these operands in float64 with P
relative to the row's global maximum: with P rounded to FP8 ("operands") and not ("operands, P exact"), and
with V unquantized ("K̂ only"); V̂'s tile dither (kernels/formats.py) goes into V here, not P. Each is compared with float32 attention on the same rows, beside the kernel.
If "operands" already shows the kernel's error, the K/V pass or the recipe is the cause; if not, the main loop.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "eval")
import accuracy_length as al  # noqa: E402
from hf_qattn.calibration.metrics import accuracy  # noqa: E402
from hf_qattn.kernels import launch, tuning  # noqa: E402
from hf_qattn.kernels.formats import LOG2E, v_dither  # noqa: E402


def v_token(columns):
    c = columns % 32
    return columns - c + ((c & 17) | (((c >> 1) & 1) << 3) | (((c >> 3) & 1) << 2) | (((c >> 2) & 1) << 1))


def from_operands(q, k, v, rows):
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    cfg = tuning.hopper_config(d)
    bn = cfg["BLOCK_N"]
    sm = d ** -0.5
    kv = launch.quantize_kv(q, k, v, sm_scale=sm, qk="int8", v_fp8=True, smooth_q=True, smooth_k=True, smooth_v=True,
                            kv_start=None, kv_end=None, block_n=bn, k_token_scale=False, v_channel_scale=True,
                            permute_v=True, num_warps=cfg["KV_PASS_WARPS"])
    out = {}
    for h in range(hq):
        kvh = h // (hq // hk)
        kq = kv.kq.view(b * hk, kv.nk_pad, -1)[kvh, :nk, :d].double()
        ks = kv.ks[kvh].double().repeat_interleave(bn)[:nk]
        cols = torch.arange(kv.nk_pad, device=q.device)
        vt = kv.vq.view(b * hk, -1, kv.nk_pad)[kvh, :d].float().double()
        vhat = torch.empty(kv.nk_pad, d, dtype=torch.float64, device=q.device)
        vhat[v_token(cols)] = vt.T
        vhat = vhat[:nk]
        vbar = kv.v_bar[kvh].double()
        vs = kv.vs[kvh].double()
        dv = torch.maximum(vs[0, :d] - vbar, vbar + vs[1, :d]).clamp_min(1e-30) / 448.0
        phi = torch.tensor([v_dither(t) for t in range(kv.tiles)], device=q.device, dtype=torch.float64)
        vhat = vhat * phi.repeat_interleave(bn)[:nk, None]  # tile t was quantized with δV·φ_t
        ds = kv.ds[h, :nk].double()
        qs = q[0, h, rows].float() - kv.q_bar[h].float()
        qscale = qs.abs().amax(1).clamp_min(1e-30) / 127.0
        qhat = torch.round(qs / qscale[:, None]).clamp(-127, 127).double()
        s = (qhat @ kq.T) * (qscale.double()[:, None] * ks[None, :]) * (sm * LOG2E) + ds[None, :]
        p = torch.exp2(s - s.amax(1, keepdim=True))
        p8 = (p * 448).to(torch.float8_e4m3fn).double() / 448
        l = p.sum(1, keepdim=True)
        vexact = v[0, kvh].double() - vbar
        for name, pp, vv in (("operands", p8, vhat * dv), ("operands, P exact", p, vhat * dv),
                             ("K̂ only (V exact, P exact)", p, vexact), ("K̂ and P̂ (V exact)", p8, vexact)):
            out.setdefault(name, []).append((pp @ vv) / l + vbar)
    return {name: torch.stack(o)[None] for name, o in out.items()}


def main() -> None:
    lengths = [4096, 32768, 131072, 262144]
    table = {}
    for n in lengths:
        q, k, v = al.inputs(n, "v-zero")
        rows = torch.linspace(0, n - 1, 512, device=q.device).long()
        ref = al.reference_rows(q, k, v, rows)
        results = {"kernel (shipped)": al.hopper(q, k, v, 8)[:, :, rows].float(), "portable": al.portable(q, k, v)[:, :, rows].float()}
        results.update(from_operands(q, k, v, rows))
        for name, o in results.items():
            table[name, n] = accuracy(o.float(), ref)
            print(f"N={n} {name}: cos {table[name, n].cos_sim:.6f} RelL1 {table[name, n].rel_l1:.4f}", flush=True)
        err = (results["kernel (shipped)"] - ref).double()
        common = err.mean(dim=2, keepdim=True)
        print(f"N={n} kernel error: share of its energy in the vector common to all rows "
              f"{(common.square().sum() * len(rows) / err.square().sum()).item():.3f}; "
              f"kernel vs operands cos {accuracy(results['kernel (shipped)'], results['operands'].float()).cos_sim:.6f}",
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    names = sorted({name for name, _ in table}, key=list(dict.fromkeys(name for name, _ in table)).index)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; zero-mean V, cos to float32 (RelL1), 512 rows\n")
    print("| method | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{table[name, n].cos_sim:.6f} ({table[name, n].rel_l1:.4f})" for n in lengths) + " |")


if __name__ == "__main__":
    main()
