"""What the main job trains on. A task gives each step's prompts (token ids) with the references
its reward needs, scores responses, and may hold out prompts for evaluation; ``make_task``
picks one by ``task.name`` from ``TASKS``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from mcore_rl.job.arithmetic_task import ArithmeticConfig, ArithmeticTask
from mcore_rl.job.prompts import Prompts
from mcore_rl.job.toy_task import ToyTask

Tensor = torch.Tensor


@dataclass(frozen=True)
class TaskConfig:
    """``name``: ``toy`` (copy the first prompt token; random prompts of ``prompt_length`` ids) or
    ``arithmetic`` (chat-formatted questions with an exact-match reward; see ``arithmetic``).
    ``response_length``: the most tokens sampled per response."""

    name: Literal["toy", "arithmetic"] = "toy"
    prompt_length: int = 4
    response_length: int = 2
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)

    def __post_init__(self) -> None:
        for name in ("prompt_length", "response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (the toy reward compares the "
                                 "first response token with the first prompt token)")


class Task(Protocol):
    """What the job asks of a task. ``eos_id``/``pad_id``: where responses end and what fills."""

    eos_id: int | None
    pad_id: int

    def train_prompts(self, step: int, count: int) -> Prompts:
        """``count`` prompts for ``step`` (the same on every rank for a seed)."""
        ...

    def held_out(self) -> Prompts | None:
        """Prompts never trained on, for evaluation; None when the task has none."""
        ...

    def score(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> Tensor:
        """[B] rewards of responses [B, R] (mask [B, R]: 1 = token) to ``prompts``."""
        ...

    def eval_metrics(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> dict[str, float]:
        """Named accuracies of held-out responses."""
        ...


TASKS = {"toy": ToyTask, "arithmetic": ArithmeticTask}


def make_task(config: TaskConfig, seed: int, vocab_size: int, tokenizer_dir: str | None) -> Task:
    """The task ``config.name`` for a model of ``vocab_size`` whose tokenizer lives in ``tokenizer_dir``."""
    return TASKS[config.name].create(config, seed, vocab_size, tokenizer_dir)
