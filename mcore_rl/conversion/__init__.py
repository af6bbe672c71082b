"""The converters' library: HF ↔ mcore dist-checkpoint and GGUF → HF (entry points in ``converters/``).

- ``convert`` / ``convert_input``: HF safetensors → mcore dist-checkpoint (one process or torchrun).
- ``merge``: mcore dist-checkpoint → HF safetensors, and the ``test`` comparison.
- ``gguf_convert``: GGUF → HF safetensors.
- ``merge_lora``: an adapter-only LoRA step merged into its base; ``lora_export``: a live LoRA
  engine's adapters as a PEFT adapter directory, or its merged HF weights.
"""
