"""Short arithmetic questions with an exact-match reward, in the model's chat template.

Every question "What is a <op> b? Answer with the number only." with operands 0..max_operand
(subtraction: a >= b, so answers are never negative) is enumerated once; a fixed share of
them, chosen by a hash of the text (the same for every seed), is held out and never trained
on. A response scores 1 when the last integer in its text (without special tokens) is exactly
the answer ("The answer is 12." and "5 + 7 = 12" both count; "12 or 13" does not), else 0.
Responses that are cut off before the number score 0.
"""
from __future__ import annotations

import operator
import re
import zlib
from dataclasses import dataclass

import torch

from mcore_rl.config_loader import ConfigError
from mcore_rl.job.prompts import Prompts

Tensor = torch.Tensor
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
QUESTION = "What is {a} {op} {b}? Answer with the number only."


@dataclass(frozen=True)
class ArithmeticConfig:
    """Operands 0..``max_operand`` with ``operations``; ``held_out_percent`` of all questions are
    held out; evaluation uses the first ``eval_questions`` of them (0: all). ``system_prompt``:
    None keeps the chat template's default."""

    max_operand: int = 20
    operations: tuple[str, ...] = ("+", "-")
    held_out_percent: int = 25
    eval_questions: int = 0
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(f"operations={list(self.operations)}: each must be one of {sorted(OPERATIONS)}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand={self.max_operand} must be >= 1")
        if not 0 < self.held_out_percent < 100:
            raise ValueError(f"held_out_percent={self.held_out_percent} must be in 1..99 (both splits need questions)")
        if self.eval_questions < 0:
            raise ValueError(f"eval_questions={self.eval_questions} must be >= 0 (0: every held-out question)")


def questions(config: ArithmeticConfig) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(training, held-out) lists of (question text, answer)."""
    train, held = [], []
    for op in config.operations:
        for a in range(config.max_operand + 1):
            for b in range(config.max_operand + 1):
                if op == "-" and a < b:
                    continue
                text = QUESTION.format(a=a, op=op, b=b)
                split = held if zlib.crc32(text.encode()) % 100 < config.held_out_percent else train
                split.append((text, OPERATIONS[op](a, b)))
    return train, held


def last_integer(text: str) -> str | None:
    """The last integer written in ``text`` (a leading minus sign kept), None without one."""
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


class ArithmeticTask:
    """The questions tokenized once with the model's chat template; prompts for a step are drawn
    from the training questions with a generator seeded by (seed, step)."""

    def __init__(self, config: ArithmeticConfig, tokenizer, seed: int) -> None:
        self.config, self.tokenizer, self.seed = config, tokenizer, seed
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        train, held = questions(config)
        self.train = [(self._encode(q), str(a)) for q, a in train]
        count = config.eval_questions or len(held)
        self.held = [(self._encode(q), str(a)) for q, a in held[:count]]

    @classmethod
    def create(cls, config, seed: int, vocab_size: int, tokenizer_dir: str | None) -> "ArithmeticTask":
        """From the job's TaskConfig and the model's tokenizer (it needs a chat template)."""
        from transformers import AutoTokenizer

        if tokenizer_dir is None:
            raise ConfigError("task.name=arithmetic needs a tokenizer with a chat template: start from "
                             "model.hf_dir or model.mcore_dir, not the embedded tiny model")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not tokenizer.chat_template:
            raise ConfigError(f"the tokenizer in {tokenizer_dir} has no chat template; task.name=arithmetic "
                             "formats questions with it (use an instruct model's directory)")
        return cls(config.arithmetic, tokenizer, seed)

    def _encode(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        if self.config.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def train_prompts(self, step: int, count: int) -> Prompts:
        """``count`` training questions drawn with replacement; references are the answers."""
        g = torch.Generator(device="cpu").manual_seed(self.seed * 100_003 + step)  # host: the same draw on every rank
        picks = torch.randint(0, len(self.train), (count,), generator=g, device="cpu").tolist()  # host: indices
        return Prompts([self.train[i][0] for i in picks], [self.train[i][1] for i in picks])

    def held_out(self) -> Prompts:
        """The evaluation questions (never drawn by ``train_prompts``)."""
        return Prompts([ids for ids, _ in self.held], [a for _, a in self.held])

    def texts(self, responses: Tensor, mask: Tensor) -> list[str]:
        """Each response's text without special tokens (masked positions dropped)."""
        return [self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True) for row, m in zip(responses, mask)]

    def score(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> Tensor:
        """[B] 1.0 where the response's last integer is exactly the answer."""
        texts = self.texts(responses, mask)
        return torch.tensor([float(last_integer(t) == ref) for t, ref in zip(texts, prompts.references)],
                            device=responses.device)

    def eval_metrics(self, prompts: Prompts, responses: Tensor, mask: Tensor) -> dict[str, float]:
        """``accuracy`` (the reward) and ``number_only_accuracy`` (the whole response, without outer
        space and a final period, is the answer: what the question asks for)."""
        texts = self.texts(responses, mask)
        only = [t.strip().removesuffix(".").strip() == ref for t, ref in zip(texts, prompts.references)]
        return {"accuracy": float(self.score(prompts, responses, mask).mean()),
                "number_only_accuracy": sum(only) / len(texts)}
