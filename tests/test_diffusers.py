"""The diffusers integration on tiny pipelines built from configs (random weights, no downloads):
routing of every denoiser attention call, accuracy against the unpatched run, per-(step, layer)
plans, step counting under classifier-free guidance, masks, fallbacks, and unpatching."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hf_qattn
from hf_qattn import masks
from hf_qattn.integrations import diffusers as integration
from hf_qattn.integrations.diffusers import sdpa as diffusers_sdpa
from hf_qattn.integrations.diffusers.steps import _HookedMethod
from hf_qattn.plan import PlanError, QAttnPlan

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention import AttentionModuleMixin  # noqa: E402
from diffusers.models.attention_dispatch import AttentionBackendName  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention
STEPS = 3

# Relative L2 error of the denoiser's predictions (all calls of a run, concatenated) against the
# unpatched run, by model: (int8 bound, int4 bound). Measured over 12 seeds, the worst int8 / int4
# errors were flux 0.0006 / 0.0031, sd3 0.0005 / 0.0009, cogvideox 0.0023 / 0.013, wan 0.0048 /
# 0.017; bugs in routing give at least flux 0.020, sd3 0.022, cogvideox 0.045, wan 0.14 (softmax
# scale dropped, key/value swapped, heads permuted, the V-smoothing correction left out). Each
# run also checks that a dropped softmax scale lands outside the int4 bound.
TOLERANCES = {"flux": (0.003, 0.010), "sd3": (0.003, 0.006), "cogvideox": (0.008, 0.03), "wan": (0.015, 0.05)}


@pytest.fixture
def stats(fresh_stats):
    return fresh_stats


# -- tiny pipelines (text encoders bypassed with prompt_embeds) -----------------------------------

def _embeds(tokens=8, dim=32):
    return torch.randn(1, tokens, dim)


def build_flux(vae: bool = False):
    tr = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    autoencoder = None
    if vae:
        autoencoder = diffusers.AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4,
                                              sample_size=16, down_block_types=("DownEncoderBlock2D",) * 2,
                                              up_block_types=("UpDecoderBlock2D",) * 2, shift_factor=0.0,
                                              scaling_factor=1.0)
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=autoencoder,
                                  text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                  transformer=tr)
    # vae_scale_factor 2 with the tiny VAE, 8 without: 64 image tokens + 8 text tokens either way
    size = 32 if vae else 128
    return pipe, dict(prompt_embeds=_embeds(), pooled_prompt_embeds=torch.randn(1, 32), height=size, width=size)


def build_sd3():
    tr = diffusers.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
                                         pos_embed_max_size=16)
    pipe = diffusers.StableDiffusion3Pipeline(transformer=tr, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                              vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                              tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    # guidance_scale > 1: cond and uncond in one batch of 2 (64 image + 8 text tokens)
    return pipe, dict(prompt_embeds=_embeds(), negative_prompt_embeds=_embeds(),
                      pooled_prompt_embeds=torch.randn(1, 32), negative_pooled_prompt_embeds=torch.randn(1, 32),
                      height=128, width=128, guidance_scale=5.0)


def build_cogvideox():
    tr = diffusers.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                               out_channels=4, time_embed_dim=8, text_embed_dim=32, num_layers=2,
                                               sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                                               temporal_compression_ratio=4, max_text_seq_length=8)
    pipe = diffusers.CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr,
                                       scheduler=diffusers.CogVideoXDDIMScheduler())
    # 3 latent frames × 16 patches + 8 text tokens; batched CFG
    return pipe, dict(prompt_embeds=_embeds(), negative_prompt_embeds=_embeds(), height=64, width=64, num_frames=9,
                      guidance_scale=6.0)


def build_wan():
    tr = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                         in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                         num_layers=2, rope_max_seq_len=32)
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    # guidance_scale > 1: cond and uncond in two separate transformer calls per step (3 frames × 16 tokens)
    return pipe, dict(prompt_embeds=_embeds(), negative_prompt_embeds=_embeds(), height=64, width=64, num_frames=9,
                      guidance_scale=5.0)


BUILDERS = {"flux": build_flux, "sd3": build_sd3, "cogvideox": build_cogvideox, "wan": build_wan}


def run(pipe, kwargs, steps=STEPS, **extra):
    """Final latents of a pipeline call with a fixed generator."""
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**kwargs, num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(0),
               **extra)
    return out[0] if isinstance(out, tuple) else getattr(out, "images", getattr(out, "frames", None))


def run_with_predictions(pipe, kwargs, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """(every denoiser output of the run, concatenated and flattened; final latents)."""
    outputs = []
    hook = pipe.transformer.register_forward_hook(
        lambda module, args, out: outputs.append((out[0] if isinstance(out, tuple) else out.sample).flatten()))
    try:
        latents = run(pipe, kwargs, **extra)
    finally:
        hook.remove()
    return torch.cat(outputs), latents


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def attention_modules(model) -> list[torch.nn.Module]:
    """The test's own enumeration of attention modules (diffusers' classes, named_modules order)."""
    return [m for _, m in model.named_modules() if isinstance(m, (Attention, AttentionModuleMixin))]


class _CountSDPA(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is SDPA:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def count_denoiser_sdpa(model, call):
    """Number of SDPA calls made inside ``model``'s forward while running ``call()``."""
    counter = _CountSDPA()
    pre = model.register_forward_pre_hook(lambda *a: counter.__enter__() and None)
    post = model.register_forward_hook(lambda *a: counter.__exit__(None, None, None) and None, always_call=True)
    try:
        result = call()
    finally:
        pre.remove()
        post.remove()
    return counter.calls, result


class Recorder:
    """Spies on qattn: records (test step, test layer, qk, handle step, handle total) per call.

    The test's layer comes from its own pre-hooks on attention modules; its step from the
    pipeline's ``callback_on_step_end`` — both independent of the patch's own bookkeeping."""

    def __init__(self, monkeypatch, model, handle_ref=lambda: None):
        self.records = []
        self.step = 0
        self.layer = None
        self._handle_ref = handle_ref
        self._hooks = [m.register_forward_pre_hook(lambda *a, i=i: setattr(self, "layer", i))
                       for i, m in enumerate(attention_modules(model))]
        real = diffusers_sdpa.qattn

        def spy(*args, **kwargs):
            handle = self._handle_ref()
            self.records.append((self.step, self.layer, kwargs["qk"],
                                 handle.step if handle else None, handle.total_steps if handle else None))
            return real(*args, **kwargs)

        monkeypatch.setattr(diffusers_sdpa, "qattn", spy)

    def callback(self, pipe, i, t, callback_kwargs):
        self.step = i + 1
        return {}

    def reset(self):
        self.records.clear()
        self.step = 0

    def remove(self):
        for hook in self._hooks:
            hook.remove()


# -- accuracy, routing, unpatch ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BUILDERS))
def test_patched_pipeline_matches_full_precision_and_unpatch_restores(name, seed, stats, monkeypatch):
    pipe, kwargs = BUILDERS[name]()
    sdpa_calls, (ref, ref_latents) = count_denoiser_sdpa(pipe.transformer, lambda: run_with_predictions(pipe, kwargs))
    assert sdpa_calls >= STEPS * len(attention_modules(pipe.transformer))

    errors = {}
    for precision in ("int8", "int4"):
        hf_qattn.reset_fallback_stats()
        with hf_qattn.patch(pipe, plan=precision):
            out, _ = run_with_predictions(pipe, kwargs)
        # every denoiser attention call went to the kernel (reference path on CPU), none fell back
        assert stats() == {"calls": {"reference": sdpa_calls}, "fallbacks": {}}, precision
        errors[precision] = rel_err(out, ref)
    print(f"{name}: prediction rel. error int8 {errors['int8']:.4f}, int4 {errors['int4']:.4f}")
    int8_tol, int4_tol = TOLERANCES[name]
    assert 0 < errors["int8"] < int8_tol
    assert 0 < errors["int4"] < int4_tol

    # the bounds are tight enough to catch a routing bug: here, the softmax scale dropped
    real = diffusers_sdpa.qattn
    with monkeypatch.context() as broken:
        broken.setattr(diffusers_sdpa, "qattn", lambda *a, **k: real(*a, **{**k, "sm_scale": 1.0}))
        with hf_qattn.patch(pipe, plan="int8"):
            wrong, _ = run_with_predictions(pipe, kwargs)
    assert rel_err(wrong, ref) > int4_tol

    assert torch.equal(run(pipe, kwargs), ref_latents), "unpatched output must be bit-identical to the original"
    assert not {"step", "set_timesteps", "set_begin_index"} & set(vars(pipe.scheduler))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pipe.transformer.modules())


def test_vae_untouched_and_user_backend_restored(seed, stats):
    pipe, kwargs = build_flux(vae=True)
    processors = {id(m.processor): m.processor for m in attention_modules(pipe.transformer)}.values()
    for processor in processors:  # a user-chosen dispatch backend that is not the native one
        processor._attention_backend = AttentionBackendName._NATIVE_MATH
    pipe.set_progress_bar_config(disable=True)

    def decoded():
        generator = torch.Generator().manual_seed(0)
        return pipe(**kwargs, num_inference_steps=2, output_type="pt", generator=generator).images

    sdpa_calls, ref = count_denoiser_sdpa(pipe.transformer, decoded)
    with _CountSDPA() as everything:
        decoded()
    assert everything.calls > sdpa_calls, "the tiny VAE must have attention for this test to mean anything"

    with hf_qattn.patch(pipe, plan="int8"):
        out = decoded()
        assert all(p._attention_backend == AttentionBackendName.NATIVE for p in processors)
        assert all(not m._forward_pre_hooks for m in pipe.vae.modules())
    # only the transformer's attention went through qattn; the VAE's ran untouched
    assert stats() == {"calls": {"reference": sdpa_calls}, "fallbacks": {}}
    assert rel_err(out, ref) < TOLERANCES["flux"][1]
    assert all(p._attention_backend == AttentionBackendName._NATIVE_MATH for p in processors)


# -- plans and steps ------------------------------------------------------------------------------

def test_plan_entry_applies_at_exactly_its_step_and_layer(seed, monkeypatch, stats):
    pipe, kwargs = build_wan()  # two transformer calls per step (separate cond / uncond)
    layers = len(attention_modules(pipe.transformer))
    target_step, target_layer, full_layer = 1, 2, 3
    plan = QAttnPlan(default="int4", steps={target_step: {target_layer: "int8"}}, layers={full_layer: "fp16"},
                     num_layers=layers, num_steps=STEPS)
    recorder = Recorder(monkeypatch, pipe.transformer)
    with hf_qattn.patch(pipe, plan=plan):
        run(pipe, kwargs, callback_on_step_end=recorder.callback)
    seen = {(s, l): qk for s, l, qk, *_ in recorder.records}
    assert set(seen) == {(s, l) for s in range(STEPS) for l in range(layers) if l != full_layer}
    assert [key for key, qk in seen.items() if qk == "int8"] == [(target_step, target_layer)]
    assert len(recorder.records) == 2 * STEPS * (layers - 1)
    assert all(qk == seen[(s, l)] for s, l, qk, *_ in recorder.records)  # cond and uncond agree
    assert stats()["calls"]["unquantized-by-plan"] == 2 * STEPS and stats()["fallbacks"] == {}  # the unquantized layer

    # twice the steps: plan step t covers run steps 2t and 2t+1 (relative position)
    recorder.reset()
    with hf_qattn.patch(pipe, plan=plan):
        run(pipe, kwargs, steps=2 * STEPS, callback_on_step_end=recorder.callback)
    int8_at = sorted({(s, l) for s, l, qk, *_ in recorder.records if qk == "int8"})
    assert int8_at == [(2 * target_step, target_layer), (2 * target_step + 1, target_layer)]
    recorder.remove()


@pytest.mark.parametrize("name,calls_per_step", [("wan", 2), ("sd3", 1), ("cogvideox", 1)])
def test_steps_counted_under_cfg_and_restart_per_call(name, calls_per_step, seed, monkeypatch):
    pipe, kwargs = BUILDERS[name]()
    layers = len(attention_modules(pipe.transformer))
    handle = hf_qattn.patch(pipe, plan="int8")
    recorder = Recorder(monkeypatch, pipe.transformer, handle_ref=lambda: handle)
    try:
        for steps in (STEPS, 2):  # a second pipeline call restarts the count, with its own total
            recorder.reset()
            run(pipe, kwargs, steps=steps, callback_on_step_end=recorder.callback)
            assert len(recorder.records) == steps * layers * calls_per_step
            # the patch's step equals the pipeline's own step index at every call, and knows the total
            assert all(handle_step == test_step for test_step, _, _, handle_step, _ in recorder.records)
            assert {total for *_, total in recorder.records} == {steps}
            assert sorted({s for s, *_ in recorder.records}) == list(range(steps))
    finally:
        handle.unpatch()
        recorder.remove()


def test_img2img_steps_start_at_the_scheduler_begin_index(seed, monkeypatch):
    """strength 0.5 of 4 steps runs schedule positions 2 and 3 (set_begin_index), of 4 in total."""
    pipe, kwargs = build_flux(vae=True)
    pipe = diffusers.FluxImg2ImgPipeline(**pipe.components)
    layers = len(attention_modules(pipe.transformer))
    handle = hf_qattn.patch(pipe, plan="int8")
    recorder = Recorder(monkeypatch, pipe.transformer, handle_ref=lambda: handle)
    try:
        run(pipe, kwargs, steps=4, image=torch.rand(1, 3, 32, 32), strength=0.5)
    finally:
        handle.unpatch()
        recorder.remove()
    assert [(h, total) for *_, h, total in recorder.records] == [(s, 4) for s in (2, 3) for _ in range(layers)]


def test_steps_follow_timestep_argument_without_scheduler(seed):
    pipe, kwargs = build_flux()
    model = pipe.transformer
    hidden = torch.randn(1, 64, 16)
    inputs = dict(hidden_states=hidden, encoder_hidden_states=torch.randn(1, 8, 32),
                  pooled_projections=torch.randn(1, 32), txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(64, 3))
    seen = []
    with torch.no_grad(), hf_qattn.patch(model, plan="int8") as handle:
        hook = attention_modules(model)[0].register_forward_pre_hook(lambda *a: seen.append(handle.step))
        # cond/uncond pairs at each timestep, then a new run starting from the top again
        for t in (1.0, 1.0, 0.7, 0.7, 0.3, 0.3, 1.0, 0.5):
            model(**inputs, timestep=torch.tensor([t]))
        hook.remove()
        assert seen == [0, 0, 1, 1, 2, 2, 0, 1]
        assert handle.total_steps is None
        handle.set_step(5, total_steps=10)
        assert (handle.step, handle.total_steps) == (5, 10)
        with pytest.raises(ValueError, match="step"):
            handle.set_step(-1)
        with pytest.raises(ValueError, match="step must be below total_steps.*got step 10 of 10"):
            handle.set_step(10, total_steps=10)  # steps count from 0: past the plan's last step
        with pytest.raises(ValueError, match="step must be a non-negative int; got True"):
            handle.set_step(True)
        assert (handle.step, handle.total_steps) == (5, 10)  # refused calls changed nothing


def test_swapped_scheduler_and_scheduler_copies(seed, monkeypatch):
    pipe, kwargs = build_flux()
    layers = len(attention_modules(pipe.transformer))
    handle = hf_qattn.patch(pipe, plan="int8")
    recorder = Recorder(monkeypatch, pipe.transformer, handle_ref=lambda: handle)
    try:
        old = pipe.scheduler
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(old.config)
        run(pipe, kwargs, callback_on_step_end=recorder.callback)
        assert [h for _, _, _, h, _ in recorder.records] == [s for s in range(STEPS) for _ in range(layers)]
        assert "step" not in vars(old) and "step" in vars(pipe.scheduler)
        twin = copy.deepcopy(pipe.scheduler)  # e.g. LTX-2's audio scheduler: its steps must not count
        assert not isinstance(vars(twin).get("step"), _HookedMethod)
        twin.set_timesteps(4)
        before = handle.step
        twin.step(torch.zeros(1, 4, 16), twin.timesteps[0], torch.zeros(1, 4, 16))
        assert handle.step == before
    finally:
        handle.unpatch()
        recorder.remove()
    assert not {"step", "set_timesteps", "set_begin_index"} & set(vars(pipe.scheduler))


# -- masks and fallbacks ------------------------------------------------------------------------------

def build_hunyuan_inputs(batch=2, text=16, valid=(16, 3)):
    model = diffusers.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                     attention_head_dim=16, num_layers=1, num_single_layers=1,
                                                     num_refiner_layers=1, patch_size=1, patch_size_t=1,
                                                     text_embed_dim=16, pooled_projection_dim=8,
                                                     rope_axes_dim=(4, 6, 6))
    mask = torch.zeros(batch, text, dtype=torch.long)
    for b, n in enumerate(valid):
        mask[b, :n] = 1
    text_states = torch.randn(batch, text, 16)
    text_states[mask == 0] *= 30  # loud padding: attending to it would show
    inputs = dict(hidden_states=torch.randn(batch, 4, 1, 8, 8), timestep=torch.tensor([500] * batch),
                  encoder_hidden_states=text_states, encoder_attention_mask=mask,
                  pooled_projections=torch.randn(batch, 8), guidance=torch.tensor([3000.0] * batch))
    return model, inputs


def test_key_padding_masks_use_kv_range_and_other_masks_fall_back(seed, stats):
    model, inputs = build_hunyuan_inputs()
    with torch.inference_mode():  # inference tensors carry no version counter: the mask cache must cope
        ref = model(**inputs)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hf_qattn.patch(model, plan="int8"):
                out = model(**inputs)[0]
    counts = stats()
    # the token refiner's self-attention mask hides padded queries' rows too: not causal ∧ key range
    refiner_calls = len(attention_modules(model.context_embedder))
    assert counts["fallbacks"] == {masks.REASON_PATTERN: refiner_calls}
    assert sum("falling back" in str(w.message) for w in caught) == 1  # warned once per reason
    # the joint blocks' masks hide padded text keys: served by the kernel with kv_end per sequence
    assert counts["calls"] == {"sdpa": refiner_calls,
                               "reference": len(attention_modules(model)) - refiner_calls}
    # on the padded sequence: int8 measured ≤ 0.0008 over 12 seeds; attending to the padding ≥ 0.0049
    assert rel_err(out[1], ref[1]) < 0.0025


def test_unet_cross_attention_with_padding_mask(seed, stats):
    """A UNet denoiser (processors that call SDPA directly, additive -1e4 encoder mask)."""
    # attention_head_dim is the head count in UNet2DConditionModel: 2 heads of 16 channels
    unet = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                          block_out_channels=(32, 32), norm_num_groups=8, cross_attention_dim=16,
                                          attention_head_dim=2,
                                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    mask = torch.ones(2, 12)
    mask[1, 4:] = 0
    text = torch.randn(2, 12, 16)
    text[mask == 0] *= 30
    inputs = dict(sample=torch.randn(2, 4, 8, 8), timestep=torch.tensor([400, 400]), encoder_hidden_states=text,
                  encoder_attention_mask=mask)
    with torch.no_grad():
        ref = unet(**inputs).sample
        with hf_qattn.patch(unet, plan="int8"):
            out = unet(**inputs).sample
    assert stats() == {"calls": {"reference": len(attention_modules(unet))}, "fallbacks": {}}
    # the padded sequence: int8 measured 0.03–0.05 (attention dominates this tiny UNet's output);
    # attending to the padding instead gives 1.1–1.5
    assert rel_err(out[1], ref[1]) < 0.12


@pytest.mark.filterwarnings("ignore:hf_qattn")
def test_key_padding_mask_is_what_reaches_the_kernel(seed, monkeypatch):
    model, inputs = build_hunyuan_inputs(text=8, valid=(8, 5))
    ranges = []
    real = diffusers_sdpa.qattn
    monkeypatch.setattr(diffusers_sdpa, "qattn", lambda *a, **k: ranges.append((k["kv_start"], k["kv_end"]))
                        or real(*a, **k))
    with torch.no_grad(), hf_qattn.patch(model, plan="int8"):
        model(**inputs)
    latent = 64
    assert ranges and all(start is None and  # no left padding: no start range
                          torch.equal(end, torch.tensor([latent + 8, latent + 5], dtype=torch.int32))
                          for start, end in ranges)


def test_processor_without_sdpa_is_counted_not_silently_skipped(seed, stats):
    pipe, kwargs = build_sd3()
    module = attention_modules(pipe.transformer)[0]
    original = module.processor
    module.set_processor(_NoSDPAProcessor(original))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hf_qattn.patch(pipe, plan="int8"):
                run(pipe, kwargs, steps=1)
    finally:
        module.set_processor(original)
    counts = stats()
    assert counts["fallbacks"] == {"_NoSDPAProcessor computes attention without torch SDPA (not routed)": 1}
    assert counts["calls"] == {"sdpa": 1, "reference": len(attention_modules(pipe.transformer)) - 1}


def _sdpa_call(b=1, hq=2, hk=2, nq=8, nk=8, d=16, dtype=torch.float32, grad=False, **options):
    q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, hk, nk, d, dtype=dtype) for _ in range(2))
    return diffusers_sdpa.sdpa_arguments((q, k, v), options)


@pytest.mark.parametrize("named,reason", [
    (lambda: _sdpa_call(d=288), "head_dim > 256"),
    (lambda: _sdpa_call(dropout_p=0.1), "dropout"),
    (lambda: _sdpa_call(grad=True), "autograd"),
    (lambda: _sdpa_call(nq=4, is_causal=True), "is_causal with Nq != Nk"),
    (lambda: _sdpa_call(hq=4, hk=2), "query heads"),
    (lambda: _sdpa_call(dtype=torch.float64), "dtype"),
    (lambda: _sdpa_call(attn_mask=torch.randn(1, 1, 8, 8)), "bias"),
    (lambda: {**_sdpa_call(), "query": torch.randn(2, 8, 16)}, "not 4-D"),
])
def test_kernel_gap_reasons(named, reason):
    gap, _ = diffusers_sdpa.kernel_gap(named())
    assert gap is not None and reason in gap


def test_kernel_gap_accepts_servable_calls():
    assert diffusers_sdpa.kernel_gap(_sdpa_call(hq=4, hk=2, enable_gqa=True))[0] is None
    assert diffusers_sdpa.kernel_gap(_sdpa_call(is_causal=True, d=256))[0] is None
    named = diffusers_sdpa.sdpa_arguments((), dict(query=torch.randn(1, 2, 3, 8), key=torch.randn(1, 2, 5, 8),
                                                   value=torch.randn(1, 2, 5, 8), scale=0.5))
    assert named["scale"] == 0.5 and diffusers_sdpa.kernel_gap(named)[0] is None


class _NoSDPAProcessor:
    """Stands for a processor that does its own softmax(QKᵀ)V instead of calling SDPA."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        def manual(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            scale = scale if scale is not None else q.shape[-1] ** -0.5
            return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v

        original = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = manual
        try:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        finally:
            torch.nn.functional.scaled_dot_product_attention = original


@pytest.mark.parametrize("nhd_memory", [True, False])
def test_run_qattn_matches_sdpa_with_scale_gqa_and_padding(nhd_memory, seed):
    """One intercepted call, checked directly: explicit scale, GQA, key padding, both memory layouts."""
    def make(heads, tokens):
        if nhd_memory:  # what processors build: (B, N, H, D) memory seen as (B, H, N, D)
            return torch.randn(2, tokens, heads, 32).transpose(1, 2)
        return torch.randn(2, heads, tokens, 32)

    q, k, v = make(4, 40), make(2, 24), make(2, 24)
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    mask[1, ..., 20:] = False
    options = dict(attn_mask=mask, scale=0.3, enable_gqa=True)
    ref = SDPA(q, k, v, **options)
    named = diffusers_sdpa.sdpa_arguments((q, k, v), options)
    gap, pattern = diffusers_sdpa.kernel_gap(named)
    assert gap is None and pattern.kv_end.tolist() == [24, 20] and pattern.kv_len == 24
    out = diffusers_sdpa.run_qattn(named, "int8", pattern)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # int8 measured ≈ 0.03 on these Gaussian inputs; the default scale instead of 0.3 gives ≈ 0.4
    assert rel_err(out, ref) < 0.06
    assert rel_err(diffusers_sdpa.run_qattn({**named, "scale": None}, "int8", pattern), ref) > 0.2


# -- bad input -------------------------------------------------------------------------------------

def test_bad_arguments_get_clear_errors(seed):
    pipe, kwargs = build_flux()
    layers = len(attention_modules(pipe.transformer))
    with pytest.raises(TypeError, match="pipe_or_transformer"):
        hf_qattn.patch(42)
    with pytest.raises(TypeError, match="plan must be"):
        hf_qattn.patch(pipe, plan=0.5)
    with pytest.raises(PlanError, match="out of range"):
        hf_qattn.patch(pipe, plan={"version": 1, "default": "int4", "layers": {str(layers): "int8"}})
    with pytest.raises(PlanError, match="attention layers"):
        hf_qattn.patch(pipe, plan=QAttnPlan(num_layers=layers + 1))
    with pytest.raises(PlanError, match="precision"):
        hf_qattn.patch(pipe, plan={"version": 1, "default": "int2"})
    with pytest.raises(FileNotFoundError, match="plan"):
        hf_qattn.patch(pipe, plan="/nonexistent/plan.json")
    with pytest.raises(FileNotFoundError, match="plan must be one of 'int4', 'int8', 'unquantized'.*'int3' is no"):
        hf_qattn.patch(pipe, plan="int3")  # a mistyped precision is named as one
    assert integration._patched_models.get(pipe.transformer) is None  # failed patches left nothing behind
    assert all(not m._forward_pre_hooks for m in pipe.transformer.modules())
    with hf_qattn.patch(pipe):
        with pytest.raises(RuntimeError, match="already patched"):
            hf_qattn.patch(pipe.transformer)
    assert hf_qattn.unpatch(pipe) is False
    with pytest.raises(ValueError, match="no denoiser"):
        hf_qattn.patch(diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None,
                                              text_encoder=None, tokenizer=None, text_encoder_2=None,
                                              tokenizer_2=None, transformer=None))
    with pytest.raises(ValueError, match="no attention modules"):
        hf_qattn.patch(torch.nn.Linear(2, 2))


def test_import_hf_qattn_does_not_import_diffusers():
    import subprocess
    import sys

    code = "import sys, hf_qattn; assert 'diffusers' not in sys.modules; assert callable(hf_qattn.patch); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
