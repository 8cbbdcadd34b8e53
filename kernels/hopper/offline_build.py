"""Compile the Hopper kernel for sm_90 on any machine (no GPU needed) and read what ptxas made of it.

Used by the tests (every shipped configuration must hold the INT8 and FP8 wgmma and the TMA load,
and spill nothing) and by ``eval/inspect_kernel.py --hopper``. The triton wheel ships ptxas and
nvdisasm, so this runs on a CPU-only machine.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from ..formats import P_LOG2_FP8


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(head_dim: int = 128, causal: bool = False, k_token_scale: bool = False, stages: int | None = None,
                 return_lse: bool = False, has_kv_range: bool = False, dtype: str = "fp16",
                 persistent: bool = False, split: bool = False, pv_tiles: int | None = None,
                 window: bool = False, chunk: bool = False, sinks: bool = False, softcap: bool = False,
                 block_n: int | None = None, d_pad: int | None = None, causal_split: bool | None = None,
                 keys: int = 4096, solo: bool | None = None):
    """The compiled kernel (``.asm`` holds ptx, cubin) for one configuration. ``window``, ``chunk``, ``sinks``,
    ``softcap``: the attention variants' switches (their sizes are runtime arguments). ``block_n`` / ``d_pad``
    override the tuned tile and padded head dim (to try configurations not shipped); ``stages`` and ``pv_tiles``
    default to the tuned ones (kernels.json); ``causal_split``: the causal main loop split at the diagonal (as
    tuning.hopper_causal_split picks for a call over ``keys`` keys unless given); ``solo``: the one-warpgroup CTA
    that loads its own tiles (hopper/mainloop.attend_solo; as tuning.hopper_solo picks unless given, or unless
    ``pv_tiles`` is given), else the warp-specialized CTA of two consumer warpgroups."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from .attention import attention_kernel
    from .gluon_api import gl

    from .. import tuning

    d_pad = d_pad or tuning.padded_head_dim(head_dim)
    block_n = block_n or tuning.hopper_config(head_dim)["BLOCK_N"]
    variant = window or chunk or sinks or softcap
    solo, consumers, stages, maxnreg = tuning.hopper_cta_shape(head_dim, persistent=persistent, variant=variant,
                                                               solo=solo, pv_tiles=pv_tiles, stages=stages)
    pv_tiles = tuning.hopper_config(head_dim)["PV_TILES"] if pv_tiles is None else pv_tiles
    if causal_split is None:
        causal_split = tuning.hopper_causal_split(head_dim, causal=causal, variant_span=window or chunk, keys=keys)

    def descriptor(type_name, gl_type, shape):
        layout = gl.NVMMASharedLayout.get_default_for(shape, gl_type)
        return f"tensordesc<{type_name}[{shape[0]}, {shape[1]}],{layout!r}>"

    def descriptor1d(type_name, gl_type, size):
        layout = gl.NVMMASharedLayout.get_default_for([size], gl_type)
        return f"tensordesc<{type_name}[{size}],{layout!r}>"

    signature = {
        "Q": f"*{dtype}", "k_desc": descriptor("i8", gl.int8, [block_n, d_pad]), "KS": "*fp32", "SPLIT_CHANNEL": "*i32",
        "ds_desc": descriptor1d("fp32", gl.float32, block_n),
        "vt_desc": descriptor("fp8e4nv", gl.float8e4nv, [d_pad, block_n]),
        "Q_BAR": "*fp32", "K_BAR": "*fp32", "V_BAR": "*fp32", "V_SCALE": "*fp32",
        "KV_END": "*i32", "O": f"*{dtype}", "LSE": "*fp32",
        "stride_qb": "i32", "stride_qh": "i32", "stride_qn": "i32", "stride_qd": "i32",
        "stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32", "stride_od": "i32",
        "HQ": "i32", "GROUPS": "i32", "NQ": "i32", "NK": "i32", "NK_PAD": "i32", "NUM_TILES": "i32", "NUM_ITEMS": "i32",
        "KC_ROW0": "i32", "score_coef": "fp32", "sm_scale": "fp32",
        "window": "i32", "chunk": "i32", "SINK": "*fp32", "softcap": "fp32",
    }
    constexprs = {"HEAD_DIM": head_dim, "D_PAD": d_pad, "BLOCK_N": block_n, "STAGES": stages, "QK_MAX": 127.0,
                  "CAUSAL": causal, "HAS_KV_RANGE": has_kv_range, "K_TOKEN_SCALE": k_token_scale,
                  "P_LOG2": P_LOG2_FP8, "RETURN_LSE": return_lse, "PERSISTENT": persistent, "SPLIT": split,
                  "PV_TILES": pv_tiles, "CONSUMERS": consumers, "WINDOW": window, "CHUNK": chunk, "SINKS": sinks,
                  "SOFTCAP": softcap, "CAUSAL_SPLIT": causal_split,
                  "V_DITHER": tuning.v_dither(softcap), "SOLO": solo,
                  "S_FLOAT_BY_ADD": tuning.hopper_s_float_by_add(head_dim, causal=causal, variant=variant,
                                                                 softcap=softcap, split=split) and not k_token_scale}
    for name in constexprs:
        signature[name] = "constexpr"
    names = attention_kernel.arg_names
    source = GluonASTSource(attention_kernel, {n: signature[n] for n in names}, constexprs=constexprs)
    options = {"num_warps": 4, **tuning.register_cap(maxnreg, interp=False)}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> dict:
    """Registers, spill bytes, stack frame and warnings from ptxas -v for sm_90a.

    Triton 3.9 emits PTX newer than its ``ptxas`` reads and ships ``ptxas-blackwell`` for it: the
    first of the two that assembles the PTX is used."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        for name in ("ptxas", "ptxas-blackwell"):
            if not os.path.exists(_tool(name)):
                continue
            run = subprocess.run([_tool(name), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(folder, "k.o")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"no ptxas assembled the kernel: {run.stderr[-500:]}")
    log = run.stderr
    regs = re.search(r"Used (\d+) registers", log)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", log))),
            "stack": int(m.group(1)) if (m := re.search(r"(\d+) bytes stack frame", log)) else 0,
            "warnings": [line.strip() for line in log.splitlines() if "arning" in line],
            "shared": kernel.metadata.shared}


def sass(kernel) -> str:
    """The kernel's SASS by nvdisasm, disassembled once per compiled kernel (the counts below all read it)."""
    if not hasattr(kernel, "_sass"):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            kernel._sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    return kernel._sass


def opcode_counts(kernel) -> collections.Counter:
    """How often each SASS opcode (without modifiers) appears."""
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)",
                                          sass(kernel), flags=re.M))


def loop_local_memory(kernel) -> list[int]:
    """Local-memory loads and stores (LDL/STL) in each main loop (one per consumer warpgroup): the
    innermost SASS loops that issue the FP8 wgmma. A loop is the range from a label to a later branch
    back to it, spanning no EXIT. Outside the main loops ptxas may keep a value such as the thread index in a stack slot
    without reporting a spill; that costs a load per work item, not per tile."""
    lines = sass(kernel).splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i and any("QGMMA" in b for b in lines[labels[target.group(1)]:i]):
            loops.append((labels[target.group(1)], i))
    # the branches back from the slow paths placed after the code (mbarrier retries) span an EXIT
    loops = [(a, b) for a, b in loops if not any("EXIT" in line for line in lines[a:b])]
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [sum(bool(re.search(r"\b(LDL|STL)\b", line)) for line in lines[a:b + 1]) for a, b in innermost]


if __name__ == "__main__":
    import json
    import sys

    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    k = compile_sm90(**args)
    ops = opcode_counts(k)
    print(json.dumps({**resources(k), "loop_LDL_STL": loop_local_memory(k), "instructions": sum(ops.values()),
                      **{op: ops[op] for op in ("IGMMA", "QGMMA", "UTMALDG", "MUFU", "LDL", "STL", "SHFL", "I2F",
                                                "F2FP", "PRMT") if ops[op]}}))
