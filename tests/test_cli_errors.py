"""CLI errors (issue 15, item 5): one ``hf-qattn: error: ...`` line and a non-zero exit, found before any
model is loaded. Each case gave a traceback, or failed only after the whole calibration, before."""

from __future__ import annotations

import json

import pytest

from hf_qattn import cli
from hf_qattn.cli import calibrate as calibrate_module


def one_error_line(capsys, *fragments) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf-qattn: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model or tokenizer fails the test: errors must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(calibrate_module, "model_class", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    try:
        import diffusers

        monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", refuse)
    except ImportError:
        pass


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("# comment\n\n= Heading =\none\ntwo\nthree\n", encoding="utf-8")
    return path


def test_out_is_an_existing_file(model_dir, text_file, tmp_path, capsys, no_model_loading):
    """Was: FileExistsError after the whole calibration ran."""
    out = tmp_path / "out.txt"
    out.write_text("x")
    assert cli.main(["calibrate", str(model_dir), "--text", str(text_file), "--out", str(out)]) == 1
    one_error_line(capsys, "--out", "exists and is not a folder")
    nested = out / "sub"
    assert cli.main(["calibrate", str(model_dir), "--text", str(text_file), "--out", str(nested)]) == 1
    one_error_line(capsys, "--out", "is not a folder")


def test_text_not_utf8(model_dir, tmp_path, capsys, no_model_loading):
    """Was: UnicodeDecodeError traceback."""
    text = tmp_path / "latin1.txt"
    text.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    assert cli.main(["calibrate", str(model_dir), "--text", str(text), "--out", str(tmp_path / "o")]) == 1
    one_error_line(capsys, "--text", "not UTF-8", "0xe9")
    assert cli.main(["calibrate", str(model_dir), "--text", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    one_error_line(capsys, "--text: no such file")  # a folder


def test_skipped_lines_are_counted(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("# c\n\n\n = H = \na\nb\nc\n", encoding="utf-8")
    lines, skipped = cli.args.scan_text_lines(text, limit=2)
    assert lines == ["a", "b"]
    assert skipped == {"blank": 2, "'#' comment": 1, "'= heading ='": 1, "past --max-samples": 1}
    assert cli.read_text_lines(text) == ["a", "b", "c"]


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", "m", "--ratio", "2", "--text", "t", "--out", "o"])
    assert exit_info.value.code == 2
    one_error_line(capsys, "calibrate: argument --ratio", "see hf-qattn calibrate --help")
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    one_error_line(capsys, "invalid choice")
    with pytest.raises(SystemExit):
        cli.main(["calibrate-pipeline", "p", "--prompts", "f", "--out", "o", "--height", "-5"])
    one_error_line(capsys, "--height", "positive integer")


# --- calibrate-pipeline ----------------------------------------------------------------------------------
@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\n", encoding="utf-8")
    return path


def test_pipeline_dir_that_is_no_pipeline(tmp_path, prompts, capsys, no_model_loading):
    """Was: a 20-line OSError from diffusers."""
    assert cli.main(["calibrate-pipeline", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 1
    one_error_line(capsys, "PIPELINE_DIR", "not a diffusers pipeline folder (no model_index.json")


def test_pipeline_that_does_not_load(tmp_path, prompts, capsys):
    pytest.importorskip("diffusers")
    pipe_dir = tmp_path / "pipe"
    pipe_dir.mkdir()
    (pipe_dir / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    assert cli.main(["calibrate-pipeline", str(pipe_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                     "--device", "cpu"]) == 1
    # diffusers' own loading bar and logging come before it; the error itself is one line, the last
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1].startswith("hf-qattn: error: PIPELINE_DIR") and "the pipeline does not load" in lines[-1]
    assert sum(line.startswith("hf-qattn: error:") for line in lines) == 1 and "Traceback" not in lines[-2]


@pytest.mark.parametrize("content, fragment", [(b"\xff\xfe a", "not UTF-8"), (b"[1, 2", "not valid JSON"),
                                               (b'["a", 3]', "JSON list of strings")])
def test_bad_prompts_file(tmp_path, capsys, content, fragment, no_model_loading):
    pipe_dir = tmp_path / "pipe"
    pipe_dir.mkdir()
    (pipe_dir / "model_index.json").write_text("{}")
    path = tmp_path / "prompts.json"
    path.write_bytes(content)
    assert cli.main(["calibrate-pipeline", str(pipe_dir), "--prompts", str(path), "--out", str(tmp_path / "o")]) == 1
    one_error_line(capsys, "--prompts", fragment)


def test_pipeline_out_and_device_checked_first(tmp_path, prompts, capsys, no_model_loading):
    pipe_dir = tmp_path / "pipe"
    pipe_dir.mkdir()
    (pipe_dir / "model_index.json").write_text("{}")
    out = tmp_path / "file"
    out.write_text("x")
    assert cli.main(["calibrate-pipeline", str(pipe_dir), "--prompts", str(prompts), "--out", str(out)]) == 1
    one_error_line(capsys, "--out", "exists and is not a folder")
    assert cli.main(["calibrate-pipeline", str(pipe_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                     "--device", "gpu0"]) == 1
    one_error_line(capsys, "--device", "not a torch device")
