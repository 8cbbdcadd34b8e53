"""Shared fixtures. Tests draw fresh random inputs every run; the seed is printed (shown on failure)
and can be fixed with HF_QATTN_SEED=<n> to replay a failing run."""

from __future__ import annotations

import os
import time

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """Seed torch from the clock (or HF_QATTN_SEED); printed so a failure report shows it."""
    value = int(os.environ.get("HF_QATTN_SEED", time.time_ns() % 2**31))
    torch.manual_seed(value)
    print(f"random seed: {value}  (replay with HF_QATTN_SEED={value})")
    return value


@pytest.fixture
def fresh_stats():
    """hf_qattn's call/fallback counters, zeroed before the test."""
    import hf_qattn

    hf_qattn.reset_fallback_stats()
    yield hf_qattn.fallback_stats
    hf_qattn.reset_fallback_stats()


# Tiny transformers models built from configs (random weights, nothing downloaded).
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128)


def _tiny_config(kind: str, **overrides):
    import transformers as tf

    if kind == "llama":
        config = tf.LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    elif kind == "qwen2":
        config = tf.Qwen2Config(**_TINY, num_attention_heads=4, num_key_value_heads=1)
    elif kind == "mistral":
        config = tf.MistralConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  sliding_window=4096)
    elif kind == "gemma":
        config = tf.GemmaConfig(**_TINY, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    elif kind == "gemma2":
        config = tf.Gemma2Config(**_TINY, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    elif kind == "gpt_neox":
        config = tf.GPTNeoXConfig(**_TINY, num_attention_heads=4)
    elif kind == "bert":
        config = tf.BertConfig(**_TINY, num_attention_heads=4, attention_probs_dropout_prob=0.0,
                               hidden_dropout_prob=0.0)
    elif kind == "vit":
        config = tf.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture
def tiny_model():
    """``tiny_model(kind, head="base"|"lm", attn="sdpa", **config_overrides)`` → an eval-mode model."""
    import transformers as tf

    def build(kind: str, head: str = "base", attn: str = "sdpa", **overrides):
        config = _tiny_config(kind, **overrides)
        if head == "lm":
            model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        else:
            model = tf.AutoModel.from_config(config, attn_implementation=attn)
        return model.eval()

    return build


# The tests run the quantized kernels at small shapes: on a GPU the transformers integration would hand calls
# shorter than the kernels' break-even to SDPA (hf_qattn.support.below_break_even); tests/test_break_even.py
# turns that back on where it tests it.
os.environ.setdefault("HF_QATTN_BREAK_EVEN", "0")

# Under pytest-xdist (the README's `-n auto`) each worker takes its share of the cores for torch's threads: a
# worker per core each running as many threads as there are cores would oversubscribe the machine.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# The real Triton kernels run on the CPU under Triton's interpreter. The switch is read when a
# kernel module is imported, so it is set here, before any test imports hf_qattn.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
