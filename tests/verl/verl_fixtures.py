"""What the verl tests build on disk: a tiny HF model directory with a word-level tokenizer and a
chat template (nothing downloaded), and a parquet SFT dataset of chats."""
from __future__ import annotations

import os
import random

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_tokenizer(directory: str) -> int:
    """A word-level tokenizer (specials + WORDS) with a Qwen-like chat template; returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    return len(vocab)


def save_tiny_model(directory: str, model_type: str = "qwen2", role: str = "actor", seed: int = 0, **overrides) -> str:
    """A random tiny HF model (tests/tiny.py sizes) with the tokenizer above."""
    from tests.tiny import tiny_config, tiny_hf_model

    os.makedirs(directory, exist_ok=True)
    size = save_tokenizer(directory)
    config = tiny_config(model_type, **{"vocab_size": max(size, 64), **overrides})
    tiny_hf_model(config, role, seed).save_pretrained(directory)
    return directory


def save_sft_parquet(path: str, rows: int = 64, seed: int = 0, n_words: tuple[int, int] = (3, 8)) -> str:
    """Chats whose answer repeats the question's words (between ``n_words`` of them) in reverse
    (learnable by a tiny model)."""
    import pandas as pd

    rng = random.Random(seed)
    chats = []
    for _ in range(rows):
        words = [rng.choice(WORDS[:12]) for _ in range(rng.randint(*n_words))]
        chats.append([{"role": "user", "content": " ".join(words)},
                      {"role": "assistant", "content": " ".join(reversed(words))}])
    pd.DataFrame({"messages": chats}).to_parquet(path)
    return path
