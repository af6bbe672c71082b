"""A prompt-conditioned toy task: answer with the token the prompt starts with.

Prompts are random token ids from the model's vocabulary; the reward is 1 when the first
response token equals the first prompt token, else 0. A random policy scores 1 / vocab_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.platform import active_platform

Tensor = torch.Tensor


@dataclass(frozen=True)
class ToyTaskConfig:
    """Prompt and response lengths of the copy-the-first-token task."""

    prompt_length: int = 4
    response_length: int = 2

    def __post_init__(self) -> None:
        for name in ("prompt_length", "response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (the reward compares the "
                                 "first response token with the first prompt token)")


def make_prompts(config: ToyTaskConfig, count: int, vocab_size: int, step: int, seed: int) -> Tensor:
    """[count, prompt_length] prompt ids on the platform's device, the same on every rank for
    a given step and seed (drawn on the host so every device type gives the same prompts)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 100_003 + step)  # host: the same prompts on every device
    prompts = torch.randint(0, vocab_size, (count, config.prompt_length), generator=g, device="cpu")  # host: moved by the sampler
    return prompts.to(active_platform().device())


def reward(batch: dict) -> Tensor:
    """[B] 1.0 where the first response token copies the first prompt token."""
    return (batch["responses"][:, 0] == batch["input_ids"][:, 0]).float()
