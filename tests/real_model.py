"""The prepared real model (SmolLM2-135M-Instruct, `make prepare-smollm2`) and chat batches of it."""
from __future__ import annotations

import os

import pytest
import torch

QUESTIONS = ("What is 12 + 7?", "Name a prime number larger than 30.",
             "Write the word cat backwards.", "Is 91 divisible by 7? Answer yes or no.")


def smollm2_dir() -> str:
    """The prepared cache directory (hf/, mcore/); fails (never skips) when it is missing."""
    root = os.path.join(os.environ.get("MCORE_RL_CACHE", os.path.expanduser("~/.cache/mcore_rl")), "smollm2")
    if not (os.path.isdir(os.path.join(root, "hf")) and os.path.isdir(os.path.join(root, "mcore"))):
        pytest.fail(f"the real model is not prepared in {root}; run `make prepare-smollm2` (make test does).")
    return root


def gguf_path() -> str:
    return os.path.join(smollm2_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf")


def chat_batch(hf_dir: str, questions: tuple[str, ...] = QUESTIONS) -> dict:
    """Chat-templated prompts, left-padded with the tokenizer's pad id: input_ids and
    attention_mask [b, s] (rows of different lengths)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    rows = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
            for q in questions]
    rows = [r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    assert len({len(r) for r in rows}) > 1, "the rows must differ in length (left padding in use)"
    return {"input_ids": ids, "attention_mask": mask}


def next_token_log_probs(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """log p(token t+1 | ..t) [b, s-1] in fp32 from logits [b, s, V] (vocab padding cut by the caller)."""
    lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    return lp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
