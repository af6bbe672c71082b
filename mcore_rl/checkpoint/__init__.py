"""Checkpoint manager: megatron dist-checkpoints of actor/critic engines plus trainer state."""
