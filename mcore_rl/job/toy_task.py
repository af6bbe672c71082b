"""A prompt-conditioned toy task: answer with the token the prompt starts with.

Prompts are random token ids from the model's vocabulary; the reward is 1 when the first
response token equals the first prompt token, else 0. A random policy scores 1 / vocab_size.
"""
from __future__ import annotations

import torch

from mcore_rl.job.prompts import Prompts

Tensor = torch.Tensor


class ToyTask:
    """Random prompts of ``prompt_length`` ids, the same on every rank for a step and seed; no
    end-of-sequence token, no held-out set."""

    eos_id = None
    pad_id = 0

    def __init__(self, prompt_length: int, vocab_size: int, seed: int) -> None:
        self.prompt_length, self.vocab_size, self.seed = prompt_length, vocab_size, seed

    @classmethod
    def create(cls, config, seed: int, vocab_size: int, tokenizer_dir: str | None) -> "ToyTask":
        """From the job's TaskConfig (the tokenizer is not used: prompts are ids)."""
        return cls(config.prompt_length, vocab_size, seed)

    def train_prompts(self, step: int, count: int) -> Prompts:
        """``count`` prompts; references are their first tokens."""
        g = torch.Generator(device="cpu").manual_seed(self.seed * 100_003 + step)  # host: the same prompts on every device
        ids = torch.randint(0, self.vocab_size, (count, self.prompt_length), generator=g, device="cpu")  # host: token ids
        rows = ids.tolist()
        return Prompts(rows, [r[0] for r in rows])

    def held_out(self) -> None:
        return None

    def score(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> Tensor:
        """[B] 1.0 where the first response token copies the first prompt token."""
        first = torch.tensor(prompts.references, device=responses.device)
        return ((responses[:, 0] == first) & (mask[:, 0] > 0)).float()

    def eval_metrics(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> dict[str, float]:
        return {"accuracy": float(self.score(prompts, responses, mask).mean())}
