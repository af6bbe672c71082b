"""How checkpoints store routed experts fused into one tensor per kind, as data.

The mapping tables name routed experts one at a time (``<layer>.mlp.experts.{e}.gate_proj.weight``
...); a fused checkpoint stores each kind for all E experts in one tensor. An ``ExpertLayout``
says, per fused tensor kind, its shape for (E experts, expert intermediate size I, hidden size
H), the per-expert parts it holds and how one expert's slice splits into them and joins back.
Splitting and joining only move values, so a round trip is bit-exact.

* ``qwen`` (published Qwen3.5-MoE): ``gate_up_proj`` [E, 2I, H] (each expert's gate rows then its
  up rows), ``down_proj`` [E, H, I].
* ``gpt_oss``: transposed, gate and up interleaved, with biases: ``gate_up_proj`` [E, H, 2I]
  (column 2j is gate row j, column 2j+1 up row j), ``gate_up_proj_bias`` [E, 2I] (interleaved
  likewise), ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H].

No megatron import (the merge runs without it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class FusedKind:
    """One fused tensor kind: ``shape(E, I, H)``; ``parts``: the per-expert tensor names (after
    ``experts.{e}.``) one expert's slice holds; ``split(slice, I)`` -> those parts (contiguous),
    ``join(parts)`` -> the slice; ``what``: the shape in words, for errors; ``labels``: where
    each part lies in the slice, in words (none for a kind of one part)."""

    shape: Callable[[int, int, int], tuple[int, ...]]
    parts: tuple[str, ...]
    split: Callable[[Tensor, int], list[Tensor]]
    join: Callable[[list[Tensor]], Tensor]
    what: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertLayout:
    """The fused kinds of an architecture (name -> kind), in the order a merge writes them."""

    name: str
    kinds: dict[str, FusedKind]

    @property
    def fused_pattern(self) -> re.Pattern:
        """Matches a fused tensor's name: group 1 the experts' prefix, group 2 the kind."""
        return re.compile(rf"^(.*\.mlp\.experts)\.({'|'.join(map(re.escape, self.kinds))})$")

    def kind_of_part(self, part: str) -> str | None:
        """The fused kind holding per-expert tensor ``part`` (e.g. ``up_proj.weight``), or None."""
        return next((k for k, kind in self.kinds.items() if part in kind.parts), None)

    def stack(self, kind: str, parts: list[Tensor]) -> Tensor:
        """Per-expert parts [p0 of expert 0, p1 of expert 0, ..., p0 of expert 1, ...] -> the fused tensor."""
        n = len(self.kinds[kind].parts)
        join = self.kinds[kind].join
        return torch.stack([join(parts[i:i + n]) for i in range(0, len(parts), n)])


def _halves(x: Tensor, ffn: int) -> list[Tensor]:
    return [x[:ffn].contiguous(), x[ffn:].contiguous()]


def _interleaved_columns(x: Tensor, ffn: int) -> list[Tensor]:
    """[H, 2I] with gate/up in even/odd columns -> gate [I, H], up [I, H]."""
    return [x[:, 0::2].t().contiguous(), x[:, 1::2].t().contiguous()]


def _interleave_columns(parts: list[Tensor]) -> Tensor:
    gate, up = parts
    return torch.stack([gate.t(), up.t()], dim=-1).reshape(gate.shape[1], 2 * gate.shape[0])


def _interleaved(x: Tensor, ffn: int) -> list[Tensor]:
    """[2I] with gate/up in even/odd entries -> gate [I], up [I]."""
    return [x[0::2].contiguous(), x[1::2].contiguous()]


def _interleave(parts: list[Tensor]) -> Tensor:
    gate, up = parts
    return torch.stack([gate, up], dim=-1).reshape(2 * gate.shape[0])


def _whole(x: Tensor, ffn: int) -> list[Tensor]:
    return [x]


def _transposed(x: Tensor, ffn: int) -> list[Tensor]:
    return [x.t().contiguous()]


LAYOUTS: dict[str, ExpertLayout] = {
    layout.name: layout for layout in (
        ExpertLayout("qwen", {
            "gate_up_proj": FusedKind(lambda e, i, h: (e, 2 * i, h), ("gate_proj.weight", "up_proj.weight"),
                                      _halves, torch.cat, "[experts, 2 x intermediate (gate, up), hidden]",
                                      ("gate rows", "up rows")),
            "down_proj": FusedKind(lambda e, i, h: (e, h, i), ("down_proj.weight",), _whole, lambda p: p[0],
                                   "[experts, hidden, intermediate]"),
        }),
        ExpertLayout("gpt_oss", {
            "gate_up_proj": FusedKind(lambda e, i, h: (e, h, 2 * i), ("gate_proj.weight", "up_proj.weight"),
                                      _interleaved_columns, _interleave_columns,
                                      "[experts, hidden, 2 x intermediate (gate, up interleaved)]",
                                      ("gate: even columns", "up: odd columns")),
            "gate_up_proj_bias": FusedKind(lambda e, i, h: (e, 2 * i), ("gate_proj.bias", "up_proj.bias"),
                                           _interleaved, _interleave,
                                           "[experts, 2 x intermediate (gate, up interleaved)]",
                                           ("gate: even entries", "up: odd entries")),
            "down_proj": FusedKind(lambda e, i, h: (e, i, h), ("down_proj.weight",), _transposed,
                                   lambda p: p[0].t(), "[experts, intermediate, hidden]"),
            "down_proj_bias": FusedKind(lambda e, i, h: (e, h), ("down_proj.bias",), _whole, lambda p: p[0],
                                        "[experts, hidden]"),
        }),
    )
}
