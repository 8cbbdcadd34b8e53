"""Launch a compiled Triton/Gluon kernel with a fraction of ``kernel[grid](...)``'s host time.

Why: on the H100's host, Triton 3.6's JIT launch costs 36 / 40 / 82 µs for the centers, K/V and
Hopper attention kernels of one qattn call, of which the compiled kernel's own launcher needs
10 / 13 / 28 µs (``eval/results/host-overhead-*.md``); the rest is binding the arguments, building
the cache key and looking the kernel up. A qattn call is three launches, a decode step two per
layer, so at short sequences the host, not the GPU, sets the pace.

How: the first launch for a *specialization key* goes through Triton (it compiles if needed) and
the compiled kernel is kept under that key; later launches with the same key call its launcher
directly. The key holds everything Triton specializes a kernel on, computed from the arguments:
for an int whether it is 1, divisible by 16, or needs 64 bits; for a tensor its dtype and whether
its address is 16-byte aligned; for a TMA descriptor its type, dtype, block shape and layout;
``None`` / bool / float by type and (bools, constexprs) value; plus the keyword arguments
(constexprs and launch options) as given.

Only for triton versions this was checked against on a GPU (:data:`VALIDATED`; the device check
``eval/check_device.py`` compares both paths bit for bit and asserts Triton's binder agrees with
the key); anything else, the interpreter, and launches with Triton's profiling hooks set go
through ``kernel[grid](...)`` unchanged. ``HF_QATTN_FAST_LAUNCH=0`` turns it off;
``HF_QATTN_FAST_LAUNCH=check`` also runs Triton's binder on every launch and raises if its
specialization differs from the one the key stood for.
"""

from __future__ import annotations

import inspect

import torch
import triton

from . import settings, tuning

VALIDATED = ("3.6.",)
_I32_MAX = 2 ** 31 - 1


def _mode() -> str:
    return settings.fast_launch_mode()


_VERSION_OK = triton.__version__.startswith(VALIDATED)


def enabled(mode: str | None = None) -> bool:
    """Whether launches may skip Triton's path (``mode``: the switch's value, read once by the caller)."""
    return (_mode() if mode is None else mode) != "0" and _VERSION_OK and not tuning.interpreting()


def _int_key(value: int) -> int:
    return (value == 1) | ((value % 16 == 0) << 1) | ((not -_I32_MAX - 1 <= value <= _I32_MAX) << 2)


def _tensor_key(value: torch.Tensor):
    return value.dtype, value.data_ptr() % 16 == 0


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _args_key(args: tuple, plain: frozenset) -> tuple:
    """The key of the positional arguments; those at the ``plain`` positions (the kernel's
    ``do_not_specialize`` ints) by type only, as Triton keys them. One loop with the common types inline
    (``_int_key``, ``_tensor_key``, ``_arg_key`` as they would answer): it runs on every launch, and a
    function call per argument was most of a decode launch's host time (eval/results/host-overhead-*.md)."""
    key = []
    add = key.append
    for i, value in enumerate(args):
        kind = type(value)
        if kind is int:
            add(int if i in plain else
                (value == 1) | ((value % 16 == 0) << 1) | ((not -_I32_MAX - 1 <= value <= _I32_MAX) << 2))
        elif kind in _TENSOR_TYPES:
            add((value.dtype, value.data_ptr() % 16 == 0))
        elif value is None:
            add(None)
        elif kind is float:
            add(float)
        else:
            add(_arg_key(value))
    return tuple(key)


def _arg_key(value):
    """What Triton's specialization can depend on for one argument."""
    if value is None:
        return None
    if isinstance(value, bool):  # an i1 argument, not an int (and True == 1 in a dict key)
        return bool, value
    if isinstance(value, int):
        return _int_key(value)
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, float):
        return float
    block_shape = getattr(value, "block_shape", None)
    if block_shape is not None:  # a TMA descriptor (triton.tools or Gluon)
        return type(value), value.base.dtype, tuple(block_shape), getattr(value, "layout", None)
    return value  # constexpr-like values: hashable, compared by value


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps a ``HookChain`` there, empty unless a profiler adds one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _plain_positions(jit_fn) -> frozenset:
    """Positions of the kernel's ``do_not_specialize`` parameters (a JIT function lists them in its
    params; the interpreter's wrapper keeps the decorator's arguments)."""
    params = getattr(jit_fn, "params", None)
    if params is not None:
        return frozenset(p.num for p in params if p.do_not_specialize)
    plain = getattr(jit_fn, "kwargs", {}).get("do_not_specialize") or ()
    return frozenset(n if isinstance(n, int) else list(jit_fn.arg_names).index(n) for n in plain)


class FastLauncher:
    """``FastLauncher(jit_fn)[grid](*args, **kwargs)`` launches like ``jit_fn[grid](*args, **kwargs)``."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.kernels: dict = {}
        self._names = None
        self._defaults = None
        self.direct = 0  # launches that skipped Triton's path (the device check asserts there are some)
        self.plain = _plain_positions(jit_fn)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _params_tail(self, args, kwargs) -> tuple:
        """The values of the parameters after the positional ones, in signature order (constexprs included: the
        launcher skips them) — the same for every launch of one key, whose kwargs it holds."""
        if self._names is None:
            signature = inspect.signature(self.jit_fn.fn)
            self._names = list(signature.parameters)
            self._defaults = {name: p.default for name, p in signature.parameters.items()}
        defaults = self._defaults
        return tuple(kwargs[name] if name in kwargs else defaults[name] for name in self._names[len(args):])

    def launch(self, grid, args: tuple, kwargs: dict):
        mode = _mode()
        runtime = triton.knobs.runtime
        if not enabled(mode) or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return self.jit_fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, _args_key(args, self.plain), tuple(kwargs.items()))
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.jit_fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # Triton's asynchronous compile mode
                kernel = kernel.result()
            self.kernels[key] = (kernel, self._specialization(device, args, kwargs), self._params_tail(args, kwargs))
            return kernel
        kernel, specialization, tail = kernel
        if mode == "check" and self._specialization(device, args, kwargs) != specialization:
            raise RuntimeError(f"fast launch of {self.jit_fn.__name__}: the key missed a specialization change")
        return self._run(kernel, tail, device, grid, args)

    def launch_memo(self, memo: dict, memo_key, keep: tuple, grid, args: tuple, kwargs: dict):
        """:meth:`launch`, remembered in the caller's ``memo`` under ``memo_key``: the caller's promise that every
        launch with that key specializes alike (tensors of the same dtypes and 16-byte alignment, ints of the same
        classes, the same ``kwargs``). A hit skips the key over every argument (at fifty arguments most of a
        decode step's launch time on the host) and calls the compiled kernel's launcher. ``keep``: the objects
        whose ``id`` the key holds, kept alive with the entry so that no other object can take that id. An entry
        serves the device it was made on (a kernel is loaded per device); on another, the full path runs.
        ``HF_QATTN_FAST_LAUNCH=check`` takes the full path every time and raises if it found another kernel than
        the memo holds (the promise broken)."""
        entry = memo.get(memo_key)
        mode = _mode()
        runtime = triton.knobs.runtime
        device = torch.cuda.current_device() if _VERSION_OK else None  # the kernel is loaded per device
        if (entry is None or entry[3] != device or mode != "1" or not _VERSION_OK
                or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)):
            kernel = self.launch(grid, args, kwargs)
            if entry is not None and entry[3] == device and mode == "check" and entry[0] is not kernel:
                raise RuntimeError(f"fast launch of {self.jit_fn.__name__}: a memo key stood for two kernels")
            if entry is None and enabled(mode):
                memo[memo_key] = (kernel, self._params_tail(args, kwargs), keep, device)
            return kernel
        return self._run(entry[0], entry[1], device, grid, args)

    def _run(self, kernel, tail: tuple, device: int, grid, args: tuple):
        """The direct launch: the compiled kernel's own launcher, on the current stream (what Triton's launch asks)."""
        self.direct += 1
        g = tuple(grid) + (1,) * (3 - len(grid))
        kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *tail)
        return kernel

    def _specialization(self, device, args, kwargs):
        """Triton's own specialization of this launch (for ``check`` mode), or None when not checking."""
        if _mode() != "check":
            return None
        binder = self.jit_fn.device_caches[device][4]
        options = {"debug": False, **kwargs}
        _, specialization, _ = binder(*args, **options)
        return repr(specialization)


_LAUNCHERS: dict = {}


def fast(jit_fn) -> FastLauncher:
    """The launcher of ``jit_fn`` (one per kernel, so its compiled kernels are shared by every caller)."""
    launcher = _LAUNCHERS.get(id(jit_fn))
    if launcher is None or launcher.jit_fn is not jit_fn:
        launcher = _LAUNCHERS[id(jit_fn)] = FastLauncher(jit_fn)
    return launcher


def direct_launches() -> int:
    """Launches so far that went straight to a compiled kernel's launcher."""
    return sum(launcher.direct for launcher in _LAUNCHERS.values())
