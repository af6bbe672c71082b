"""HF <-> megatron-core weight mapping: tables as data, transforms, lazy safetensors IO."""
