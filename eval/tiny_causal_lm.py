"""A tiny random causal LM folder (Llama architecture, word-level tokenizer) and a 2-document text, built
offline, for end-to-end runs of the evaluation commands (CI, tests).

    python eval/tiny_causal_lm.py OUT_DIR      # writes OUT_DIR/model/ and OUT_DIR/docs.txt; prints OUT_DIR

The text is in WikiText's layout (`` = Title = `` between blank lines), so the wikitext2_local task of
eval/lm_eval_tasks splits it into 2 documents.
"""

from __future__ import annotations

import os
import sys

DOCS = """ = First Article = 
 
 The quick brown fox jumps over the lazy dog . It was a sunny day , and the dog did not mind . 
 The fox ran into the forest and was never seen again . 
 
 = Second Article = 
 
 A small model reads a short text . The text has two articles , and each article has a title . 
 Perplexity is computed over whole documents , with rolling windows . 
"""


def build(out: str, seed: int = 0) -> tuple[str, str]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    text_file = os.path.join(out, "docs.txt")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(DOCS)
    words = sorted(set(DOCS.replace("=", " = ").split()) | set("abcdefghijklmnopqrstuvwxyz.,!?'\"-:;()"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model_dir = os.path.join(out, "model")
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, text_file


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    build(sys.argv[1])
    print(sys.argv[1])
