"""GPU correctness check of the quantized-cache kernels over many shapes (issue 10).

    python eval/check_decode.py --out /tmp/out            # exits 1 if any case fails
    python eval/check_decode.py --out /tmp/out --quick    # fewer, smaller cases
    python eval/check_decode.py --tiny                    # CPU (TRITON_INTERPRET=1): checks the script runs

For each case (batch, query/KV heads, query tokens 1..16, cached tokens including lengths that are
not a multiple of any tile, head dim, dtype, INT8/INT4 K, left padding, split count):
  1. the append kernel's storage against ``hf_qattn.kv_cache.reference.append`` (INT values and INT4 group
     scales equal, per-token INT8 K and V values equal and their scales to 1e-6);
  2. the decode kernel against float64 attention over the same storage (tolerance: the kernel's
     fp16 q̂ and P·δV rounding and the output dtype: (3e-3 + 2 eps) · max |ref|);
  3. the relative L1 error against exact float64 attention on the unquantized K/V (reported; bounded
     at 0.03 for INT8 K and 0.2 for INT4 K on these inputs with channel outliers);
  4. a second call equal to the first bit for bit (the splits are merged inside the decode launch
     through an arrival counter per tile: the counters were reset);
  5. the static cache's path: decoding planned for the whole capacity with the token count read from
     device memory (``length=``) against the same reference (same tolerance).
Then a captured decode step (``hf_qattn.CapturedDecodeStep``) on a small random Llama against the
same steps run eagerly on a static QAttnCache: greedy tokens equal, logits within 1e-3 of their range.
Each case runs in its own try/except; the table is printed last and written to <out>/check-decode-<gpu>-<date>.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import traceback

import torch
import transformers

# this checks the kernels, at lengths where the transformers integration would otherwise hand calls to SDPA
# (hf_qattn.support.below_break_even)
os.environ.setdefault("HF_QATTN_BREAK_EVEN", "0")

if not torch.cuda.is_available():  # the kernels run under Triton's interpreter, set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_qattn.kv_cache.captured import cache_argument  # noqa: E402

import report  # noqa: E402  (eval/report.py)

CACHE_KW = cache_argument(transformers.LlamaForCausalLM)  # cache= from transformers 5.24, past_key_values= before


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="eval/results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a few small cases (for a CPU under TRITON_INTERPRET=1)")
    p.add_argument("--random-cases", type=int, default=24, help="random shapes on top of the fixed list")
    return p.parse_args(argv)


FIXED = [
    # b, hq, hk, nq, nk, d, dtype, precision, left padding, splits (None: the launcher's choice)
    (8, 32, 8, 1, 4096, 128, torch.bfloat16, "int8", False, None),
    (8, 32, 8, 1, 4096, 128, torch.bfloat16, "int4", False, None),
    (1, 32, 8, 1, 65537, 128, torch.bfloat16, "int8", False, None),
    (1, 32, 8, 1, 131072, 128, torch.bfloat16, "int4", False, None),
    (4, 32, 8, 16, 8191, 128, torch.float16, "int8", True, None),
    (2, 32, 4, 5, 3001, 64, torch.bfloat16, "int4", True, None),
    (2, 9, 3, 1, 1000, 64, torch.bfloat16, "int8", True, None),     # SmolLM2-shaped (GQA 3)
    (3, 8, 8, 2, 777, 128, torch.float16, "int8", False, 1),
    (1, 64, 8, 16, 20000, 128, torch.bfloat16, "int8", False, 7),
    (2, 16, 1, 3, 2049, 256, torch.bfloat16, "int4", True, None),   # MQA, d256
    (2, 12, 2, 8, 513, 96, torch.float16, "int8", True, None),      # head dim padded (96 → 128)
    (1, 8, 1, 1, 17, 80, torch.bfloat16, "int4", False, None),
    (8, 32, 8, 1, 4096, 128, torch.bfloat16, "int8g", False, None),
    (1, 32, 8, 1, 131072, 128, torch.bfloat16, "int8g", False, None),
    (2, 16, 1, 3, 2049, 256, torch.bfloat16, "int8g", True, None),  # MQA, d256
    (2, 12, 2, 8, 513, 96, torch.float16, "int8g", True, 3),         # head dim padded, splits
]


def random_cases(n: int, rng: random.Random):
    cases = []
    for _ in range(n):
        hk = rng.choice([1, 2, 4, 8])
        groups = rng.choice([1, 3, 4, 8])
        cases.append((rng.choice([1, 2, 4]), hk * groups, hk, rng.randint(1, 16), rng.randint(1, 20000),
                      rng.choice([64, 128, 96, 32]), rng.choice([torch.bfloat16, torch.float16]),
                      rng.choice(["int8", "int4", "int8g"]), rng.random() < 0.5, rng.choice([None, None, 1, 3, 16])))
    return cases


def storage_matches(buf, ref_buf, nk: int) -> bool:
    """The append kernel's storage against the reference's: grouped tensors bit for bit over the whole groups (and
    the incomplete group's rows), per-token INT8 values equal and their scales to 1e-6."""
    from hf_qattn.kv_cache import reference as kv_reference

    whole = nk // 64 * 64
    ok = True
    for name, grouped in (("k", kv_reference.k_grouped(buf.precision)), ("v", kv_reference.v_grouped(buf.precision))):
        got, want = getattr(buf, name + "q"), getattr(ref_buf, name + "q")
        got_s, want_s = getattr(buf, name + "s"), getattr(ref_buf, name + "s")
        if grouped:
            ok &= bool(torch.equal(got[:, :, :whole], want[:, :, :whole]))
            ok &= bool(torch.equal(got_s[:, :, : nk // 64], want_s[:, :, : nk // 64]))
            ok &= bool(torch.equal(getattr(buf, name + "_recent")[:, :, : nk - whole],
                                   getattr(ref_buf, name + "_recent")[:, :, : nk - whole]))
        else:
            ok &= bool(torch.allclose(got_s[:, :, :nk], want_s[:, :, :nk], rtol=1e-6, atol=0))
            if name == "v":  # channel-major tiles: the slots' rows of their token-major view
                got, want = (kv_reference.token_major(t).flatten(2, 3) for t in (got, want))
            ok &= bool(torch.equal(got[:, :, :nk], want[:, :, :nk]))
    return ok


def run_case(case, device):
    from hf_qattn import reference
    from hf_qattn.kv_cache import reference as kv_reference
    from hf_qattn.kernels import decode_launch

    b, hq, hk, nq, nk, d, dtype, precision, padded, splits = case
    k = (torch.randn(b, hk, nk, d, device=device) + 6.0 * torch.randn(1, hk, 1, d, device=device)).to(dtype)
    v = (torch.randn(b, hk, nk, d, device=device) + 1.5 * torch.randn(1, hk, 1, d, device=device)).to(dtype)
    q = (torch.randn(b, hq, nq, d, device=device) + 2.0 * torch.randn(1, hq, 1, d, device=device)).to(dtype)
    k_bar, v_bar = kv_reference.centers(k, v)
    buf = kv_reference.allocate(b, hk, nk + 13, d, precision, device, dtype)
    cap = buf.kq.shape[2]
    buf.kq.fill_(99)  # garbage past the tokens
    buf.ks.fill_(1e6)
    buf.vs.fill_(1e6)
    ref_buf = kv_reference.allocate(b, hk, cap, d, precision, device, dtype)
    for store in (buf, ref_buf):  # the equalizers of the first piece, as a cache's first fill fixes them
        kv_reference.set_equalizers(store, k[:, :, :max(1, nk - nq)], v[:, :, :max(1, nk - nq)], k_bar, v_bar)
    # append in two pieces, as prefill then decode would, and the reference likewise (INT4: a group completed by
    # the second piece holds the first piece's tokens as they waited, K − k̄ in the model's dtype)
    cut = max(1, nk - nq)
    for lo, hi in ((0, cut), (cut, nk)):
        decode_launch.append(k[:, :, lo:hi], v[:, :, lo:hi], k_bar, v_bar, buf, lo)
        kv_reference.append(k[:, :, lo:hi], v[:, :, lo:hi], k_bar, v_bar, ref_buf, lo)
    result = {"append_ok": storage_matches(buf, ref_buf, nk)}
    kv_start = kv_end = None
    if padded:
        kv_start = torch.randint(0, max(1, nk // 2), (b,), device=device)
        kv_end = torch.full((b,), nk, device=device)
    common = dict(causal=True, kv_start=kv_start, kv_end=kv_end, num_splits=splits)
    out = decode_launch.decode(q, buf, v_bar, nk, **common)
    again = decode_launch.decode(q, buf, v_bar, nk, **common)
    by_device = decode_launch.decode(q, buf, v_bar, cap, length=torch.tensor([nk], device=device,
                                     dtype=torch.int32), **{**common, "num_splits": None})
    torch.cuda.synchronize() if device == "cuda" else None
    ref = kv_reference.decode_attention(q, buf, v_bar, nk, causal=True, kv_start=kv_start, kv_end=kv_end,
                                        dtype=torch.float64,
                                        group_q_round=decode_launch.group_q_rounding(device)).double()
    scale = ref.abs().max().clamp_min(1e-6)
    eps = torch.finfo(dtype).eps
    tol = (3e-3 + 2 * eps) * scale
    err = (out.double() - ref).abs().max()
    exact = reference.exact_attention(q, k, v, is_causal=nq > 1, kv_start=kv_start, kv_end=kv_end).transpose(1, 2)
    rel = ((out.double() - exact).abs().sum() / exact.abs().sum()).item()
    repeat_ok = bool(torch.equal(out, again))
    device_ok = (by_device.double() - ref).abs().max().item() <= tol.item()
    result.update(finite=bool(torch.isfinite(out).all()), err=err.item() / scale.item(), tol=tol.item() / scale.item(),
                  rel_l1=rel, repeat_ok=repeat_ok, device_ok=device_ok)
    result["pass"] = (result["append_ok"] and result["finite"] and err.item() <= tol.item() and repeat_ok
                      and device_ok
                      and rel < {"int8": 0.03, "int4": 0.2, "int8g": 0.01}[precision])
    return result


@torch.no_grad()
def check_captured_step(device, steps: int = 24) -> dict:
    """A small random Llama (3 layers, GQA 4, d64, bf16): prefill 300 tokens into a static QAttnCache, then
    greedy steps eagerly and through CapturedDecodeStep from the same prefill; tokens and logits compared."""
    import transformers as tf

    import hf_qattn

    config = tf.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, vocab_size=1000, initializer_range=0.1)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="qattn",
                                                dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(0, 1000, (2, 300), device=device)
    runs = []
    for captured in (False, True):
        cache = hf_qattn.QAttnCache(model, static_max_len=300 + steps + 1)
        logits = model(ids, **{CACHE_KW: cache}, use_cache=True).logits[:, -1:]
        step = hf_qattn.CapturedDecodeStep(model, cache) if captured else None
        tokens, scores = [], []
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            logits = (step(token) if captured else model(token, **{CACHE_KW: cache}, use_cache=True).logits)
            scores.append(logits[:, -1].float().clone())
        runs.append((torch.cat(tokens, 1), torch.stack(scores, 1), cache.get_seq_length(),
                     [layer.storage().device_length.item() for layer in cache.layers]))
    (t0, s0, n0, d0), (t1, s1, n1, d1) = runs
    rng = (s0.amax(-1) - s0.amin(-1)).clamp_min(1e-6)
    err = ((s1 - s0).abs().amax(-1) / rng).max().item()
    same = bool(torch.equal(t0, t1))
    ok = same and err < 1e-3 and n0 == n1 == 300 + steps and d0 == d1 == [n0] * 3
    return {"pass": ok, "case": f"CapturedDecodeStep, Llama 3 layers B2, {steps} steps",
            "tokens_equal": same, "logit_err": err, "length": (n0, n1, d1[0])}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.tiny:
            print("no GPU: use --tiny to check the script on a CPU under the Triton interpreter")
            return 2
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.tiny:
        cases = [(1, 4, 2, 1, 37, 32, torch.bfloat16, "int8", False, None),
                 (2, 8, 2, 3, 130, 64, torch.float16, "int4", True, 2)]  # a group completed by the 2nd piece
    elif args.quick:
        cases = FIXED[:4] + random_cases(6, rng)
    else:
        cases = FIXED + random_cases(args.random_cases, rng)
    rows = []
    for case in cases:
        b, hq, hk, nq, nk, d, dtype, precision, padded, splits = case
        name = (f"B{b} Hq{hq}/Hk{hk} nq{nq} L{nk} d{d} {str(dtype)[6:]} {precision}"
                f"{' padded' if padded else ''} splits={splits or 'auto'}")
        try:
            r = run_case(case, device)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            r = {"pass": False, "error": f"{type(error).__name__}: {error}"[:200]}
        r["case"] = name
        print(("PASS " if r["pass"] else "FAIL ") + name, {k: v for k, v in r.items() if k != "case"}, flush=True)
        rows.append(r)
        if device == "cuda":
            torch.cuda.empty_cache()
    captured = None
    if device == "cuda":
        try:
            captured = check_captured_step(device)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            captured = {"pass": False, "case": "CapturedDecodeStep", "error": f"{type(error).__name__}: {error}"[:300]}
        print(("PASS " if captured["pass"] else "FAIL ") + str(captured), flush=True)
        rows_captured = [captured]
    else:
        rows_captured = []

    gpu = report.device_name() if device == "cuda" else "cpu-interpreter"
    date = report.today()
    failed = [r for r in rows + rows_captured if not r["pass"]]
    lines = [f"# Decode kernel check — {gpu}, {date}", "", report.versions("transformers"), "",
             f"{len(rows) + len(rows_captured) - len(failed)} of {len(rows) + len(rows_captured)} checks pass "
             f"(seed {args.seed}).", "",
             "| case | append == reference | max err / max|ref| | tolerance | relL1 vs exact (unquantized) | repeat identical | count from device ok | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | | | | FAIL: {r['error']} |")
        else:
            lines.append(f"| {r['case']} | {r['append_ok']} | {r['err']:.2e} | {r['tol']:.2e} | {r['rel_l1']:.4f} | "
                         f"{r['repeat_ok']} | {r['device_ok']} | {'pass' if r['pass'] else 'FAIL'} |")
    for r in rows_captured:
        detail = r.get("error") or (f"greedy tokens equal: {r['tokens_equal']}; max logit difference / logit range "
                                    f"{r['logit_err']:.2e}; tokens cached (eager, captured, device count) {r['length']}")
        lines += ["", f"{r['case']}: {detail} — {'pass' if r['pass'] else 'FAIL'}"]
    text = "\n".join(lines)
    path = report.write(pathlib.Path(args.out) / f"check-decode-{gpu.replace(' ', '-')}-{date}.md", text)
    print()
    print(text)
    print(f"\nwritten: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
