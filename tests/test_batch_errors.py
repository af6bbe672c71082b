"""The actor/critic batch contract: bad input fails with a message naming the key and the fix."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.rl.actor import Actor, ActorConfig
from mcore_rl.rl.batch import BatchError, split_rows, validate_batch
from mcore_rl.rl.critic import Critic, CriticConfig
from mcore_rl.rl.microbatcher import MicroBatchSpec, plan_micro_batches, pad_sequence_to_multiple
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
    with pytest.raises(BatchError, match=r"max_tokens_per_micro_batch=8 is below one row's padded length"):
        plan_micro_batches(rl_batch(50, batch=6), MicroBatchSpec(max_tokens=8))


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
    spec = MicroBatchSpec(max_tokens=48, uniform_shape=True, count_multiple=2, seq_multiple=4)
    plan = plan_micro_batches(batch, spec)
    shapes = {p["input_ids"].shape for p in plan.batches}
    assert len(plan.batches) % 2 == 0 and len(shapes) == 1, shapes
    b, s = shapes.pop()
    assert s % 4 == 0 and b * s <= 48
    assert sorted(i for rows in plan.rows for i in rows) == list(range(10))  # every row once


def test_out_of_vocab_and_negative_ids():
    batch = rl_batch(50, batch=4)
    batch["input_ids"][2, 12] = 50
    batch["attention_mask"][2, 12] = 1
    batch["responses"][2, 2] = 50
    with pytest.raises(BatchError, match=r"input_ids\[2, 12\] = 50 is a real token .* outside the model's vocabulary \[0, 50\)"):
        validate_batch(batch, vocab_size=50)
    batch = rl_batch(50, batch=4)
    batch["input_ids"][1, 4] = -7
    batch["attention_mask"][1, 4] = 1  # extends row 1's tokens (columns 5..12) on the left
    with pytest.raises(BatchError, match=r"input_ids\[1, 4\] = -7 is a real token"):
        validate_batch(batch, vocab_size=50)
    batch = rl_batch(50, batch=4)
    batch["input_ids"][batch["attention_mask"] == 0] = -100  # padding may hold anything
    batch["responses"] = batch["input_ids"][:, -6:].clone()
    validate_batch(batch, vocab_size=50)


def test_responses_must_be_the_tail_of_input_ids():
    batch = rl_batch(50, batch=4)
    batch["responses"][3, 0] = (batch["responses"][3, 0] + 1) % 50
    with pytest.raises(BatchError, match=r"responses\[3, 0\] = \d+ but input_ids\[3, 10\] = \d+"):
        validate_batch(batch)
    batch = rl_batch(50, batch=4)
    pad = batch["attention_mask"][:, -6:] == 0
    assert pad.any()
    batch["responses"][pad] = 7  # differs from input_ids only at padding: fine
    validate_batch(batch)


def test_loss_mask_outside_attention():
    batch = rl_batch(50, batch=4)
    row, col = (int(x) for x in (batch["attention_mask"][:, -6:] == 0).nonzero()[0])
    batch["response_mask"] = torch.ones(4, 6, dtype=torch.long)
    with pytest.raises(BatchError, match=rf"response_mask\[{row}, {col}\] is 1 but that position is padding"):
        validate_batch(batch)


def test_pad_sequence_to_multiple_pads_on_the_left():
    batch = rl_batch(50, batch=2, prompt=9, response=6)  # S = 15
    padded = pad_sequence_to_multiple(batch, 4)
    assert padded["input_ids"].shape == (2, 16) and padded["attention_mask"][:, 0].sum() == 0
    assert torch.equal(padded["input_ids"][:, -6:], batch["responses"].masked_fill(batch["attention_mask"][:, -6:] == 0, 0))
    assert torch.equal(padded["responses"], batch["responses"])


def test_response_without_prompt():
    batch = rl_batch(50, batch=3)
    batch["attention_mask"][1, :10] = 0  # prompt is the first 10 columns: all padding
    batch["attention_mask"][2, :] = 0  # an empty row stays allowed
    batch["input_ids"] *= batch["attention_mask"]
    batch["responses"] = batch["input_ids"][:, -6:].clone()
    with pytest.raises(BatchError, match=r"row 1 has response tokens but no prompt token"):
        validate_batch(batch)
    batch["attention_mask"][1, 9] = 1  # one prompt token is enough
    validate_batch(batch)


PROMPT = 6  # _rows: S = 10, R = 4; the prompt is columns 0..5, the response 6..9


def _rows(*masks: str) -> dict:
    """A batch whose rows have the attention masks ``masks`` ('0011111100'), random real ids."""
    mask = torch.tensor([[int(c) for c in m] for m in masks])
    ids = torch.randint(1, 50, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, PROMPT:].clone()}


CONTIGUOUS = ("0011111111", "1111111100", "0001111110", "1111111111")  # left, right, both, none
GAP = r"real tokens must be contiguous \(left-padded prompt, then right-padded response\)"


def test_gap_inside_the_prompt():
    validate_batch(_rows(*CONTIGUOUS))
    with pytest.raises(BatchError, match=r"row 1 has padding between its tokens: attention_mask\[1, 2:4\] is 0 "
                                         r"\(inside the prompt; real tokens span columns 0\.\.8\)") as err:
        validate_batch(_rows("0011111111", "1100111110"))
    assert "Remove the padding inside the row" in str(err.value) and re.search(GAP, str(err.value))
    assert "drop the hole from the prompt" in str(err.value)


def test_gap_inside_the_response():
    with pytest.raises(BatchError, match=r"row 0 has padding between its tokens: attention_mask\[0, 8:9\] is 0 "
                                         r"\(inside the response; real tokens span columns 2\.\.9\)") as err:
        validate_batch(_rows("0011111101", *CONTIGUOUS))
    assert re.search(GAP, str(err.value))
    assert "set response_mask to 0 there, not attention_mask" in str(err.value)  # the tool-output case


@pytest.mark.parametrize("mask,hole", [("0011110111", "6:7"),  # the response starts with padding
                                       ("1111001111", "4:6"),  # the prompt is right-padded
                                       ("0111100011", "5:8")])  # both
def test_gap_between_prompt_and_response(mask, hole):
    with pytest.raises(BatchError, match=rf"row 2 has padding between its tokens: attention_mask\[2, {hole}\] is 0 "
                                         r"\(between the prompt and the response;") as err:
        validate_batch(_rows("0011111111", "1111111100", mask))
    assert re.search(GAP, str(err.value))
    assert "left-pad the prompt so it ends at column 5 and start the response at column 6" in str(err.value)


def test_first_gapped_row_is_named_and_fillers_stay_legal():
    masks = ["0000000000", "0011111111", "1111111100", "0110111100", "0001111110", "0011111010"]
    with pytest.raises(BatchError, match=r"row 3 has padding between its tokens: attention_mask\[3, 3:4\]"):
        validate_batch(_rows(*masks))
    masks[3] = "0001111100"
    with pytest.raises(BatchError, match=r"row 5 has padding between its tokens: attention_mask\[5, 7:8\]"):
        validate_batch(_rows(*masks))
    masks[5] = "0011111000"
    validate_batch(_rows(*masks))  # the all-padding row 0 (a filler) is legal


def test_every_entry_refuses_gapped_rows():
    """The actor's and critic's entries validate before touching the engine (a stub here)."""
    batch = _rows("0011111111", "1111011100")
    shape = batch["responses"].shape
    batch.update(old_log_probs=torch.zeros(shape), advantages=torch.zeros(shape), values=torch.zeros(shape),
                 returns=torch.zeros(shape))
    engine = SimpleNamespace(args=SimpleNamespace(vocab_size=50), role="critic")
    actor, critic = Actor(engine, ActorConfig(), ref=engine), Critic(engine, CriticConfig())
    for entry in (actor.compute_log_prob, actor.compute_ref_log_prob, actor.update_policy,
                  critic.compute_values, critic.update_critic):
        with pytest.raises(BatchError, match=r"row 1 has padding between its tokens: attention_mask\[1, 4:5\]"):
            entry(batch)


def test_attention_mask_must_hold_zeros_and_ones():
    """Lengths and packed streams are sums of the mask: a 2 or a float mask would count wrong."""
    batch = rl_batch(50, batch=3, seed=3)
    bad = dict(batch, attention_mask=batch["attention_mask"] * 2)
    with pytest.raises(BatchError, match=r"attention_mask\[0, \d+\] = 2; the mask holds 1 for a token and 0"):
        validate_batch(bad)
    with pytest.raises(BatchError, match="attention_mask has dtype torch.float32; pass integer or bool"):
        validate_batch(dict(batch, attention_mask=batch["attention_mask"].float()))
    validate_batch(dict(batch, attention_mask=batch["attention_mask"].bool()))  # bool is fine
