"""A GGUF model file -> a HF model directory (fp32 safetensors, config, tokenizer with its chat
template, generation config), staged beside the output and renamed into place when complete."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from mcore_rl.conversion.convert_input import ConvertError
from mcore_rl.fileio.safetensors_write import ShardedSafetensorsWriter, TensorSpec
from mcore_rl.fileio.output_dir import (check_replaceable, input_overlap, refuse_file, settle_output,
                                         write_export_record)
from mcore_rl.fileio.staging import Staging
from mcore_rl.mapping.gguf import GGUF_TABLES, GGUFError, gguf_architecture, hf_name, read_gguf_tensors

# GGUF architecture -> the HF class transformers builds from it
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


@dataclass
class GGUFSummary:
    """What was written."""

    model_type: str
    layers: int
    tensors: int
    bytes: int
    seconds: float


def _open_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise ConvertError(f"--gguf_path {path!r} is not a file; pass a llama.cpp .gguf model file.")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # gguf raises ValueError on a bad magic or a cut file
        raise ConvertError(f"--gguf_path {path!r} is not a readable GGUF file ({e}); pass a complete .gguf.") from e


def _check_output(output: str, gguf_path: str, overwrite: bool) -> None:
    """Settles an interrupted earlier run's leftovers, then refuses a file, an output holding
    the GGUF file (resolved), a non-empty directory unless ``overwrite``, and with it anything
    but an earlier HF export of this project (``fileio.output_dir``)."""
    settle_output(output, ConvertError)
    refuse_file(output, f"--output_path {output!r}", ConvertError)
    if input_overlap(output, gguf_path) is not None:
        raise ConvertError(f"--output_path {output!r} contains --gguf_path {gguf_path!r}; write the output "
                           "elsewhere (--overwrite never replaces the input).")
    check_replaceable(output, overwrite, "hf_export", f"--output_path {output!r}", ConvertError)


def _tensor_specs(reader, arch: str) -> list[TensorSpec]:
    """HF names and fp32 shapes of every tensor (GGUF lists dimensions innermost first)."""
    table = GGUF_TABLES[arch]
    return [TensorSpec(hf_name(t.name, table), tuple(int(d) for d in reversed(t.shape)), torch.float32)
            for t in reader.tensors]


def _write_hf_files(gguf_path: str, directory: str, arch: str) -> int:
    """config.json, tokenizer files and generation_config.json from the GGUF metadata; returns
    the layer count."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [HF_ARCHITECTURES[arch]]
    config.dtype = torch.float32
    config.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(directory)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(directory)
    return int(config.num_hidden_layers)


def gguf_to_hf(gguf_path: str, output: str, overwrite: bool = False, max_shard_size: str = "2GB") -> GGUFSummary:
    """Writes the HF model directory ``output`` from ``gguf_path`` (see module doc)."""
    start = time.time()
    _check_output(output, gguf_path, overwrite)
    reader = _open_reader(gguf_path)
    try:
        arch = gguf_architecture(reader)
        specs = _tensor_specs(reader, arch)
    except GGUFError as e:
        raise ConvertError(f"--gguf_path {gguf_path!r}: {e}") from e
    stage = Staging.create(output)
    try:
        writer = ShardedSafetensorsWriter(stage.path, specs, max_shard_size)
        for name, tensor in read_gguf_tensors(reader):
            writer.write(name, tensor)
        writer.close()
        layers = _write_hf_files(gguf_path, stage.path, arch)
        write_export_record(stage.path, "gguf_to_hf")
        stage.commit(replace=overwrite)
    except BaseException:
        stage.discard()
        raise
    return GGUFSummary(arch, layers, len(specs), sum(s.nbytes for s in specs), time.time() - start)
