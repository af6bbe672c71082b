"""Checkpoints: megatron dist-checkpoints read without running foreign code.

``safe_load.restricted_unpickling()`` routes every unpickling that megatron-core's
``dist_checkpointing.load`` (torch_dist format) and torch.distributed.checkpoint perform — the
``.metadata`` pickle, ``common.pt``, ShardedObject payloads — through allowlists, so a checkpoint
with a planted pickle is refused with ``UnsafeCheckpointError`` instead of executing it.
"""
