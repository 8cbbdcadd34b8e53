"""Which denoising step a diffusers pipeline is in, so a per-(step, layer) plan can apply.

Two sources, the first one that is available wins:

1. The pipeline's scheduler (preferred). Every diffusers pipeline calls ``scheduler.set_timesteps``
   once at the start of a call, ``scheduler.step`` once per denoising step after the model call(s),
   and img2img-style pipelines ``scheduler.set_begin_index`` when they skip the first part of the
   schedule. So: ``set_timesteps`` → step 0 of ``len(scheduler.timesteps)`` steps;
   ``set_begin_index(i)`` → step i; ``step`` → step + 1. The model may be called any number of
   times in between — batched cond+uncond (one call), separate cond / uncond calls, extra guidance
   calls (skip-layer guidance) — they all see the same step. A new pipeline call restarts at 0.
2. The denoiser's ``timestep`` argument, when no scheduler events are seen (a bare transformer,
   a hand-written loop): a smaller timestep than the previous call → next step, the same → same
   step (cond / uncond), a larger one → a new run from step 0. The total is then unknown.

Limits: schedulers that evaluate the model several times per entry of ``timesteps`` (Heun, DPM2)
count one step per ``scheduler.step`` call, and the total is ``len(timesteps)``, so the relative
position is still right. A pipeline that never calls ``set_timesteps`` on its ``scheduler``
attribute gets the timestep-argument rule until the first ``scheduler.step``. Pipelines that drive a
second scheduler (e.g. an audio one) are not followed: only ``pipe.scheduler`` counts.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref

from ...support import check_count


class DenoisingStepTracker:
    """The current denoising step and, when known, the total of the current run."""

    def __init__(self):
        self._lock = threading.Lock()
        self.step = 0
        self.total_steps: int | None = None
        self.source = "start"  # where the step came from: "start", "scheduler", "timestep" or "manual"
        self._last_timestep: float | None = None

    # -- scheduler events -----------------------------------------------------------------------
    def on_set_timesteps(self, scheduler) -> None:
        timesteps = getattr(scheduler, "timesteps", None)
        with self._lock:
            self.step = 0
            self.total_steps = len(timesteps) if timesteps is not None else None
            self.source = "scheduler"
            self._last_timestep = None

    def on_set_begin_index(self, begin_index: int) -> None:
        with self._lock:
            self.step = int(begin_index)
            self.source = "scheduler"

    def on_scheduler_step(self) -> None:
        with self._lock:
            self.step += 1
            self.source = "scheduler"

    # -- model calls ----------------------------------------------------------------------------
    @property
    def needs_timestep(self) -> bool:
        """Whether the next model call's timestep value is needed (reading it may sync a GPU)."""
        return self.source in ("start", "timestep")

    def on_model_call(self, timestep: float | None) -> None:
        if timestep is None or not self.needs_timestep:
            return
        with self._lock:
            last = self._last_timestep
            if last is not None and timestep > last:
                self.step = 0  # the schedule went back up: a new run
            elif last is not None and timestep < last:
                self.step += 1
            self._last_timestep = timestep
            self.source = "timestep"

    def on_new_scheduler(self, scheduler) -> None:
        """The pipeline's scheduler was replaced after its ``set_timesteps``: follow timesteps
        until the new scheduler's first event, taking the total from it."""
        timesteps = getattr(scheduler, "timesteps", None)
        with self._lock:
            self.step = 0
            self.total_steps = len(timesteps) if timesteps is not None else None
            self.source = "start"
            self._last_timestep = None

    def set_step(self, step: int, total_steps: int | None = None) -> None:
        """Set the step by hand (custom loops); scheduler events still move it afterwards."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        check_count("total_steps", total_steps, none_ok=True, what="denoising steps of the run")
        if total_steps is not None and step >= total_steps:  # the plan would map it past its last step
            raise ValueError(f"step must be below total_steps (steps count from 0); got step {step} of {total_steps}")
        with self._lock:
            self.step, self.total_steps, self.source = step, total_steps, "manual"


class _HookedMethod:
    """A scheduler method that tells a listener after it ran. Stored in the scheduler's instance
    ``__dict__`` (wrapping whatever was there: the class method, or an instance override); its
    signature is the original's (pipelines inspect ``scheduler.step``'s parameters). A deep copy
    of the scheduler gets the unhooked method back (LTX-2 deep-copies its scheduler for audio; the
    copy's steps are not the video's steps)."""

    def __init__(self, scheduler, name: str, notify):
        self._scheduler = weakref.ref(scheduler)  # weak: the registry must not keep schedulers alive
        self._name = name
        self._notify = notify
        self.own_original = vars(scheduler).get(name)  # an instance override, restored on removal
        original = self._resolve(scheduler)
        self.__name__ = getattr(original, "__name__", name)
        self.__doc__ = getattr(original, "__doc__", None)
        self.__signature__ = inspect.signature(original)

    def _resolve(self, scheduler):
        return self.own_original or getattr(type(scheduler), self._name).__get__(scheduler)

    def __call__(self, *args, **kwargs):
        scheduler = self._scheduler()
        result = self._resolve(scheduler)(*args, **kwargs)
        self._notify(scheduler, args, kwargs)
        return result

    def __deepcopy__(self, memo):
        twin = memo.get(id(self._scheduler()))
        if twin is None:  # copying the method alone (e.g. a copy of the scheduler's __dict__): share it
            return self
        if self.own_original is not None:
            return copy.deepcopy(self.own_original, memo)
        return getattr(type(twin), self._name).__get__(twin)

    def __copy__(self):
        return self


class SchedulerHooks:
    """Hooks on one scheduler's ``set_timesteps`` / ``set_begin_index`` / ``step`` feeding trackers.

    One instance per scheduler (several patches may listen to one shared scheduler); installed
    with the first listener, removed with the last, leaving the scheduler's ``__dict__`` as found.
    """

    _by_scheduler: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()
    METHODS = ("set_timesteps", "set_begin_index", "step")

    def __init__(self, scheduler):
        self._scheduler = weakref.ref(scheduler)
        self._listeners: list[DenoisingStepTracker] = []
        self._installed: dict[str, _HookedMethod] = {}
        for name in self.METHODS:
            if callable(getattr(type(scheduler), name, None)):
                hooked = _HookedMethod(scheduler, name, self._event(name))
                setattr(scheduler, name, hooked)
                self._installed[name] = hooked

    @classmethod
    def add(cls, scheduler, tracker: DenoisingStepTracker) -> None:
        for name in ("set_timesteps", "step"):
            if not callable(getattr(type(scheduler), name, None)):
                raise TypeError(f"scheduler must have set_timesteps() and step() methods; "
                                f"{type(scheduler).__name__} lacks {name}()")
        with cls._registry_lock:
            hooks = cls._by_scheduler.get(scheduler)
            if hooks is None:
                hooks = cls._by_scheduler[scheduler] = cls(scheduler)
            hooks._listeners.append(tracker)

    @classmethod
    def remove(cls, scheduler, tracker: DenoisingStepTracker) -> None:
        with cls._registry_lock:
            hooks = cls._by_scheduler.get(scheduler)
            if hooks is None or tracker not in hooks._listeners:
                return
            hooks._listeners.remove(tracker)
            if not hooks._listeners:
                for name, hooked in hooks._installed.items():
                    if vars(scheduler).get(name) is not hooked:
                        continue  # replaced since: leave the newer one
                    if hooked.own_original is not None:
                        setattr(scheduler, name, hooked.own_original)
                    else:
                        delattr(scheduler, name)
                del cls._by_scheduler[scheduler]

    def _event(self, name: str):
        """The callback the hooked method ``name`` runs after the original returned."""
        def notify(scheduler, args, kwargs):
            for tracker in list(self._listeners):
                if name == "set_timesteps":
                    tracker.on_set_timesteps(scheduler)
                elif name == "set_begin_index":
                    tracker.on_set_begin_index(args[0] if args else kwargs.get("begin_index", 0))
                else:
                    tracker.on_scheduler_step()
        return notify
