"""The micro-batch one forward pass sees: the caller's row tensors by name plus what mcore_rl
adds to them, as typed fields (never as extra dict keys).

``rows`` holds [b, s] sequence tensors (``input_ids``, ``attention_mask``) and whatever the loss
function reads ([b, R] response tensors: ``responses``, ``advantages``, ...); a ``MicroBatch``
reads like that mapping (``mb["advantages"]``, ``"response_mask" in mb``), so loss functions
written for plain dicts keep working. The added fields:
  packed     the rows' real tokens in one stream (``models/packing.py``)
  token_id   [b, s] each token's flat index into the routes of routing replay (``models/routing.py``)
  cp         what this context-parallel rank scores of the responses (``rl/cp_view.py``)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class PackedStream:
    """Rows packed into one stream: ``ids`` [1, T] (row after row, each row's real tokens, then
    filler), ``cu_seqlens`` int32 [n + 1] (sequence boundaries; a filler tail is a sequence of
    its own) and ``index`` [b, s] (the stream place of each (row, column) token, -1 at padding)."""

    ids: Tensor
    cu_seqlens: Tensor
    index: Tensor

    def to(self, device: torch.device) -> PackedStream:
        return PackedStream(*(t.to(device, non_blocking=True) for t in (self.ids, self.cu_seqlens, self.index)))


@dataclass(frozen=True)
class CPView:
    """The response tokens a context-parallel rank scores. Padded micro-batches: ``out_index``
    [R_local] (their local output columns) and ``resp_index`` [R_local] (their response
    columns; the view's [b, R] tensors are cut to them). Packed: ``packed_out`` [b, R] (the
    local stream place scoring each response token; tensors stay [b, R], masks cut to the owned
    tokens). Both: ``attended`` (the view's attended responses) and ``row_tokens`` [b] (loss
    tokens of each whole row, for per-sequence means)."""

    attended: Tensor
    row_tokens: Tensor
    out_index: Tensor | None = None
    resp_index: Tensor | None = None
    packed_out: Tensor | None = None


@dataclass(frozen=True, eq=False)  # eq: tensors do not compare to one bool
class MicroBatch(Mapping[str, Tensor]):
    """One micro-batch (module doc); a mapping of its ``rows``."""

    rows: Mapping[str, Tensor]
    packed: PackedStream | None = None
    token_id: Tensor | None = None
    cp: CPView | None = None

    def __getitem__(self, key: str) -> Tensor:
        return self.rows[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        """(b, s) as the model's schedule sees it: packed, the stream's (1, T)."""
        ids = self.packed.ids if self.packed is not None else self.rows["input_ids"]
        return ids.shape[0], ids.shape[1]

    def to(self, device: torch.device) -> MicroBatch:
        """Every tensor on ``device`` (the CP view is made later, on the device)."""
        return MicroBatch({k: v.to(device, non_blocking=True) for k, v in self.rows.items()},
                          self.packed.to(device) if self.packed is not None else None,
                          self.token_id.to(device, non_blocking=True) if self.token_id is not None else None)


def as_micro_batch(mb: MicroBatch | Mapping[str, Tensor]) -> MicroBatch:
    """``mb`` itself, or a plain dict of row tensors as a padded micro-batch without extras."""
    return mb if isinstance(mb, MicroBatch) else MicroBatch(dict(mb))
