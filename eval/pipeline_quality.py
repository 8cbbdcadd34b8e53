"""Image and video quality of qattn in a diffusers pipeline, weight-free metrics against SDPA (CPU or GPU).

    python eval/pipeline_quality.py [--out eval/results] [--steps 8] [--prompts 2]

Tiny random pipelines (no downloads; text encoders bypassed with random prompt embeddings, one
embedding seed per "prompt"): a Flux image pipeline with a tiny VAE (32×32 pixels) and a Wan video
pipeline with a tiny Wan VAE (9 frames of 64×64). Each prompt is generated with the same generator
seed under SDPA (unpatched), qattn int8 and qattn int4 (``hf_qattn.patch(pipe, plan=...)``), decoded
to pixels, and compared with the SDPA output of the same seed by ``hf_qattn.quality``: PSNR, SSIM,
the lowest per-frame cosine, and for video VBench's temporal-flickering score (with the SDPA
video's own beside it). Random weights make these small models far more sensitive than trained
ones; the table shows the metrics run end to end and how far quantization moves a pipeline's pixels.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

import hf_qattn
from hf_qattn import quality


def tiny_flux():
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                                   attention_head_dim=16, num_attention_heads=2,
                                                   joint_attention_dim=32, pooled_projection_dim=32,
                                                   axes_dims_rope=(4, 6, 6))
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4, sample_size=16,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, shift_factor=0.0, scaling_factor=1.0)
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(prompt_embeds=torch.randn(1, 8, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    height=32, width=32)
    return pipe, inputs, "images"


def tiny_wan():
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                                  in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                                  num_layers=2, rope_max_seq_len=32)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4)
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(prompt_embeds=torch.randn(1, 8, 32, generator=g),
                    negative_prompt_embeds=torch.randn(1, 8, 32, generator=g), height=64, width=64, num_frames=9,
                    guidance_scale=5.0)
    return pipe, inputs, "frames"


def generate(pipe, kwargs, field: str, steps: int, seed: int) -> torch.Tensor:
    out = pipe(**kwargs, num_inference_steps=steps, output_type="pt", generator=torch.Generator().manual_seed(seed))
    return getattr(out, field).float().cpu()


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
        for prompt in range(args.prompts):
            kwargs = inputs(prompt)
            with torch.no_grad():
                reference = generate(pipe, kwargs, field, args.steps, seed=prompt)
                for mode in ("sdpa", "int8", "int4"):
                    hf_qattn.reset_fallback_stats()
                    if mode == "sdpa":
                        out = generate(pipe, kwargs, field, args.steps, seed=prompt)
                    else:
                        with hf_qattn.patch(pipe, plan=mode):
                            out = generate(pipe, kwargs, field, args.steps, seed=prompt)
                    calls = hf_qattn.fallback_stats()
                    row = {"pipeline": name, "prompt": prompt, "mode": mode, "shape": "×".join(map(str, out.shape[1:])),
                           **quality.report(reference, out), "calls": sum(calls["calls"].values()),
                           "fallbacks": sum(calls["fallbacks"].values())}
                    rows.append(row)
                    print(row, flush=True)
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
    os.makedirs(args.out, exist_ok=True)
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().replace(" ", "-")
    path = os.path.join(args.out, f"pipeline-quality-{device}-{datetime.date.today()}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print("wrote", path)


if __name__ == "__main__":
    main()
