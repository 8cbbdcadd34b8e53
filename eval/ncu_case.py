"""One kernel case run a few times, for Nsight Compute to profile (what bounds a kernel, measured).

    ncu --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 eval/ncu_case.py decode-int8

Cases: ``decode-int8`` / ``decode-int4`` / ``decode-int8g`` (one decode step, B8 Hq32/Hk8 L64k d128, bf16 queries, the
launcher's split plan); ``prefill-<shape>`` (qattn on the Hopper path: the centers, K/V-pass and attention
kernels), ``cudnn-<shape>`` (SDPA's cuDNN backend) and ``sage2-<shape>`` (SageAttention2's sm90 kernel, where
built: eval/build_sageattention.sh), shapes 1k, 8k, 8k-causal, 4k-d64, 32k (B4 H32 fp16) and wan (B1 H40 75,600
tokens bf16; see PREFILL). Each case runs 5 times; skip the first launches (compilation) in ncu.
"""

from __future__ import annotations

import sys

import torch


# prefill shapes: name → (label, N, head dim, causal, batch, heads, dtype)
PREFILL = {"1k": ("d128 N1k", 1024, 128, False, 4, 32, torch.float16),
           "8k": ("d128 N8k", 8192, 128, False, 4, 32, torch.float16),
           "8k-causal": ("d128 N8k causal", 8192, 128, True, 4, 32, torch.float16),
           "4k-d64": ("d64 N4k", 4096, 64, False, 4, 32, torch.float16),
           "32k": ("d128 N32k", 32768, 128, False, 4, 32, torch.float16),
           "wan": ("Wan-14B-720p-like", 75600, 128, False, 1, 40, torch.bfloat16)}


def main(case: str) -> None:
    torch.manual_seed(0)
    if case.startswith("decode"):
        from hf_qattn.kv_cache import reference as kv_reference
        from hf_qattn.kernels import decode_launch

        precision = case.split("-", 1)[1]
        b, hq, hk, n, d = 8, 32, 8, 65536, 128
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k_bar, v_bar = kv_reference.centers(k, v)
        buf = kv_reference.allocate(b, hk, n, d, precision, "cuda", k.dtype)
        decode_launch.append(k, v, k_bar, v_bar, buf, 0)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            decode_launch.decode(q, buf, v_bar, n)
    elif case.startswith(("prefill-", "cudnn-", "sage2-")):
        import hf_qattn

        _, n, d, causal, b, h, dtype = PREFILL[case.split("-", 1)[1]]
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        if case.startswith("sage2-"):
            from sageattention import sageattn_qk_int8_pv_fp8_cuda_sm90
        for _ in range(5):
            if case.startswith("prefill-"):
                hf_qattn.qattn(q, k, v, is_causal=causal)
            elif case.startswith("sage2-"):
                sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="HND", is_causal=causal)
            else:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        raise SystemExit(f"unknown case {case!r}: decode-int8, decode-int4, decode-int8g, "
                         f"prefill-/cudnn-/sage2- + {list(PREFILL)}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
