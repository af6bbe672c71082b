"""What verl's PPO trainer tests read from disk: a tiny llama with a real chat tokenizer
(SmolLM2's, from the prepared real model: ChatML template, pad token = end of turn), parquets of
arithmetic prompts in verl's RL dataset format, and the shaped reward (tests/verl/arithmetic_reward.py)."""
from __future__ import annotations

import os
import random
import shutil

from tests.real_model import smollm2_dir

REWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic_reward.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_chat_model(directory: str, seed: int = 0, model_type: str = "llama", **overrides) -> str:
    """A random tiny ``model_type`` (default llama; tests/tiny.py sizes, tied embeddings) with
    SmolLM2's tokenizer."""
    from tests.tiny import tiny_config, tiny_hf_model

    source = os.path.join(smollm2_dir(), "hf")
    os.makedirs(directory, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(source, name), directory)
    config = tiny_config(model_type, **{"vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1,
                                     "eos_token_id": 2, "pad_token_id": 2, "max_position_embeddings": 256,
                                     **overrides})
    tiny_hf_model(config, "actor", seed).save_pretrained(directory)
    return directory


def save_arithmetic_parquet(path: str, rows: int, seed: int = 0, max_operand: int = 9) -> str:
    """``rows`` questions "What is a + b? ..." in verl's RL format (prompt messages, data source,
    ground truth, index)."""
    import pandas as pd

    from mcore_rl.job.arithmetic_task import QUESTION

    rng = random.Random(seed)
    records = []
    for i in range(rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        records.append({"data_source": "arithmetic", "prompt": [{"role": "user", "content": QUESTION.format(a=a, op="+", b=b)}],
                        "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}})
    pd.DataFrame(records).to_parquet(path)
    return path
