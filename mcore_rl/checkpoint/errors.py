"""Checkpoint errors: every checkpoint refusal is a ``CheckpointError``."""
from __future__ import annotations

from mcore_rl.errors import McoreRLError


class CheckpointError(McoreRLError, ValueError):
    """A checkpoint cannot be saved or loaded; the message names the value and the fix."""
