"""The actor/critic batch contract: bad input fails with a message naming the key and the fix."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.rl.batch import BatchError, split_by_tokens, split_rows, validate_batch
from tests.tiny import rl_batch


def test_missing_keys_are_listed():
    batch = rl_batch(50)
    del batch["responses"]
    with pytest.raises(BatchError, match=r"batch is missing keys \['responses', 'advantages'\]"):
        validate_batch(batch, ("advantages",))


def test_mismatched_shapes():
    batch = rl_batch(50, batch=4)
    batch["attention_mask"] = batch["attention_mask"][:, :-1]
    with pytest.raises(BatchError, match=r"input_ids \(4, 16\) and attention_mask \(4, 15\) must both be \[B, S\]"):
        validate_batch(batch)
    batch = rl_batch(50, batch=4)
    batch["advantages"] = torch.zeros(4, 5)
    with pytest.raises(BatchError, match=r"advantages has shape \(4, 5\); expected \[B, R\] = \[4, 6\]"):
        validate_batch(batch, ("advantages",))


def test_response_longer_than_sequence():
    batch = rl_batch(50, batch=2)
    batch["responses"] = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(BatchError, match="responses are 16 tokens but sequences are 16"):
        validate_batch(batch)


def test_batch_not_divisible_into_micro_batches():
    with pytest.raises(BatchError, match=r"a batch of 6 rows does not split into pieces of 4; choose a size dividing 6"):
        split_rows(rl_batch(50, batch=6), 4)
    with pytest.raises(BatchError, match=r"max_tokens_per_micro_batch=8 is below one sequence \(16 tokens\)"):
        split_by_tokens(rl_batch(50, batch=6), 8)


def test_inconsistent_position_ids():
    batch = rl_batch(50, batch=3)
    mask = batch["attention_mask"]
    batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)  # what HF generation uses: fine
    validate_batch(batch)
    batch["position_ids"][1, -3:] = 0  # restarts inside the row: packed sequences
    batch["attention_mask"][1, -3:] = 1
    with pytest.raises(BatchError, match="position_ids of row 1 are not consecutive over its tokens"):
        validate_batch(batch)


def test_dynamic_pieces_share_one_shape_and_respect_pipeline_multiple():
    batch = rl_batch(50, batch=10)
    pieces = split_by_tokens(batch, max_tokens=48, multiple_of=2)  # 3 rows of 16 tokens each
    assert len(pieces) == 4 and {p["input_ids"].shape for p in pieces} == {(3, 16)}
    assert pieces[-1]["attention_mask"][1:].sum() == 0  # two all-padding rows top it up
