"""Checkpoints: megatron dist-checkpoints of actor/critic engines plus trainer state (the manager).

- ``storage``: durable writes (atomic JSON, fsync), the torch_dist file inventory and its
  check, shared-vs-node-local root detection and peer file sync for node-local disks.
- ``mcore_rl.fileio.safe_load.restricted_unpickling()``: routes every unpickling that megatron-core's
  ``dist_checkpointing.load`` (torch_dist format) and torch.distributed.checkpoint perform — the
  ``.metadata`` pickle, ``common.pt``, ShardedObject payloads — through allowlists, so a checkpoint
  with a planted pickle is refused with ``UnsafeCheckpointError`` instead of executing it.
"""
