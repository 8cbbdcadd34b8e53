"""Compile the attention kernel for a GPU target on any machine (no GPU needed) and report its resources.

    python eval/inspect_kernel.py [--arch 90] [--d 128] [--block-m 64] [--block-n 128] [--warps 4] [--stages 3]

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
        "O": f"*{dtype}", "LSE": "constexpr",
        "stride_qb": "i32", "stride_qh": "i32", "stride_qn": "i32", "stride_qd": "constexpr",
        "stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32", "stride_od": "constexpr",
        "HQ": "i32", "GROUPS": "i32", "NQ": "i32", "NK": "i32", "NK_PAD": "i32", "NUM_TILES": "i32",
        "score_coef": "fp32",
    }
    constexprs = {"KV_START": None, "KV_END": None, "LSE": None, "stride_qd": 1, "stride_od": 1,
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
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fp16-pv", action="store_true")
    p.add_argument("--dump", help="write the SASS here")
    a = p.parse_args()
    kernel = compile_attention(a.arch, a.d, a.block_m, a.block_n, a.warps, a.stages, a.causal, not a.fp16_pv)
    print(report(kernel, a.arch))
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass_of(kernel.asm["cubin"]))
        with open(a.dump + ".ttgir", "w") as f:
            f.write(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
