"""Compile the attention kernel or the decode kernel for a GPU target on any machine (no GPU needed) and report its
resources.

    python eval/inspect_kernel.py [--arch 90] [--d 128] [--block-m 64] [--block-n 128] [--warps 4] [--stages 3]
    python eval/inspect_kernel.py --decode int4 [--d 64] [--groups 4] [--nq 1] [--model-dtype fp32]
                                  [--warps 2] [--stages 2] [--maxnreg 128] [--rows-tile] [--no-v-staged]

The decode kernel builds with kernels.json's launch for that cache format and head dim (``decode_launch``) unless
overridden, one split of a step over the cache (several splits, no variant switches); ``--rows-tile``: the query
rows as the dots' rows whatever KEYS_AS_ROWS_UP_TO says. Its report adds each loop of the SASS (a backward branch
closes one) with its instruction count: the main loop's is a key tile's cost.

Prints registers, spills, shared memory and a count of the instructions that matter in the SASS
(tensor-core MMAs, exp2, int→float conversions, shared-memory traffic), so tile and code changes
can be judged before spending GPU time. Uses the ptxas/nvdisasm that ship with Triton.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_qattn.kernels.attention import attention_kernel


def compile_attention(arch, d, block_m, block_n, warps, stages, causal=False, v_fp8=True, k_token=False,
                      dtype="fp16"):
    d_pad = max(32, 1 << (d - 1).bit_length())
    v_ty = "fp8e4nv" if v_fp8 else "fp16"
    signature = {
        "Q": f"*{dtype}", "kq_desc": f"tensordesc<i8[{block_n}, {d_pad}]>", "KS": "*fp32",
        "vq_desc": f"tensordesc<{v_ty}[{d_pad}, {block_n}]>", "VS": "*fp32", "DS": "*fp32",
        "Q_BAR": "*fp32", "K_BAR": "*fp32", "V_BAR": "*fp32", "KV_START": "constexpr", "KV_END": "constexpr",
        "O": f"*{dtype}", "LSE": "constexpr", "KC": "*fp32", "SPLIT_CHANNEL": "*i32", "SINKS": "*fp32",
        "WINDOW": "i32", "CHUNK": "i32", "cap_scale": "fp32", "cap_exp": "fp32",
        "stride_qb": "i32", "stride_qh": "i32", "stride_qn": "i32", "stride_qd": "constexpr",
        "stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32", "stride_od": "constexpr",
        "HQ": "i32", "GROUPS": "i32", "NQ": "i32", "NK": "i32", "NK_PAD": "i32", "NUM_TILES": "i32",
        "score_coef": "fp32",
    }
    # the plain kernel: no split channel, window, chunk, sinks or soft-cap (their switches off)
    constexprs = {"KV_START": None, "KV_END": None, "LSE": None, "SPLIT": False, "HAS_WINDOW": False, "HAS_CHUNK": False, "SINKS_ON": False, "SOFTCAP": False,
                  "ROW_LO": False, "ROW_TERM": False, "stride_qd": 1, "stride_od": 1,
                  "HEAD_DIM": d, "D_PAD": d_pad, "BLOCK_M": block_m, "BLOCK_N": block_n, "Q_GROUP": 16,
                  "QK_MAX": 127.0, "CAUSAL": causal, "HAS_KV_RANGE": False, "K_TOKEN_SCALE": k_token,
                  "V_FP8": v_fp8, "P_LOG2": 8.807354922057604 if v_fp8 else 0.0, "RETURN_LSE": False,
                  "GRID_ROUND": False}
    for name in constexprs:
        signature.setdefault(name, "constexpr")
    names = attention_kernel.arg_names
    aligned = {"Q", "KS", "VS", "DS", "Q_BAR", "K_BAR", "V_BAR", "O", "stride_qb", "stride_qh", "stride_qn",
               "stride_ob", "stride_oh", "stride_on", "NK_PAD"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(attention_kernel, {n: signature[n] for n in names}, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def compile_decode(arch, precision, d, groups, nq, model_dtype="bf16", warps=None, stages=None, maxnreg=None,
                   rows_tile=False, v_staged=None):
    """decode_kernel for a ``precision`` cache ("int8", "int4", "int8g") of head dim ``d`` under a GQA group of
    ``groups`` query heads, ``nq`` query tokens a step; the launch kernels.json gives unless overridden."""
    from hf_qattn.kernels import decode_launch
    from hf_qattn.kernels.decode import decode_kernel

    d_pad = max(32, 1 << (d - 1).bit_length())
    launch = decode_launch._default_launch(precision, d_pad, False)
    qt, rows, keys_as_rows = decode_launch.tile_rows(groups, nq, False, 0 if rows_tile else
                                                     launch.get("KEYS_AS_ROWS_UP_TO", 0))
    options = decode_launch.kernel_options(precision, d, False, rows=rows, num_warps=warps, num_stages=stages,
                                           maxnreg=maxnreg)
    staged = decode_launch._default_launch(precision, d_pad, False, rows).get("V_STAGED", False)
    grouped, g8 = precision in ("int4", "int8g"), precision == "int8g"
    floats = f"*{model_dtype}"
    pointers = {"Q": floats, "KQ": "*u8" if g8 else "*i8", "KS": "*bf16" if grouped else "*fp32",
                "VQ": "*u8", "VS": "*bf16" if g8 else "*fp32", "KR": floats, "VR": floats,
                "V_BAR": "*fp32", "K_EQ": "*bf16", "V_EQ": "*bf16", "O": floats, "PART_O": "*fp32",
                "PART_M": "*fp32", "PART_L": "*fp32", "COUNTER": "*i32"}
    constexprs = {"KV_START": None, "KV_END": None, "LEN": None, "K_BAR": None, "SINKS": None, "stride_qd": 1,
                  "stride_od": 1, "GROUPS": groups, "QT": qt, "HEAD_DIM": d, "D_PAD": d_pad, "BLOCK_M": rows,
                  "BLOCK_N": 64, "INT4": precision == "int4", "G8": g8, "CAUSAL": nq > 1, "HAS_KV_RANGE": False,
                  "SPLIT": True, "INTERPRET": False, "DEVICE_LEN": False, "SOFTCAP": False, "HAS_SINKS": False,
                  "WINDOW": False, "CHUNK": False, "RING": False,
                  "V_STAGED": staged if v_staged is None else v_staged, "KEYS_AS_ROWS": keys_as_rows}
    names = decode_kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in ("score_coef", "softcap2")
                                                                     else "i32") for n in names}
    # pointers 16-byte aligned, strides multiples of 16 (contiguous rows of a head dim ≥ 32), as a cache's
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or (n.startswith("stride") and n not in constexprs)}
    src = ASTSource(decode_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_stages": 3, **options})


def loops(sass: str) -> list:
    """(first address, instructions, local loads, the commonest opcodes) of each loop of ``sass`` over 100
    instructions: the span from a backward branch's target to the branch."""
    labels, code, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        inst = re.match(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)", line)
        if inst:
            address = int(inst.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            code.append((address, inst.group(2), inst.group(3)))
    found = []
    for address, op, rest in code:
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and target and labels.get(target.group(1), address) < address:
            body = [c[1] for c in code if labels[target.group(1)] <= c[0] <= address]
            if len(body) > 100:
                ops = collections.Counter(body)
                found.append((labels[target.group(1)], len(body), ops["LDL"], ops.most_common(8)))
    return found


def sass_of(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout


def ptxas_resources(kernel, arch) -> dict:
    """Registers, spill bytes and stack of the kernel, from ptxas -v on its PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        suffix = "a" if arch == 90 else ""
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"regs": int(regs.group(1)) if regs else log[-300:], "spill_bytes": sum(map(int, spill)),
            "stack": int(stack.group(1)) if stack else 0}


def report(kernel, arch=90) -> dict:
    sass = sass_of(kernel.asm["cubin"])
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?",
                                         sass, flags=re.M))
    keep = ["HGMMA", "IGMMA", "QGMMA", "HMMA", "IMMA", "MUFU", "I2F", "F2FP", "F2F", "LDS", "STS", "LDSM", "STSM",
            "LDG", "STG", "UTMALDG", "SYNCS", "BAR", "WARPGROUP", "LDL", "STL", "FFMA", "FMUL", "FADD", "FMNMX",
            "IADD3", "SHFL"]
    return {**ptxas_resources(kernel, arch), "shared": kernel.metadata.shared,
            **{op: ops.get(op, 0) for op in keep if ops.get(op, 0)}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--warps", type=int, help="default 4, or for --decode kernels.json's")
    p.add_argument("--stages", type=int, help="default 3, or for --decode kernels.json's")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fp16-pv", action="store_true")
    p.add_argument("--dump", help="write the SASS here")
    p.add_argument("--decode", choices=["int8", "int4", "int8g"], help="the decode kernel over a cache of this format")
    p.add_argument("--groups", type=int, default=4, help="decode: query heads a KV head")
    p.add_argument("--nq", type=int, default=1, help="decode: query tokens a step")
    p.add_argument("--model-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="decode: q, O, recent rows")
    p.add_argument("--maxnreg", type=int, help="decode: register cap (0: none); default kernels.json's")
    p.add_argument("--rows-tile", action="store_true", help="decode: the query rows as the dots' rows")
    p.add_argument("--no-v-staged", action="store_true", help="decode: V's tile not staged in shared memory")
    a = p.parse_args()
    if a.decode:
        kernel = compile_decode(a.arch, a.decode, a.d, a.groups, a.nq, a.model_dtype, a.warps, a.stages, a.maxnreg,
                                a.rows_tile, False if a.no_v_staged else None)
    else:
        kernel = compile_attention(a.arch, a.d, a.block_m, a.block_n, a.warps or 4, a.stages or 3, a.causal,
                                   not a.fp16_pv)
    print(report(kernel, a.arch))
    if a.decode:
        for address, count, local_loads, ops in loops(sass_of(kernel.asm["cubin"])):
            print(f"loop at {address:#x}: {count} instructions, {local_loads} local loads;",
                  " ".join(f"{op} {n}" for op, n in ops))
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass_of(kernel.asm["cubin"]))
        with open(a.dump + ".ttgir", "w") as f:
            f.write(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
