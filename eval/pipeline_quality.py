"""Image and video quality of qattn in a diffusers pipeline, weight-free metrics against SDPA (CPU or GPU).

    python eval/pipeline_quality.py [--out eval/results] [--steps 8] [--prompts 2]

Tiny random pipelines (no downloads; text encoders bypassed with random prompt embeddings, one
embedding seed per "prompt"): a Flux image pipeline with a tiny VAE (32×32 pixels) and a Wan video
pipeline with a tiny Wan VAE (9 frames of 64×64). Each prompt is generated with the same generator
seed under SDPA (unpatched: the reference, then once more for the table's sdpa row), qattn int8 and
qattn int4 (``hf_qattn.patch(pipe, plan=...)``), decoded to pixels, and compared with the SDPA output
of the same seed by ``hf_qattn.evaluation.pipeline.run`` (the engine of ``hf-qattn eval-pipeline``): PSNR, SSIM,
the lowest per-frame cosine, and for video VBench's temporal-flickering score (with the SDPA
video's own beside it). Random weights make these small models far more sensitive than trained
ones; the table shows the metrics run end to end and how far quantization moves a pipeline's pixels.

The builders also make the pipelines with tiny text encoders (``tiny_flux(text_encoders=True)``,
:func:`save_tiny`): what the ``hf-qattn eval-pipeline`` tests and its saved tiny report run on.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

import hf_qattn
from hf_qattn.evaluation import pipeline as pipeline_eval
import report  # noqa: E402  (eval/report.py)


WORDS = ["<pad>", "</s>", "<unk>"] + "a an the cat dog fox sits runs on in mat snow red blue sky".split()


def tiny_tokenizer(max_length: int):
    """A word-level tokenizer over :data:`WORDS` (unknown words map to <unk>), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def tiny_flux(text_encoders: bool = False):
    """A tiny Flux pipeline with a tiny VAE (32×32 pixels); with ``text_encoders`` a tiny CLIP and T5
    and word-level tokenizers too, so that it runs on prompt text (as a saved pipeline must)."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                                   attention_head_dim=16, num_attention_heads=2,
                                                   joint_attention_dim=32, pooled_projection_dim=32,
                                                   axes_dims_rope=(4, 6, 6))
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4, sample_size=16,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, shift_factor=0.0, scaling_factor=1.0)
    encoders = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    if text_encoders:
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        clip = CLIPTextConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                              num_attention_heads=2, max_position_embeddings=77, projection_dim=32, pad_token_id=0,
                              bos_token_id=0, eos_token_id=1)
        t5 = T5Config(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        encoders = dict(text_encoder=CLIPTextModel(clip), tokenizer=tiny_tokenizer(77),
                        text_encoder_2=T5EncoderModel(t5), tokenizer_2=tiny_tokenizer(512))
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                  transformer=transformer, **encoders)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(prompt_embeds=torch.randn(1, 8, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    height=32, width=32)
    return pipe, inputs, "images"


def tiny_wan(text_encoders: bool = False):
    """A tiny Wan pipeline with a tiny Wan VAE (9 frames of 64×64); with ``text_encoders`` a tiny UMT5
    and a word-level tokenizer too."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                                  in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                                  num_layers=2, rope_max_seq_len=32)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4)
    encoders = dict(tokenizer=None, text_encoder=None)
    if text_encoders:
        from transformers import UMT5Config, UMT5EncoderModel

        encoders = dict(tokenizer=tiny_tokenizer(512), text_encoder=UMT5EncoderModel(UMT5Config(
            vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)))
    pipe = diffusers.WanPipeline(vae=vae, transformer=transformer,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), **encoders)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(prompt_embeds=torch.randn(1, 8, 32, generator=g),
                    negative_prompt_embeds=torch.randn(1, 8, 32, generator=g), height=64, width=64, num_frames=9,
                    guidance_scale=5.0)
    return pipe, inputs, "frames"


# what `hf-qattn eval-pipeline` needs to run the saved tiny pipelines quickly: their sizes, and 16
# text tokens instead of the 512 both pipelines pad prompts to by default
TINY_CLI_ARGS = {"flux": ["--height", "32", "--width", "32", "--pipeline-arg", "max_sequence_length=16"],
                 "wan": ["--height", "64", "--width", "64", "--num-frames", "9", "--guidance-scale", "5.0",
                         "--pipeline-arg", "max_sequence_length=16"]}


def save_tiny(name: str, directory) -> str:
    """Save the tiny ``"flux"`` (image) or ``"wan"`` (video) pipeline, text encoders included, to ``directory``."""
    pipe, _, _ = {"flux": tiny_flux, "wan": tiny_wan}[name](text_encoders=True)
    pipe.save_pretrained(str(directory))
    return str(directory)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name, build in (("flux (image)", tiny_flux), ("wan (video)", tiny_wan)):
        pipe, inputs, field = build()
        pipe.set_progress_bar_config(disable=True)
        calls = [pipeline_eval.Call(name=str(prompt), index=0, seed=prompt, kwargs=inputs(prompt))
                 for prompt in range(args.prompts)]
        # the reference, then SDPA again (its row: run-to-run agreement, inf when deterministic), int8, int4
        result = pipeline_eval.run(pipe, calls, ("sdpa", "sdpa", "int8", "int4"), steps=args.steps,
                                   kind="video" if field == "frames" else "image", progress=False)
        flicker_ref = {row["prompt"]: row.get("temporal_flickering") for row in result.rows if row["mode"] == "sdpa"}
        for row in result.rows:
            if row["mode"] == "sdpa":
                continue
            rows.append({"pipeline": name, "prompt": int(row["prompt"]), "mode": row["mode"].replace("#2", ""),
                         "shape": "×".join(map(str, result.shape)), "psnr": row["psnr"], "ssim": row.get("ssim"),
                         "cos_min": row["frame_cosine"], "flicker": row.get("temporal_flickering"),
                         "flicker_ref": flicker_ref[row["prompt"]], "calls": row["calls"],
                         "fallbacks": row["fallbacks"]})
            print(rows[-1], flush=True)
    keys = ["pipeline", "prompt", "mode", "shape", "psnr", "ssim", "cos_min", "flicker", "flicker_ref", "calls",
            "fallbacks"]

    def cell(value):
        return f"{value:.4f}" if isinstance(value, float) else str(value if value is not None else "-")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# Pipeline quality, weight-free metrics against SDPA — {where}, {datetime.date.today()}", "",
             f"torch {torch.__version__}, hf_qattn {hf_qattn.__version__}; `python eval/pipeline_quality.py "
             f"--steps {args.steps} --prompts {args.prompts}`; tiny random pipelines (see the script). psnr in dB "
             "(inf: identical), ssim and cos_min (lowest per-frame cosine) against the SDPA output of the same seed; "
             "flicker: VBench's temporal-flickering score of the video (flicker_ref: the SDPA video's).", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in keys) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    path = report.write(report.result_path("pipeline-quality", args.out), text)
    print("wrote", path)


if __name__ == "__main__":
    main()
