"""Diffusers integration: route a denoiser's attention through :func:`hf_qattn.qattn`.

    pipe = FluxPipeline.from_pretrained(...)
    hf_qattn.patch(pipe)                      # plan from the transformer's config, else int8 everywhere
    image = pipe(prompt).images[0]
    hf_qattn.unpatch(pipe)                    # back to the original attention, bit for bit

    with hf_qattn.patch(pipe, plan=my_plan):  # or as a context manager
        ...

How calls are routed. Diffusers' attention backend registry (``attention_dispatch``) is closed:
its names are members of an ``Enum`` and ``set_attention_backend`` accepts only those, and
processors that call SDPA directly (CogVideoX, SD3, UNets) bypass it anyway. So the patch does not
replace processors or register a backend. It puts a forward pre-hook and a forward hook on every
attention module of the denoiser (its stable *layer index* is its position among the attention
modules in ``named_modules()`` order, see :func:`attention_layers`); while that module runs, a
``TorchFunctionMode`` catches its ``torch.nn.functional.scaled_dot_product_attention`` calls and
serves them with ``qattn`` at the precision the plan gives (layer, current step). Processors that
go through ``attention_dispatch`` are set to its ``native`` backend for the time of the patch (the
one that calls SDPA), whatever backend the user picked; ``unpatch`` restores it. Only the
denoiser's modules get hooks: VAE and text-encoder attention stay untouched.

Context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(...))``, ring or
Ulysses): the calls diffusers runs through its context-parallel template go to the same plan through
:mod:`.context_parallel` (the module says which hook it uses); the calls a processor makes without
its parallel config (Wan's cross-attention) are SDPA calls as above.

What falls back (full-precision SDPA, counted and warned once per reason by
:func:`hf_qattn.fallback_stats`): masks other than key-padding masks (those become the kernel's
``kv_start`` / ``kv_end``), head dims > 256, dropout or autograd, causal with Nq ≠ Nk,
and processors that compute attention without SDPA. A plan entry
``"unquantized"`` also runs SDPA, counted as an ``unquantized-by-plan`` call without a warning.

Limits: eager mode (torch.compile of the denoiser is untested with the hooks); attention computed
outside an attention module (no ``processor``) is not routed; the step tracking is described in
:mod:`hf_qattn.integrations.diffusers.steps`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import threading
import weakref
from collections.abc import Mapping

import torch
from torch.overrides import TorchFunctionMode

from ... import ops, stats, support
from ...plan import DEFAULT_PRECISION, LEGACY_SPELLINGS, PLAN_CONFIG_KEY, PRECISIONS, UNQUANTIZED, PlanError, QAttnPlan
from . import context_parallel
from .sdpa import SDPA, kernel_gap, run_qattn, sdpa_arguments
from .steps import DenoisingStepTracker, SchedulerHooks

DENOISER_NAMES = ("transformer", "transformer_2", "unet", "unet_2")
PLAN_FILE_NAME = "config.json"

__all__ = ["patch", "unpatch", "QAttnPatch", "attention_layers", "stored_plan", "store_plan", "load_plan",
           "DENOISER_NAMES"]


def _require_diffusers():
    try:
        import diffusers
    except ImportError as error:
        raise ImportError("hf_qattn's diffusers integration needs diffusers: pip install 'hf-qattn[diffusers]'") \
            from error
    return diffusers


def _attention_classes() -> tuple[type, ...]:
    """Diffusers' attention module classes this version has (older versions lack some)."""
    classes = []
    try:
        from diffusers.models.attention_processor import Attention

        classes.append(Attention)
    except ImportError:
        pass
    try:
        from diffusers.models.attention_processor import MochiAttention

        classes.append(MochiAttention)
    except ImportError:
        pass
    try:
        from diffusers.models.attention import AttentionModuleMixin

        classes.append(AttentionModuleMixin)
    except ImportError:
        pass
    return tuple(classes)


def _native_backend():
    """``AttentionBackendName.NATIVE``, or None on a diffusers without ``attention_dispatch``."""
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:
        return None
    return AttentionBackendName.NATIVE


def attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's attention modules in ``named_modules()`` order: the list index is the layer
    index plans use. An attention module is one of diffusers' attention classes, or any module
    with a ``processor`` and a ``set_processor`` method."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    classes = _attention_classes()

    def is_attention(module) -> bool:
        return isinstance(module, classes) or (
            hasattr(module, "processor") and callable(getattr(module, "set_processor", None)))

    return [(name, module) for name, module in model.named_modules() if is_attention(module)]


# -- plan storage -------------------------------------------------------------------------------

def _config_value(config, key):
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def stored_plan(model: torch.nn.Module) -> QAttnPlan | None:
    """The plan saved in the model's config (``config.qattn_plan``), or None.

    Diffusers 0.42 keeps unknown config keys when loading; should a version drop them, the plan is
    read from the ``config.json`` of the folder the model was loaded from (``_name_or_path``).
    """
    config = getattr(model, "config", None)
    data = _config_value(config, PLAN_CONFIG_KEY)
    if data is None:
        source = _config_value(config, "_name_or_path")
        path = os.path.join(str(source), PLAN_FILE_NAME) if source else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                data = json.load(file).get(PLAN_CONFIG_KEY)
    return QAttnPlan.resolve(data, stored=True)


def store_plan(model: torch.nn.Module, plan: QAttnPlan) -> None:
    """Write ``plan`` into the model's config so ``save_pretrained`` writes it to config.json."""
    register = getattr(model, "register_to_config", None)
    if register is None:
        raise TypeError(f"{type(model).__name__} has no diffusers config (register_to_config); "
                        "save the plan with plan.to_dict() instead")
    register(**{PLAN_CONFIG_KEY: plan.to_dict()})


def load_plan(path: str | os.PathLike) -> QAttnPlan:
    """A plan from a JSON file: a plan dict, or a config.json holding one under ``qattn_plan``;
    a folder means its config.json."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PLAN_FILE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"plan: no such file {path!r} (expected a plan JSON or a config.json)")
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    if isinstance(data, Mapping) and PLAN_CONFIG_KEY in data:
        data = data[PLAN_CONFIG_KEY]
    elif not (isinstance(data, Mapping) and "version" in data):
        raise PlanError(f"{path} holds neither a plan nor a config with a {PLAN_CONFIG_KEY!r} entry")
    return QAttnPlan.from_dict(data)


def _resolve_plan(plan, model: torch.nn.Module, num_layers: int) -> QAttnPlan:
    """The plan ``patch`` runs: :meth:`QAttnPlan.resolve` of ``plan``, or of the model's stored plan when
    None (``"int8"`` everywhere without one); a string that names no precision, or a path, is a plan file."""
    if plan is None:
        plan = stored_plan(model) or QAttnPlan(default=DEFAULT_PRECISION)
    elif isinstance(plan, os.PathLike) or (isinstance(plan, str) and plan not in PRECISIONS
                                           and plan not in LEGACY_SPELLINGS):
        if isinstance(plan, str) and not os.path.exists(plan):  # a mistyped precision, or a missing file
            raise FileNotFoundError(f"plan must be one of {', '.join(map(repr, PRECISIONS))}, a QAttnPlan, a plan "
                                    f"dict or a path to a plan JSON / config.json; {plan!r} is no precision and "
                                    "no such file")
        plan = load_plan(plan)
    return QAttnPlan.resolve(plan, num_layers=num_layers)


# -- routing ------------------------------------------------------------------------------------

class _LayerRoute(TorchFunctionMode):
    """Active while one attention module runs: its SDPA calls go to the patch, all else passes.
    Context-parallel calls reach it through :meth:`serve` (see :mod:`.context_parallel`)."""

    def __init__(self, denoiser: "_PatchedDenoiser", layer: int):
        super().__init__()
        self.denoiser = denoiser
        self.layer = layer
        self.calls = 0  # attention calls served while the module ran: SDPA and context-parallel ones
        self._bypass = 0

    def serve(self, named: dict, full_precision, *, return_lse: bool = False, gap: str | None = None):
        """One attention call of this layer given by SDPA's arguments (:meth:`_PatchedDenoiser.serve`)."""
        self.calls += 1
        return self.denoiser.serve(self.layer, named, full_precision, return_lse=return_lse, gap=gap)

    @contextlib.contextmanager
    def bypass(self):
        """SDPA called inside runs as SDPA: a full-precision result the patch computes itself."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not SDPA or self._bypass:
            if torch.compiler.is_compiling() and args and isinstance(args[0], torch.Tensor) \
                    and getattr(torch.Tensor, getattr(func, "__name__", ""), None) is func:
                # a Tensor method: called as a method, which torch.compile traces (the function
                # object of a Python-defined method such as Tensor.unflatten it cannot)
                return getattr(args[0], func.__name__)(*args[1:], **kwargs)
            return func(*args, **kwargs)
        return self.serve(sdpa_arguments(args, kwargs), lambda: func(*args, **kwargs))


# The attention modules running now in this thread, innermost last (one stack for every denoiser: the
# context-parallel op, called deep inside diffusers, finds the layer it serves here).
_running = threading.local()


def active_route() -> _LayerRoute | None:
    """The route of the patched attention module running now in this thread, or None."""
    stack = getattr(_running, "stack", None)
    return stack[-1] if stack else None


def _timestep_position(model: torch.nn.Module) -> int | None:
    try:
        parameters = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return parameters.index("timestep") if "timestep" in parameters else None


def _as_float(value) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().max()) if value.numel() else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


class _PatchedDenoiser:
    """The hooks on one denoiser model and the plan that applies to it."""

    def __init__(self, owner: "QAttnPatch", name: str, model: torch.nn.Module, plan: QAttnPlan,
                 layers: list[tuple[str, torch.nn.Module]]):
        self.owner = owner
        self.name = name
        self._model = weakref.ref(model)  # weak: the patch registry must not keep models alive
        self.plan = plan
        self.layer_names = [layer_name for layer_name, _ in layers]
        self._saved_backends: dict[int, tuple[object, bool, object]] = {}
        self._timestep_position = _timestep_position(model)
        self._hooks = [model.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        for layer, (_, module) in enumerate(layers):
            self._hooks.append(module.register_forward_pre_hook(self._enter_layer(layer)))
            self._hooks.append(module.register_forward_hook(self._exit_layer, always_call=True))
        context_parallel.install()  # undone by remove(), as the hooks are
        self._installed = True

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for processor, had_own, value in self._saved_backends.values():
            if had_own:
                processor._attention_backend = value
            else:
                del processor._attention_backend
        self._saved_backends.clear()
        if self._installed:
            self._installed = False
            context_parallel.uninstall()

    # -- hooks ----------------------------------------------------------------------------------
    def _on_model_call(self, module, args, kwargs):
        if torch.compiler.is_compiling() and not self.plan.steps and self.owner.recorder is None:
            return  # a plan without steps needs no step tracking: no timestep read inside a compiled graph
        self.owner._before_model_call()
        tracker = self.owner.tracker
        if tracker.needs_timestep:
            position = self._timestep_position
            value = kwargs.get("timestep")
            if value is None and position is not None and position < len(args):
                value = args[position]
            tracker.on_model_call(_as_float(value))

    def _route_native(self, processor) -> None:
        """Point a dispatch-based processor at the native (SDPA) backend; remember its own."""
        if not hasattr(processor, "_attention_backend"):
            return
        native = _native_backend()
        if native is None or processor._attention_backend == native:
            return
        if id(processor) not in self._saved_backends:
            had_own = "_attention_backend" in vars(processor)
            self._saved_backends[id(processor)] = (processor, had_own, vars(processor).get("_attention_backend"))
        processor._attention_backend = native

    def _enter_layer(self, layer: int):
        def enter(module, args):
            stack = getattr(_running, "stack", None)
            if stack is None:  # plain attribute access: dynamo (torch 2.11) rejects __dict__.setdefault here
                stack = _running.stack = []
            processor = getattr(module, "processor", None)
            self._route_native(processor)
            route = _LayerRoute(self, layer)
            route.__enter__()
            stack.append(route)
        return enter

    def _exit_layer(self, module, args, output):
        stack = getattr(_running, "stack", None)
        route = stack.pop() if stack else None
        if route is None:
            return
        route.__exit__(None, None, None)
        if route.calls == 0:
            stats.record_fallback(f"{type(getattr(module, 'processor', None)).__name__} computes attention "
                                  "without torch SDPA (not routed)")

    # -- one attention call -----------------------------------------------------------------------
    def serve(self, layer: int, named: dict, full_precision, *, return_lse: bool = False, gap: str | None = None):
        """One attention call of ``layer``, given by SDPA's arguments (``named``, see
        :func:`~.sdpa.sdpa_arguments`): qattn at the plan's precision, or ``full_precision()`` — what the
        model computes without the patch — where the plan, a ``gap`` (the caller's reason, else the
        kernel's) or the GPU's break-even (:func:`hf_qattn.support.below_break_even`, counted as
        ``sdpa-below-break-even``) says so. With ``return_lse`` (a ring shard) the result is (output, natural-log
        LSE)."""
        kernel_reason, pattern = kernel_gap(named)
        gap = gap or kernel_reason
        tracker = self.owner.tracker
        recorder = self.owner.recorder
        if recorder is not None:  # calibration: the run stays full precision, the kernel is scored aside
            out = full_precision()
            recorder.record(self.name, tracker.step, layer, named, pattern, gap)
            return out
        if gap is not None:
            ops.record(support.SDPA, gap)
            return full_precision()
        # the step only matters to a plan with step entries (and read, it would specialise a compiled graph on it)
        precision = self.plan.precision(layer, tracker.step, tracker.total_steps) if self.plan.steps \
            else self.plan.precision(layer)
        if precision == UNQUANTIZED:
            ops.record(support.UNQUANTIZED_BY_PLAN)
            return full_precision()
        # too short for the kernels to beat SDPA on this GPU (a cross-attention over a few hundred text tokens, an
        # image model's few thousand): SDPA, exact. A ring shard needs the kernel's LSE: never routed.
        if not return_lse and support.below_break_even(named["query"], pattern.kv_len, causal=pattern.causal,
                                                       variant=False):
            ops.record(support.BELOW_BREAK_EVEN)
            return full_precision()
        return run_qattn(named, precision, pattern, return_lse=return_lse)


# -- the patch ----------------------------------------------------------------------------------

_patched_models: "weakref.WeakKeyDictionary[torch.nn.Module, QAttnPatch]" = weakref.WeakKeyDictionary()
_patched_pipes: "weakref.WeakKeyDictionary[object, QAttnPatch]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def _denoisers_of(target) -> tuple[object | None, dict[str, torch.nn.Module]]:
    if isinstance(target, torch.nn.Module):
        return None, {"model": target}
    components = getattr(target, "components", None)
    if isinstance(components, Mapping):
        found = {name: components[name] for name in DENOISER_NAMES if isinstance(components.get(name), torch.nn.Module)}
        if not found:
            raise ValueError(f"pipeline {type(target).__name__} has no denoiser component (one of {DENOISER_NAMES}); "
                             f"its components are {sorted(components)}")
        return target, found
    raise TypeError("pipe_or_transformer must be a diffusers pipeline or a denoiser model (torch.nn.Module); "
                    f"got {type(target).__name__}")


class QAttnPatch:
    """A live patch (returned by :func:`patch`): plans, the step tracker, and ``unpatch``.

    Usable as a context manager (``with hf_qattn.patch(pipe): ...``) that unpatches on exit.
    """

    def __init__(self, pipe, models: dict[str, torch.nn.Module], scheduler, recorder=None):
        self._pipe = weakref.ref(pipe) if pipe is not None else None
        self.tracker = DenoisingStepTracker()
        self.recorder = recorder
        self._scheduler = None
        self.denoisers: dict[str, _PatchedDenoiser] = {}
        self._plans: dict[str, QAttnPlan] = {}  # kept after unpatch, for inspection
        self._layer_names: dict[str, list[str]] = {}
        self._models = {name: weakref.ref(model) for name, model in models.items()}
        self._follow_scheduler(scheduler, announce=False)

    def _install(self, plan) -> None:
        try:
            for name, model_ref in self._models.items():
                model = model_ref()
                layers = attention_layers(model)
                if not layers:
                    raise ValueError(f"{name} ({type(model).__name__}) has no attention modules to patch")
                if self.recorder is not None:
                    context_parallel.refuse_calibration(name, model, [module for _, module in layers])
                resolved = _resolve_plan(plan, model, len(layers)) if self.recorder is None else QAttnPlan()
                self.denoisers[name] = _PatchedDenoiser(self, name, model, resolved, layers)
                self._plans[name] = resolved
                self._layer_names[name] = [layer_name for layer_name, _ in layers]
        except BaseException:
            self.unpatch()
            raise

    # -- steps --------------------------------------------------------------------------------------
    def _follow_scheduler(self, scheduler, announce: bool = True) -> None:
        if self._scheduler is not None:
            SchedulerHooks.remove(self._scheduler, self.tracker)
        self._scheduler = scheduler
        if scheduler is not None:
            SchedulerHooks.add(scheduler, self.tracker)
            if announce:
                self.tracker.on_new_scheduler(scheduler)

    def _before_model_call(self) -> None:
        pipe = self._pipe() if self._pipe is not None else None
        current = getattr(pipe, "scheduler", None) if pipe is not None else None
        if current is not None and current is not self._scheduler:
            self._follow_scheduler(current)  # the user swapped pipe.scheduler after patching

    @property
    def step(self) -> int:
        """The denoising step the next attention call belongs to."""
        return self.tracker.step

    @property
    def total_steps(self) -> int | None:
        """Steps of the current run, when known (from the scheduler's timesteps)."""
        return self.tracker.total_steps

    def set_step(self, step: int, total_steps: int | None = None) -> None:
        """Set the current step by hand, for loops that use no scheduler."""
        self.tracker.set_step(step, total_steps)

    # -- plans and layers ---------------------------------------------------------------------------
    @property
    def plans(self) -> dict[str, QAttnPlan]:
        """The plan of each patched denoiser, by component name (``"model"`` for a bare model)."""
        return dict(self._plans)

    @property
    def plan(self) -> QAttnPlan:
        """The plan of the (first) denoiser."""
        if not self._plans:
            raise RuntimeError("this patch holds no plan (its installation failed)")
        return next(iter(self._plans.values()))

    def layers(self, denoiser: str | None = None) -> list[str]:
        """Module names of the patched attention layers, by layer index."""
        name = denoiser if denoiser is not None else next(iter(self._layer_names), None)
        if name not in self._layer_names:
            raise KeyError(f"denoiser must be one of {sorted(self._layer_names)}; got {denoiser!r}")
        return list(self._layer_names[name])

    # -- undo -----------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return bool(self.denoisers) or self._scheduler is not None

    def unpatch(self) -> None:
        """Remove every hook and restore processors and scheduler as they were."""
        for denoiser in self.denoisers.values():
            denoiser.remove()
        self.denoisers.clear()
        if self._scheduler is not None:
            SchedulerHooks.remove(self._scheduler, self.tracker)
            self._scheduler = None
        with _registry_lock:
            for model in (ref() for ref in self._models.values()):
                if model is not None and _patched_models.get(model) is self:
                    del _patched_models[model]
            pipe = self._pipe() if self._pipe is not None else None
            if pipe is not None and _patched_pipes.get(pipe) is self:
                del _patched_pipes[pipe]

    def __enter__(self) -> "QAttnPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}: {len(names)} layers" for name, names in self._layer_names.items())
        state = "" if self.denoisers else ", removed"
        return f"QAttnPatch({parts}; step {self.step}/{self.total_steps}{state})"


def _start_patch(pipe_or_transformer, plan, scheduler, recorder) -> QAttnPatch:
    _require_diffusers()
    pipe, models = _denoisers_of(pipe_or_transformer)
    with _registry_lock:
        for name, model in models.items():
            if model in _patched_models:
                raise RuntimeError(f"{name} ({type(model).__name__}) is already patched by hf_qattn; "
                                   "call hf_qattn.unpatch() on it first")
        if scheduler is None and pipe is not None:
            scheduler = getattr(pipe, "scheduler", None)
        handle = QAttnPatch(pipe, models, scheduler, recorder)
        for model in models.values():
            _patched_models[model] = handle
        if pipe is not None:
            _patched_pipes[pipe] = handle
    handle._install(plan)
    return handle


def patch(pipe_or_transformer, plan=None, *, scheduler=None) -> QAttnPatch:
    """Route the denoiser's self- and cross-attention through ``qattn``.

    Args:
        pipe_or_transformer: a diffusers pipeline (its ``transformer`` / ``transformer_2`` /
            ``unet`` components are patched) or a denoiser model.
        plan: which precision each (step, layer) runs: a :class:`~hf_qattn.QAttnPlan`, a plan dict,
            a path to a plan JSON (or a config.json / model folder holding one), or one of
            ``"int8"``, ``"int4"``, ``"unquantized"`` for all layers. ``None``: the plan stored in each
            denoiser's config (see :func:`hf_qattn.calibrate_pipeline`), else ``"int8"``.
        scheduler: the scheduler whose ``set_timesteps`` / ``step`` mark the denoising steps;
            defaults to ``pipe.scheduler``. Without one, steps follow the ``timestep`` argument.

    Returns a :class:`QAttnPatch`; ``unpatch(pipe_or_transformer)``, ``handle.unpatch()`` or
    leaving a ``with`` block undoes it.
    """
    return _start_patch(pipe_or_transformer, plan, scheduler, recorder=None)


def unpatch(pipe_or_transformer) -> bool:
    """Undo :func:`patch` on a pipeline, a denoiser model or a :class:`QAttnPatch`.

    Returns True when something was patched, False when there was nothing to undo.
    """
    if isinstance(pipe_or_transformer, QAttnPatch):
        was_active = pipe_or_transformer.active
        pipe_or_transformer.unpatch()
        return was_active
    pipe, models = _denoisers_of(pipe_or_transformer)
    handles = {id(h): h for h in [_patched_pipes.get(pipe) if pipe is not None else None,
                                  *(_patched_models.get(m) for m in models.values())] if h is not None}
    for handle in handles.values():
        handle.unpatch()
    return bool(handles)
