"""The file layer shared by the checkpoint manager and the converters (no megatron, no models).

- ``paths``: ``contained``, the one gate for file names read from checkpoints and indexes.
- ``staging``: output directories that appear complete or not at all; the next run finishes or
  undoes a commit a dead process left.
- ``output_dir``: what ``--overwrite`` may replace, and an output's overlap with its input.
- ``files``: CRC-32, fsync, write-back, copying HF side files.
- ``faults``: fault hooks the tests arm through environment variables.
- ``safe_load``: restricted unpickling for torch_dist checkpoints.
- ``torch_dist_read`` / ``safetensors_write``: the on-disk formats, read and written directly.
"""
