"""``hf-qattn eval-pipeline``: end to end on a tiny Flux (image) and a tiny Wan (video) pipeline, saved with
tiny text encoders (eval/pipeline_quality.py ``save_tiny``), 2 prompts each; the VBench file names; what
happens without diffusers or torchmetrics, without VBench, without a plan, and on a folder that is no pipeline."""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import re
import shutil
import sys
import types

import pytest
import torch

from hf_qattn import cli
from hf_qattn.evaluation import pipeline as pipeline_eval
from hf_qattn.plan import PLAN_CONFIG_KEY, QAttnPlan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("diffusers")
sys.path.insert(0, os.path.join(REPO, "eval"))
import pipeline_quality  # noqa: E402

PROMPTS = ["a red cat sits on the mat", "the blue fox, in snow / sky"]
STEMS = ["a red cat sits on the mat-0", "the blue fox, in snow _ sky-0"]  # "/" cannot be in a file name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    prompts = root / "prompts.txt"
    prompts.write_text("# two prompts\n" + "\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    return {"flux": pipeline_quality.save_tiny("flux", root / "flux"),
            "wan": pipeline_quality.save_tiny("wan", root / "wan"), "prompts": str(prompts)}


def _run(pipeline_dir, prompts, out, modes, *extra, kind="flux"):
    return cli.main(["eval-pipeline", str(pipeline_dir), "--prompts", str(prompts), "--modes", modes, "--out", str(out),
                     "--steps", "2", "--no-progress", *pipeline_quality.TINY_CLI_ARGS[kind], *extra])


def _hide(monkeypatch, *names):
    """Make ``importlib.util.find_spec`` report ``names`` as not installed."""
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("hf-qattn: error: ")
    return err[0]


def test_image_pipeline_modes_metrics_and_files(tiny, tmp_path, capsys):
    # a calibrated-looking pipeline: a (step, layer) plan stored in the transformer's config, as
    # calibrate-pipeline writes it
    planned = tmp_path / "flux-planned"
    shutil.copytree(tiny["flux"], planned)
    config = json.loads((planned / "transformer" / "config.json").read_text())
    plan = QAttnPlan(default="int4", steps={0: {0: "int8"}, 1: {2: "int8"}}, num_layers=3, num_steps=2)
    config[PLAN_CONFIG_KEY] = plan.to_dict()
    (planned / "transformer" / "config.json").write_text(json.dumps(config))

    out = tmp_path / "out"
    assert _run(planned, tiny["prompts"], out, "sdpa,sdpa,int8,int8,int4,plan") == 0
    record = json.loads((out / "eval-pipeline.json").read_text())
    labels = ["sdpa", "sdpa#2", "int8", "int8#2", "int4", "plan"]
    assert record["kind"] == "image" and record["modes"] == labels and record["shape"] == [3, 32, 32]
    assert record["prompts"] == PROMPTS and record["model"]["pipeline"] == "FluxPipeline"
    assert {"hf_qattn", "torch", "diffusers", "python"} <= set(record["versions"])
    assert record["device"].split()[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert record["seed"] == 0 and record["date"] and "--modes" in record["command"]
    assert record["plan"]["plan"]["transformer"] == plan.to_dict()  # the stored plan is what ran
    assert record["plan"]["int8"]["transformer"]["default"] == "int8"

    # the table's columns; metrics per mode: mean and worst
    table = (out / "eval-pipeline.md").read_text()
    assert ("| mode | psnr mean | psnr worst | ssim mean | ssim worst | frame_cosine mean | frame_cosine worst | "
            "calls | fallbacks |") in table
    assert "temporal_flickering mean" not in table  # images have no flickering
    summary = record["summary"]
    for label in ("sdpa", "sdpa#2"):  # the reference, and SDPA run again: identical pixels
        assert summary[label]["psnr"] == {"mean": math.inf, "worst": math.inf}
        assert summary[label]["ssim"] == {"mean": 1.0, "worst": 1.0}
    assert summary["int8"] == summary["int8#2"]  # two runs of one mode agree
    for label in ("int8", "int4", "plan"):
        assert 40.0 < summary[label]["psnr"]["worst"] <= summary[label]["psnr"]["mean"] < math.inf
        assert sum(record["calls"][label]["calls"].values()) == 2 * 2 * 3  # prompts × steps × layers
        assert not record["calls"][label]["fallbacks"]
    assert record["calls"]["sdpa"] == {"calls": {}, "fallbacks": {}}

    # per prompt rows, seeds, and VBench's layout: one folder per mode, {prompt}-{index}.png
    rows = record["rows"]
    assert len(rows) == 2 * len(labels) and [r["mode"] for r in rows[:len(labels)]] == labels
    assert {(r["prompt"], r["seed"]) for r in rows} == {(PROMPTS[0], 0), (PROMPTS[1], 1)}
    for label in labels:
        assert sorted(os.listdir(out / label)) == sorted(stem + ".png" for stem in STEMS)
        assert {r["file"] for r in rows if r["mode"] == label} == {f"{label}/{stem}.png" for stem in STEMS}
    for stem in STEMS:
        assert (out / "int8" / f"{stem}.png").read_bytes() == (out / "int8#2" / f"{stem}.png").read_bytes()
        assert (out / "sdpa" / f"{stem}.png").read_bytes() == (out / "sdpa#2" / f"{stem}.png").read_bytes()
    assert record["vbench"]["dimensions"]["temporal_flickering"] == {"status": "skipped",
                                                                     "reason": "images: VBench scores videos"}


def test_video_pipeline_without_vbench_or_video_writer(tiny, tmp_path, monkeypatch, capsys):
    _hide(monkeypatch, "vbench", "imageio", "torchvision")
    out = tmp_path / "out"
    assert _run(tiny["wan"], tiny["prompts"], out, "int8", "--num-videos-per-prompt", "2", kind="wan") == 0
    printed = capsys.readouterr().out
    assert "note: mode sdpa added" in printed
    skipped = [line for line in printed.splitlines() if line.startswith("VBench skipped")]
    assert len(skipped) == 1 and "VBench missing" in skipped[0] and "temporal_flickering" in skipped[0]
    record = json.loads((out / "eval-pipeline.json").read_text())
    assert record["kind"] == "video" and record["modes"] == ["sdpa", "int8"] and record["shape"] == [9, 3, 64, 64]
    assert record["writer"] == "png-frames"
    for entry in record["vbench"]["dimensions"].values():
        assert entry["status"] == "skipped" and entry["reason"].startswith("VBench missing")
    table = (out / "eval-pipeline.md").read_text()
    assert "| temporal_flickering mean | temporal_flickering worst |" in table
    assert "VBench missing" in table and "PNG frames" in table
    summary = record["summary"]
    assert summary["sdpa"]["psnr"]["mean"] == math.inf and 40.0 < summary["int8"]["psnr"]["worst"] < math.inf
    assert 0.0 < summary["int8"]["temporal_flickering"]["mean"] <= 1.0
    # 2 samples per prompt: indices 0 and 1, seeds SEED + i·2 + j; frames as PNGs in {prompt}-{index}/
    assert sorted((r["prompt"], r["index"], r["seed"]) for r in record["rows"] if r["mode"] == "int8") == \
        [(PROMPTS[0], 0, 0), (PROMPTS[0], 1, 1), (PROMPTS[1], 0, 2), (PROMPTS[1], 1, 3)]
    expected = {f"{stem[:-2]}-{j}" for stem in STEMS for j in (0, 1)}
    for label in ("sdpa", "int8"):
        assert set(os.listdir(out / label)) == expected
        for name in expected:
            assert sorted(os.listdir(out / label / name)) == [f"{i:05d}.png" for i in range(9)]


@pytest.mark.parametrize("missing", ["diffusers", "torchmetrics"])
def test_missing_dependency_is_one_line(tiny, tmp_path, monkeypatch, capsys, missing):
    _hide(monkeypatch, missing)
    assert _run(tiny["flux"], tiny["prompts"], tmp_path / "out", "sdpa,int8") == 1
    assert f"install {missing}" in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_folder_that_is_no_pipeline(tiny, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(empty, tiny["prompts"], tmp_path / "out", "sdpa,int8") == 1
    assert "is not a diffusers pipeline folder" in _one_error_line(capsys)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                         "transformer": ["diffusers", "FluxTransformer2DModel"],
                                                         "text_encoder": ["transformers", "CLIPTextModel"]}))
    assert _run(broken, tiny["prompts"], tmp_path / "out", "sdpa,int8") == 1
    assert "the pipeline does not load" in _one_error_line(capsys)
    assert _run(tmp_path / "nowhere", tiny["prompts"], tmp_path / "out", "sdpa") == 1
    assert "no such folder" in _one_error_line(capsys)


def test_argument_errors_before_loading(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(tiny["flux"], tiny["prompts"], out, "sdpa,plan") == 1  # no stored plan, no --plan
    assert "mode 'plan' needs a plan" in _one_error_line(capsys)
    twice = tmp_path / "twice.txt"
    twice.write_text("a cat\na cat\n")
    assert _run(tiny["flux"], twice, out, "sdpa") == 1
    assert "prompts 1 and 2 give the same file name" in _one_error_line(capsys)
    assert _run(tiny["flux"], tiny["prompts"], out, "sdpa", "--pipeline-arg", "num_inference_steps=3") == 1
    assert "use --steps" in _one_error_line(capsys)
    assert _run(tiny["flux"], tiny["prompts"], out, "sdpa,plan", "--plan", str(tmp_path / "missing.json")) == 1
    assert _one_error_line(capsys).startswith("hf-qattn: error: --plan")
    assert _run(tiny["flux"], tiny["prompts"], out, "sdpa,int8", "--plan", str(tmp_path / "missing.json")) == 1
    assert "--plan is for mode plan" in _one_error_line(capsys)
    assert not out.exists()
    for bad in (["--modes", "sdpa,fp8"], ["--vbench-dimensions", "sharpness"], ["--pipeline-arg", "novalue"],
                ["--kind", "audio"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["eval-pipeline", tiny["flux"], "--prompts", tiny["prompts"], "--out", str(out), *bad])
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_option_the_pipeline_does_not_take(tiny, tmp_path, capsys):
    assert _run(tiny["flux"], tiny["prompts"], tmp_path / "out", "sdpa", "--num-frames", "9") == 1
    assert "--num-frames: FluxPipeline takes no argument 'num_frames'" in _one_error_line(capsys)


def test_vbench_names():
    def prompt_of(stem):  # what VBench's custom_input mode reads back from a file name
        return re.sub(r"-\d+$", "", stem)

    for prompt in ("A 3D model of a 1800s victorian house.", "Cinematic shot of Van Gogh's selfie, Van Gogh style",
                   "a cat: wearing sunglasses? *yes*"):
        assert pipeline_eval.vbench_stem(prompt, 3) == f"{prompt}-3" and prompt_of(f"{prompt}-3") == prompt
    assert pipeline_eval.vbench_stem("  Close up of grapes on a rotating table. ", 0) == \
        "Close up of grapes on a rotating table.-0"  # stripped, as VBench strips its prompt lines
    assert pipeline_eval.vbench_stem("AC/DC\non stage", 1) == "AC_DC_on stage-1"
    long = "x" * 300
    assert pipeline_eval.vbench_stem(long, 4) == "x" * 180 + "-4"  # VBench-2.0 keeps 180 characters
    wide = "视频" * 120  # 180 characters, 540 bytes of UTF-8: cut to fit 255 bytes with the suffix
    stem = pipeline_eval.vbench_stem(wide, 0)
    assert stem.endswith("-0") and len((stem + ".mp4").encode()) <= 255 and wide.startswith(stem[:-2])


def test_pixels_reads_every_output_form():
    import numpy as np
    from PIL import Image

    images = types.SimpleNamespace(images=torch.rand(2, 3, 16, 16))
    tensor, kind = pipeline_eval.pixels(images)
    assert kind == "image" and torch.equal(tensor, images.images)
    frames = types.SimpleNamespace(frames=np.random.rand(1, 5, 16, 16, 3).astype(np.float32))  # "np": channels last
    tensor, kind = pipeline_eval.pixels(frames)
    assert kind == "video" and tensor.shape == (1, 5, 3, 16, 16)
    assert torch.equal(tensor[0, 2, 1], torch.from_numpy(frames.frames[0, 2, :, :, 1]))
    pil = types.SimpleNamespace(images=[Image.new("RGB", (16, 8), (255, 0, 0))])
    tensor, kind = pipeline_eval.pixels(pil)
    assert kind == "image" and tensor.shape == (1, 3, 8, 16) and tensor[0, 0].min() == 1.0 and tensor[0, 1].max() == 0
    tensor, kind = pipeline_eval.pixels(images, kind="video")  # forced: the images are one video's frames
    assert kind == "video" and tensor.shape == (1, 2, 3, 16, 16)
    with pytest.raises(ValueError, match="videos of 5 frames"):
        pipeline_eval.pixels(frames, kind="image")


def test_vbench_skips_and_runs(tmp_path, monkeypatch):
    """With a stand-in vbench package: which dimensions run, which are skipped and why, and that a
    failing dimension is one line and spares the others."""
    cache = tmp_path / "cache"
    (cache / "clip_model").mkdir(parents=True)
    (cache / "clip_model" / "ViT-B-32.pt").write_bytes(b"")
    monkeypatch.setenv("VBENCH_CACHE_DIR", str(cache))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(name, None)
                        if name == "vbench" else real(name, *a))
    dims = ["temporal_flickering", "background_consistency", "motion_smoothness", "color"]
    skips = pipeline_eval.vbench_skips(dims, "video", "imageio")
    assert skips["temporal_flickering"] is None and skips["background_consistency"] is None
    assert skips["motion_smoothness"].startswith("weights missing: " + str(cache / "amt_model" / "amt-s.pth"))
    assert "prompt suite" in skips["color"]
    assert pipeline_eval.vbench_skips(dims, "video", "png-frames")["temporal_flickering"].startswith("videos saved as")
    assert set(pipeline_eval.vbench_skips(dims, "image", "imageio").values()) == {"images: VBench scores videos"}

    calls = []

    class FakeVBench:
        def __init__(self, device, full_info, output):
            self.output = output
            os.makedirs(output, exist_ok=True)

        def evaluate(self, videos_path, name, dimension_list, local, mode):
            calls.append((videos_path, name, dimension_list, local, mode))
            if dimension_list == ["background_consistency"]:
                raise RuntimeError("CLIP weights do not load\nlong traceback text")
            with open(os.path.join(self.output, f"{name}_eval_results.json"), "w") as file:
                json.dump({dimension_list[0]: [0.97, []]}, file)

    fake = types.ModuleType("vbench")
    fake.__file__ = str(tmp_path / "vbench" / "__init__.py")
    fake.VBench = FakeVBench
    monkeypatch.setitem(sys.modules, "vbench", fake)
    folders = {"sdpa": str(tmp_path / "sdpa"), "int8": str(tmp_path / "int8")}
    results = pipeline_eval.run_vbench(folders, ["temporal_flickering", "background_consistency"],
                                       str(tmp_path / "vbench"), "cpu")
    assert results["temporal_flickering"] == {"scores": {"sdpa": 0.97, "int8": 0.97}, "failed": {}}
    assert results["background_consistency"]["failed"] == {
        label: "RuntimeError: CLIP weights do not load" for label in folders}
    assert all(call[3] is True and call[4] == "custom_input" for call in calls)  # local weights, custom prompts


def test_mp4_files_with_imageio(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    imageio = pytest.importorskip("imageio")
    assert pipeline_eval.video_writer() == "imageio"
    video = torch.rand(9, 3, 32, 48)
    name = pipeline_eval.save_sample(tmp_path, pipeline_eval.vbench_stem("a cat", 0), video, "video", fps=8)
    assert name == "a cat-0.mp4"
    assert imageio.v3.imread(tmp_path / name).shape == (9, 32, 48, 3)


def test_report_lists_vbench_scores_failures_and_skips():
    from hf_qattn.cli.eval_pipeline import markdown

    labels = ["sdpa", "int8"]
    summary = {"sdpa": {"psnr": {"mean": math.inf, "worst": math.inf}},
               "int8": {"psnr": {"mean": 61.25, "worst": 58.5}}}
    record = {"model": {"path": "/x/tiny-wan", "pipeline": "WanPipeline"}, "kind": "video", "modes": labels,
              "summary": summary, "date": "d", "device": "cpu", "dtype": "float32", "seed": 0, "steps": 2,
              "prompts": ["a cat"], "samples_per_prompt": 1, "versions": {"torch": "2"}, "command": "hf-qattn ...",
              "calls": {label: {"calls": {}, "fallbacks": {}} for label in labels}, "plan": {}, "out": "o",
              "files_note": "mp4", "rows": [],
              "vbench": {"commands": [], "dimensions": {
                  "temporal_flickering": {"status": "ran", "scores": {"sdpa": 0.97, "int8": 0.96}, "failed": {}},
                  "dynamic_degree": {"status": "ran", "scores": {"sdpa": 0.5}, "failed": {"int8": "OSError: x"}},
                  "subject_consistency": {"status": "skipped", "reason": "weights missing: w"},
                  "imaging_quality": {"status": "skipped", "reason": "weights missing: w"}}}}
    text = markdown(record)
    assert "| mode | psnr mean | psnr worst | calls | fallbacks |" in text
    assert "| int8 | 61.25 | 58.50 | 0 | 0 |" in text
    assert "| temporal_flickering | ran | 0.970000 | 0.960000 |" in text
    assert "| dynamic_degree | failed: int8: OSError: x | 0.500000 | - |" in text
    assert "- skipped subject_consistency, imaging_quality: weights missing: w" in text
