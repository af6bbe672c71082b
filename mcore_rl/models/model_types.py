"""What the model modules share, at the bottom of ``models/`` (it imports nothing of mcore_rl):
the role a model is built for and the padded vocabulary size. ``builder`` (which builds the
chunks) and ``hf_weights`` (which maps their weights to HF names) both read them."""
from __future__ import annotations

import math
from typing import Literal

Role = Literal["actor", "critic"]
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rounded up to lcm(128, tp): for power-of-two TP the padded size does not depend on
    TP, so a checkpoint keeps its embedding shape across TP layouts."""
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple
