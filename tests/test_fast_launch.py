"""kernels/fast_launch.py on the CPU: the specialization key and the pass-through paths.

The direct launch itself needs a GPU: eval/check_fast_launch.py compares it with Triton's launch bit
for bit on the H100, and eval/check_device.py / check_decode.py run with HF_QATTN_FAST_LAUNCH=check.
"""

from __future__ import annotations

import pytest
import torch

fast_launch = pytest.importorskip("hf_qattn.kernels.fast_launch")


def test_int_key_separates_what_triton_specializes_on():
    keys = {n: fast_launch._arg_key(n) for n in (1, 2, 16, 17, 32, 2 ** 31, -(2 ** 31) - 1)}
    assert keys[1] != keys[2]  # 1 is a constant
    assert keys[16] != keys[17]  # divisibility by 16
    assert keys[16] == keys[32] and keys[2] == keys[17]
    assert keys[2 ** 31] != keys[17] and keys[-(2 ** 31) - 1] != keys[17]  # 64-bit ints
    assert fast_launch._arg_key(True) != fast_launch._arg_key(1)


def test_tensor_key_is_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.float16)
    assert fast_launch._arg_key(base) == fast_launch._arg_key(torch.ones(8, dtype=torch.float16))
    assert fast_launch._arg_key(base) != fast_launch._arg_key(base.to(torch.bfloat16))
    assert fast_launch._arg_key(base[1:]) != fast_launch._arg_key(base)  # 2-byte offset: not 16-aligned
    assert fast_launch._arg_key(base[8:]) == fast_launch._arg_key(base)  # 16-byte offset: aligned


def test_off_under_the_interpreter_and_by_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fast_launch.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", "0")
    assert not fast_launch.enabled()


def test_the_by_type_key_equals_the_general_key():
    """The launch keys its arguments through a table of exact types; every value — subclasses, descriptors
    and constexpr-like values included — gets the key the general rule gives it."""
    class Descriptor:
        def __init__(self, base):
            self.base, self.block_shape, self.layout = base, [16, 32], "nvmma"

    base = torch.zeros(64, dtype=torch.float16)
    values = (None, True, False, 1, 17, 32, 2 ** 33, 0.5, base, base[1:], torch.nn.Parameter(base.clone()),
              Descriptor(base), "constexpr", (3, 4))
    assert fast_launch._args_key(values, frozenset()) == tuple(fast_launch._arg_key(v) for v in values)
    assert fast_launch._args_key((True,), frozenset()) != fast_launch._args_key((1,), frozenset())


def test_ints_the_kernel_does_not_specialize_on_share_one_key():
    """The decode kernel's per-step ints (key count, split length, split count) are keyed by type only,
    as Triton keys them: a key count of 48 after 47 finds the kernel already compiled."""
    from hf_qattn.kernels import decode

    launcher = fast_launch.FastLauncher(decode.decode_kernel)
    names = {decode.decode_kernel.arg_names[i] for i in launcher.plain}
    assert names == {"NK", "SPLIT_LEN", "NUM_SPLITS"}
    nk = min(launcher.plain)
    args = [0] * (nk + 1)
    keys = {fast_launch._args_key(tuple(args[:nk]) + (n,), launcher.plain) for n in (1, 16, 17, 48, 2 ** 33)}
    assert len(keys) == 1
    assert fast_launch._args_key((16,), frozenset()) != fast_launch._args_key((17,), frozenset())


def test_disabled_launcher_calls_the_kernel_unchanged():
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "launched"

    launcher = fast_launch.fast(Kernel())
    assert launcher is fast_launch.fast(launcher.jit_fn)  # one launcher per kernel
    assert launcher[(3, 2)](1, 2.0, BLOCK=16) == "launched"  # the tests run under the interpreter: pass-through
    assert calls == [((3, 2), (1, 2.0), {"BLOCK": 16})]
    assert launcher.direct == 0


def test_hook_chain_counts_as_set_only_when_it_holds_a_hook():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not fast_launch._hooked(None)
    assert not fast_launch._hooked(Chain([]))
    assert fast_launch._hooked(Chain([print]))
    assert fast_launch._hooked(print)
