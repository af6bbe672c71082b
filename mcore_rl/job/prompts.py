"""Prompts as the job's tasks hand them out: token ids and per-prompt references."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Prompts:
    """Prompts as token ids (any lengths) and, per prompt, what its reward compares with."""

    token_ids: list[list[int]]
    references: list[Any]

    def repeat(self, n: int) -> "Prompts":
        """Each prompt ``n`` times in a row (a GRPO group)."""
        return Prompts([p for p in self.token_ids for _ in range(n)], [r for r in self.references for _ in range(n)])
