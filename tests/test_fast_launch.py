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


def test_disabled_launcher_calls_the_kernel_unchanged(monkeypatch):
    monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", "0")  # off (it is under the interpreter too)
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "launched"

    launcher = fast_launch.fast(Kernel())
    assert launcher is fast_launch.fast(launcher.jit_fn)  # one launcher per kernel
    assert launcher[(3, 2)](1, 2.0, BLOCK=16) == "launched"  # pass-through
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


class _Compiled:
    """A stand-in compiled kernel: records the arguments its launcher is called with."""

    function = packed_metadata = None

    def __init__(self, name):
        self.name, self.runs = name, []

    def run(self, *args):
        self.runs.append(args[9:])  # after grid, stream, function, metadata and the three hooks


def _memo_launcher(monkeypatch, kernels):
    """A FastLauncher of a two-parameter kernel ``f(x, N, BLOCK)`` with the direct path forced on the CPU; its
    Triton launch (a miss) hands out ``kernels`` in turn."""
    monkeypatch.setattr(fast_launch, "_VERSION_OK", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    given = iter(kernels)

    class Jit:
        params = None
        __name__ = "f"

        @staticmethod
        def fn(x, N, BLOCK=4):  # noqa: N803 - the kernel's signature
            pass

        def __getitem__(self, grid):
            return lambda *args, **kwargs: next(given)

    return fast_launch.FastLauncher(Jit())


def test_memo_launch_binds_once_and_runs_with_each_calls_arguments(monkeypatch):
    first = _Compiled("first")
    launcher = _memo_launcher(monkeypatch, [first, _Compiled("second")])
    memo = {}
    x, y = torch.zeros(4), torch.ones(4)
    assert launcher.launch_memo(memo, "key", (x,), (2,), (x, 5), {"BLOCK": 8}) is first  # a miss: Triton's launch
    assert list(memo) == ["key"] and memo["key"][2] == (x,)
    assert launcher.launch_memo(memo, "key", (x,), (2,), (y, 6), {"BLOCK": 8}) is first  # a hit: the direct run
    assert first.runs == [(y, 6, 8)] and launcher.direct == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # another device: its own kernel, the full path
    assert launcher.launch_memo(memo, "key", (x,), (2,), (y, 7), {"BLOCK": 8}).name == "second"
    assert first.runs == [(y, 6, 8)] and launcher.direct == 1


def test_memo_launch_check_mode_catches_a_key_that_stands_for_two_kernels(monkeypatch):
    launcher = _memo_launcher(monkeypatch, [_Compiled("a"), _Compiled("b")])
    memo = {}
    launcher.launch_memo(memo, "key", (), (1,), (torch.zeros(4), 5), {"BLOCK": 8})
    monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", "check")
    monkeypatch.setattr(launcher, "_specialization", lambda *args: None)  # Triton's binder needs a GPU
    with pytest.raises(RuntimeError, match="memo key stood for two kernels"):
        launcher.launch_memo(memo, "key", (), (1,), (torch.zeros(4), 5), {"BLOCK": 16})  # BLOCK not in the key


def test_memo_launch_stores_nothing_when_the_fast_path_is_off(monkeypatch):
    launcher = _memo_launcher(monkeypatch, [_Compiled("a")])
    monkeypatch.setenv("HF_QATTN_FAST_LAUNCH", "0")
    memo = {}
    launcher.launch_memo(memo, "key", (), (1,), (torch.zeros(4), 5), {})
    assert memo == {} and launcher.direct == 0
