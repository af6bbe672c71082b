"""The package's one error base class: every error mcore_rl raises on purpose derives from it.

Trainers can catch ``McoreRLError`` for anything mcore_rl refuses (bad layout, config, batch,
weights, checkpoint); each subclass also derives from the builtin it refines (mostly
``ValueError``), so existing ``except ValueError`` code keeps working.
"""
from __future__ import annotations


class McoreRLError(Exception):
    """Base of every mcore_rl error; the message names the bad value and the fix."""


class CheckpointError(McoreRLError, ValueError):
    """A checkpoint or model directory on disk cannot be written or read safely.

    Raised by the checkpoint manager, the converters and the file layer they share; the
    message names the file or value and the fix.
    """
