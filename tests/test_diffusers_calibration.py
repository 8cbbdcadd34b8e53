"""Per-(step, layer) calibration of tiny diffusers pipelines: the plan's int8 share, the scores,
that calibration runs in full precision, plan storage through save_pretrained / from_pretrained,
the heatmap, two-denoiser pipelines, and the ``calibrate-pipeline`` CLI pieces."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch

import hf_qattn
from hf_qattn.cli import CLIError
from hf_qattn.integrations import diffusers as integration
from hf_qattn.integrations.diffusers.calibration import PipelineCalibration
from hf_qattn.calibration.plots import plot_scores
from hf_qattn.cli.calibrate_pipeline import add_calibrate_pipeline_parser, run_calibrate_pipeline
from hf_qattn.plan import PLAN_CONFIG_KEY

diffusers = pytest.importorskip("diffusers")
from test_diffusers import attention_modules, build_sd3, build_wan, run, run_with_predictions  # noqa: E402

STEPS = 4
RATIO = 0.3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def split_prompt(kwargs: dict, prompts: int):
    """``prompts`` calibration prompts (fresh prompt embeddings) and the arguments common to all."""
    common = {k: v for k, v in kwargs.items() if k not in ("prompt_embeds", "negative_prompt_embeds")}
    calls = [dict(prompt_embeds=torch.randn_like(kwargs["prompt_embeds"]),
                  negative_prompt_embeds=torch.randn_like(kwargs["negative_prompt_embeds"])) for _ in range(prompts)]
    calls[0] = {"prompt_embeds": kwargs["prompt_embeds"], "negative_prompt_embeds": kwargs["negative_prompt_embeds"]}
    return calls, common


@pytest.fixture(scope="module")
def calibrated_wan(tmp_path_factory):
    """A tiny Wan pipeline (separate cond / uncond calls), calibrated on 2 prompts, plus its reference run."""
    value = int(os.environ.get("HF_QATTN_SEED", time.time_ns() % 2**31))
    torch.manual_seed(value)
    print(f"calibrated_wan seed: {value}  (replay with HF_QATTN_SEED={value})")
    pipe, kwargs = build_wan()
    ref_predictions, ref_latents = run_with_predictions(pipe, kwargs, steps=STEPS)
    calls, common = split_prompt(kwargs, 2)
    seen = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, out: seen.append(out[0].flatten()))
    result = hf_qattn.calibrate_pipeline(pipe, calls, num_inference_steps=STEPS, ratio=RATIO, **common)
    hook.remove()
    calls_per_prompt = len(seen) // 2
    return dict(pipe=pipe, kwargs=kwargs, result=result, ref_predictions=ref_predictions, ref_latents=ref_latents,
                calibration_predictions=torch.cat(seen[:calls_per_prompt]))


def test_calibration_marks_the_requested_share_of_lowest_scores(calibrated_wan):
    pipe, result = calibrated_wan["pipe"], calibrated_wan["result"]
    assert isinstance(result, PipelineCalibration)
    layers = len(attention_modules(pipe.transformer))
    plan, scores = result  # unpacks like the transformers calibration
    assert set(scores) == {(s, l) for s in range(STEPS) for l in range(layers)}
    assert result.num_steps == plan.num_steps == STEPS and plan.num_layers == layers
    int8 = {(s, l) for s, row in plan.steps.items() for l, p in row.items() if p == "int8"}
    assert len(int8) == round(RATIO * STEPS * layers)
    ranked = sorted(scores, key=lambda key: (scores[key].mean, str(key)))
    assert int8 == set(ranked[: len(int8)])  # exactly the lowest mean scores
    for score in scores.values():
        assert score.count == 2  # prompts
        assert 0.5 < score.worst <= score.mean + 1e-12 <= 1.0 + 1e-12
        assert score.cos_sim > 0.9 and score.rel_l1 >= 0
    assert result.skipped == {}
    # the plan is in the transformer's config, the scores in its meta (for plots of a saved plan)
    assert pipe.transformer.config[PLAN_CONFIG_KEY] == plan.to_dict()
    assert plan.meta["prompts"] == 2 and plan.meta["scores"]["0"]["0"][0] == round(scores[(0, 0)].mean, 6)
    json.dumps(result.to_dict())  # serialisable as it stands


def test_calibration_runs_in_full_precision_and_leaves_nothing_behind(calibrated_wan):
    pipe, kwargs = calibrated_wan["pipe"], calibrated_wan["kwargs"]
    # the first calibration prompt is the reference prompt with the reference generator: same outputs, bit for bit
    assert torch.equal(calibrated_wan["calibration_predictions"], calibrated_wan["ref_predictions"])
    assert torch.equal(run(pipe, kwargs, steps=STEPS), calibrated_wan["ref_latents"])
    assert integration._patched_models.get(pipe.transformer) is None
    assert not {"step", "set_timesteps", "set_begin_index"} & set(vars(pipe.scheduler))
    assert all(not m._forward_pre_hooks for m in pipe.transformer.modules())


def test_plan_survives_save_and_load_and_patch_uses_it(calibrated_wan, tmp_path, monkeypatch):
    pipe, kwargs, plan = calibrated_wan["pipe"], calibrated_wan["kwargs"], calibrated_wan["result"].plan
    pipe.save_pretrained(tmp_path)
    with open(tmp_path / "transformer" / "config.json") as file:
        assert json.load(file)[PLAN_CONFIG_KEY] == plan.to_dict()
    loaded = diffusers.WanPipeline.from_pretrained(tmp_path, tokenizer=None, text_encoder=None, vae=None)
    assert loaded.transformer.config[PLAN_CONFIG_KEY] == plan.to_dict()

    with hf_qattn.patch(pipe, plan=plan):
        expected = run(pipe, kwargs, steps=STEPS)
    with hf_qattn.patch(loaded) as handle:  # no plan given: the stored one
        assert handle.plan.to_dict() == plan.to_dict()
        assert torch.equal(run(loaded, kwargs, steps=STEPS), expected)

    # a diffusers that dropped unknown config keys at load: the plan is read from config.json itself
    monkeypatch.setattr(loaded.transformer, "_internal_dict",
                        {k: v for k, v in loaded.transformer.config.items() if k != PLAN_CONFIG_KEY})
    assert PLAN_CONFIG_KEY not in loaded.transformer.config
    assert integration.stored_plan(loaded.transformer).to_dict() == plan.to_dict()
    # plan files: the model folder, its config.json, or a plan JSON
    for source in (tmp_path / "transformer", tmp_path / "transformer" / "config.json"):
        assert integration.load_plan(source).to_dict() == plan.to_dict()


def test_heatmap_png_from_result_and_from_saved_plan(calibrated_wan, tmp_path):
    result = calibrated_wan["result"]
    for source, name in ((result, "result.png"), (result.plan, "plan.png")):
        path = plot_scores(source, tmp_path / name, title="tiny wan")
        with open(path, "rb") as file:
            data = file.read()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    with pytest.raises(ValueError, match="no scores"):
        plot_scores(hf_qattn.QAttnPlan(), tmp_path / "x.png")


def test_two_denoisers_get_their_own_plans(seed):
    """Wan 2.2: ``transformer`` at high noise, ``transformer_2`` at low noise, one scheduler."""
    pipe, kwargs = build_wan()
    second = type(pipe.transformer).from_config(pipe.transformer.config)
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=pipe.transformer,
                                 transformer_2=second, scheduler=pipe.scheduler, boundary_ratio=0.7)
    calls, common = split_prompt(kwargs, 1)
    result = hf_qattn.calibrate_pipeline(pipe, calls, num_inference_steps=STEPS, ratio=0.5, **common)
    assert set(result.plans) == {"transformer", "transformer_2"}
    high = {s for s, _ in result.all_scores["transformer"]}
    low = {s for s, _ in result.all_scores["transformer_2"]}
    assert high and low and high.isdisjoint(low) and high | low == set(range(STEPS)) and max(high) < min(low)
    for name in result.plans:
        assert getattr(pipe, name).config[PLAN_CONFIG_KEY] == result.plans[name].to_dict()
    with hf_qattn.patch(pipe) as handle:
        assert {name: p.to_dict() for name, p in handle.plans.items()} == \
               {name: p.to_dict() for name, p in result.plans.items()}
        run(pipe, kwargs, steps=STEPS)


def test_calibration_bad_arguments(seed):
    pipe, kwargs = build_sd3()
    calls, common = split_prompt(kwargs, 1)
    with pytest.raises(ValueError, match="ratio"):
        hf_qattn.calibrate_pipeline(pipe, calls, ratio=1.5)
    with pytest.raises(ValueError, match="num_inference_steps"):
        hf_qattn.calibrate_pipeline(pipe, calls, num_inference_steps=0)
    with pytest.raises(ValueError, match="wrap it in a list"):
        hf_qattn.calibrate_pipeline(pipe, "a cat")
    with pytest.raises(ValueError, match="non-empty"):
        hf_qattn.calibrate_pipeline(pipe, [])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        hf_qattn.calibrate_pipeline(pipe, ["a cat", 7])
    with pytest.raises(TypeError, match="pipe must be"):
        hf_qattn.calibrate_pipeline(pipe.transformer, calls)
    with hf_qattn.patch(pipe):
        with pytest.raises(RuntimeError, match="already patched"):
            hf_qattn.calibrate_pipeline(pipe, calls, num_inference_steps=1, **common)


# -- the CLI pieces on a complete tiny pipeline (tokenizer, text encoder, VAE, transformer) ----------

def build_full_wan(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["<pad>", "</s>", "<unk>"] + "a an the cat dog fox sits runs on in mat snow red blue sky".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                          num_heads=2))
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4)
    pipe, _ = build_wan()
    pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, transformer=pipe.transformer,
                                 scheduler=pipe.scheduler)
    pipe.save_pretrained(directory)
    return len(attention_modules(pipe.transformer))


def test_cli_calibrate_pipeline(seed, tmp_path, capsys):
    layers = build_full_wan(tmp_path / "pipe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# calibration prompts\na cat sits on the mat\n\nthe red fox runs in snow\n")
    parser = argparse.ArgumentParser(prog="hf-qattn")
    add_calibrate_pipeline_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate-pipeline", str(tmp_path / "pipe"), "--prompts", str(prompts), "--steps",
                              "3", "--ratio", "0.25", "--out", str(tmp_path / "out"), "--height", "64", "--width",
                              "64", "--num-frames", "5", "--guidance-scale", "4.0"])
    assert args.func is run_calibrate_pipeline
    assert run_calibrate_pipeline(args) == 0
    out = tmp_path / "out"
    assert {"model_index.json", "transformer", "qattn_plan.transformer.json", "qattn_calibration.json",
            "qattn_scores.transformer.png"} <= set(os.listdir(out))
    assert (out / "qattn_scores.transformer.png").read_bytes().startswith(PNG_MAGIC)
    plan = integration.load_plan(out / "qattn_plan.transformer.json")
    assert plan.count()["int8"] == round(0.25 * 3 * layers) and plan.meta["prompts"] == 2
    reloaded = diffusers.DiffusionPipeline.from_pretrained(out)
    assert integration.stored_plan(reloaded.transformer).to_dict() == plan.to_dict()
    assert "int8" in capsys.readouterr().out

    for bad in ([], ["--ratio", "2"], ["--steps", "0"]):  # --prompts missing, ratio / steps out of range
        with pytest.raises(SystemExit):
            parser.parse_args(["calibrate-pipeline", str(tmp_path / "pipe"), "--out", str(out), *bad])
    args.prompts = str(tmp_path / "missing.txt")
    with pytest.raises(CLIError, match="--prompts"):
        run_calibrate_pipeline(args)
    args.prompts, args.pipeline_dir = str(prompts), str(tmp_path / "nowhere")
    with pytest.raises(CLIError, match="PIPELINE_DIR"):
        run_calibrate_pipeline(args)
