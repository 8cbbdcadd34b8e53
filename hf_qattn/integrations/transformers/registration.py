"""Registration with transformers, and the model-construction hook.

Importing :mod:`hf_qattn` arranges for two registrations as soon as transformers' own modules load
(so ``import hf_qattn`` stays cheap and does not import transformers itself):

- ``AttentionInterface["qattn"]`` = :func:`~hf_qattn.integrations.transformers.attention.qattn_attention_forward`;
- ``AttentionMaskInterface["qattn"]`` = transformers' own ``sdpa_mask``, so every model builds the
  masks it builds for SDPA: ``None`` (then ``is_causal`` decides, as in SDPA) or a 4D boolean mask.

After that ``from_pretrained(path, attn_implementation="qattn")`` and
``model.set_attn_implementation("qattn")`` work for every model that uses the interface.

The same registration wraps ``PreTrainedModel.post_init`` once (:func:`on_model_init`): every
model construction — ``from_pretrained``, ``from_config``, a plain constructor — validates
``config.qattn_plan`` when present (version, precisions, layer indices against
``num_hidden_layers``). A model that uses qattn raises :class:`hf_qattn.PlanError` there, at load,
never at the first forward; any other model (``"sdpa"``, ``"eager"``, ...) never reads the plan,
so it loads with a warning, once per plan error (not once per nested model class).
``set_attn_implementation("qattn")`` checks the plan again and raises. The hook also numbers the
attention modules of models that have no ``layer_idx`` (ViT, ...). The plan is applied whenever the
model runs with ``attn_implementation="qattn"``.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sys
import warnings

from ...plan import PLAN_CONFIG_KEY, PlanError, QAttnPlan
from .attention import ATTN_IMPLEMENTATION, plan_from_config, qattn_attention_forward


# ------------------------------------------------------------------------------------------------
# model construction hook: plan validation at load, layer indices for models without them


def _looks_like_attention(module) -> bool:
    return type(module).__name__.endswith("Attention") and hasattr(module, "config")


def _stamp_layer_indices(model) -> None:
    candidates = [m for m in model.modules() if _looks_like_attention(m)]
    if not candidates or any(isinstance(getattr(m, "layer_idx", None), int) for m in candidates):
        return
    inner = [m for m in candidates if not any(c is not m and _looks_like_attention(c) for c in m.modules())]
    for index, module in enumerate(inner):
        module._qattn_layer_idx = index


def uses_qattn(config) -> bool:
    """Whether a model with this config runs qattn (itself, or its text model for composite configs)."""
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        implementation = getattr(cfg, "_attn_implementation", None)
        values = implementation.values() if isinstance(implementation, dict) else [implementation]
        if ATTN_IMPLEMENTATION in values:
            return True
    return False


_warned: set[str] = set()


def check_plan(model, *, strict: bool) -> None:
    """Validate ``model.config.qattn_plan``: PlanError when ``strict``, else a warning once per message."""
    config = getattr(model, "config", None)
    data = getattr(config, PLAN_CONFIG_KEY, None) if config is not None else None
    if data is None:
        return
    try:
        plan = plan_from_config(config)
    except PlanError as error:
        message = f"{type(model).__name__}: config.{PLAN_CONFIG_KEY} is invalid: {error}"
        if strict:
            raise PlanError(message) from None
        # once per plan error, not per model class: LlamaForCausalLM and the LlamaModel inside it share the
        # config, and each runs post_init (the inner one first, so the warning names it)
        if str(error) not in _warned:
            _warned.add(str(error))
            warnings.warn(f"hf_qattn: {message} (ignored: this model does not run qattn attention; it would "
                          "fail with attn_implementation='qattn')", RuntimeWarning, stacklevel=4)
        return
    if isinstance(data, QAttnPlan):  # keep config.json serializable
        setattr(config, PLAN_CONFIG_KEY, plan.to_dict())


def on_model_init(model) -> None:
    """Run after every ``PreTrainedModel.post_init``: a malformed plan fails here, at load, for a model
    that runs qattn; other models only warn (they never read the plan)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    check_plan(model, strict=uses_qattn(config))
    _stamp_layer_indices(model)


def _wrap_post_init(pretrained_model_class) -> None:
    original = pretrained_model_class.post_init
    if getattr(original, "_hf_qattn_wrapped", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        on_model_init(self)
        return result

    post_init._hf_qattn_wrapped = True
    pretrained_model_class.post_init = post_init

    original_set = getattr(pretrained_model_class, "set_attn_implementation", None)
    if original_set is None or getattr(original_set, "_hf_qattn_wrapped", False):
        return

    @functools.wraps(original_set)
    def set_attn_implementation(self, *args, **kwargs):
        result = original_set(self, *args, **kwargs)
        if uses_qattn(self.config):  # the plan now matters: fail here, not at the first forward
            check_plan(self, strict=True)
        return result

    set_attn_implementation._hf_qattn_wrapped = True
    pretrained_model_class.set_attn_implementation = set_attn_implementation


# ------------------------------------------------------------------------------------------------
# registration


def _register_attention(modeling_utils) -> None:
    modeling_utils.AttentionInterface.register(ATTN_IMPLEMENTATION, qattn_attention_forward)
    _wrap_post_init(modeling_utils.PreTrainedModel)


def _register_mask(masking_utils) -> None:
    masking_utils.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, masking_utils.sdpa_mask)


_ON_LOAD = {"transformers.modeling_utils": _register_attention, "transformers.masking_utils": _register_mask}
_done: set[str] = set()


def _on_loaded(name: str) -> None:
    if name not in _done:
        _done.add(name)
        try:
            _ON_LOAD[name](sys.modules[name])
        except Exception as error:  # an incompatible transformers must not break its own import
            warnings.warn(f"hf_qattn: could not register with {name}: {error!r}", RuntimeWarning, stacklevel=2)
    if len(_done) == len(_ON_LOAD) and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


class _RegisterOnLoad:
    """Meta-path finder: lets transformers' modules load normally, then registers qattn in them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _ON_LOAD or fullname in _done:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _on_loaded(fullname)

        spec.loader.exec_module = exec_module
        return spec


_finder = _RegisterOnLoad()


def install() -> bool:
    """Register qattn with transformers now if it is loaded, else as soon as it loads. False without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return False
    if _finder not in sys.meta_path and len(_done) < len(_ON_LOAD):
        sys.meta_path.insert(0, _finder)
    for name in _ON_LOAD:
        if name in sys.modules and getattr(sys.modules[name], "__spec__", None) is not None:
            module = sys.modules[name]
            if hasattr(module, "AttentionInterface" if name.endswith("modeling_utils") else "AttentionMaskInterface"):
                _on_loaded(name)
    return True


def register() -> None:
    """Import transformers' modules and register qattn right away (``install`` does it lazily)."""
    import transformers.masking_utils
    import transformers.modeling_utils

    install()
    for name in _ON_LOAD:
        _on_loaded(name)
