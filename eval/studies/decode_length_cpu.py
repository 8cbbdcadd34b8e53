"""The decode kernel at user lengths on a CPU (Triton interpreter): the cache filled by the append kernel, one decode
step over many splits (the last split program merges them four a step), against float64 attention over the original
K and V, with V of mean 0.3 and with zero-mean V (whose output is the part attention selects).

    python eval/studies/decode_length_cpu.py 75600,131072
    KERNEL_VARIANT=decode:OLD_decode.py python eval/studies/decode_length_cpu.py 131072   # another tree's kernel

The interpreter's dots run in fp32 (kernels/decode.py ``_scores``), so this checks the tiles, masks, splits and
their merge at length, not the GPU's fp16 / bf16 tensor-core numerics (eval/accuracy_length.py --cache does, on a
GPU). B1, Hq 8 / Hk 2, d64, K with channel offsets, 64 splits. Results: eval/results/accuracy-length-cache-*.md.
"""

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # eval/: shared helpers
import kernel_variant  # noqa: E402

kernel_variant.use_from_env()  # before hf_qattn: KERNEL_VARIANT=decode:FILE
import torch  # noqa: E402

from bench_decode import exact_decode  # noqa: E402  (float64 attention, eval/bench_decode.py)
from hf_qattn.kernels import decode_launch  # noqa: E402
from hf_qattn.kv_cache import reference as kv_reference  # noqa: E402


def main(lengths: str) -> None:
    print(f"decode kernel from {kernel_variant.loaded_from('decode')}")
    torch.manual_seed(0)
    b, hq, hk, d = 1, 8, 2, 64
    for n in map(int, lengths.split(",")):
        for v_mean in (0.3, 0.0):
            for precision in ("int8", "int4"):
                k = torch.randn(b, hk, n, d) + torch.linspace(-2, 2, d)
                v = torch.randn(b, hk, n, d) + v_mean
                q = torch.randn(b, hq, 1, d)
                k_bar, v_bar = kv_reference.centers(k, v)
                buffers = kv_reference.allocate(b, hk, n, d, precision, "cpu", torch.float32)
                kv_reference.set_equalizers(buffers, k, v, k_bar, v_bar)
                decode_launch.append(k, v, k_bar, v_bar, buffers, 0)
                start = time.time()
                out = decode_launch.decode(q, buffers, v_bar, n, num_splits=64).double()
                ref = exact_decode(q, k, v)
                rel_l1 = ((out - ref).abs().sum() / ref.abs().sum()).item()
                cos = torch.nn.functional.cosine_similarity((out - v_mean).flatten(), (ref - v_mean).flatten(),
                                                            dim=0).item()
                print(f"| {n} | {v_mean} | {precision} | {rel_l1:.4f} | {cos:.6f} | {time.time() - start:.0f} s |",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "4096,131072")
