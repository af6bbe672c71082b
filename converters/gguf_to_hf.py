"""GGUF (llama.cpp) model file -> HF model directory with fp32 safetensors, on CPU.

  python converters/gguf_to_hf.py --gguf_path FILE.gguf --output_path DIR [--overwrite]

Quantized weights are dequantized once into fp32 (the model every later comparison uses);
config.json, the tokenizer (with its chat template) and generation_config.json come from the
GGUF metadata through transformers. The output is staged beside DIR and renamed into place when
complete. Bad input: one line "error: ..." on stderr, exit code 2, nothing written.
"""
from __future__ import annotations

import argparse
import sys

from mcore_rl.entry import OneLineParser  # argparse, one ``error:`` line on a usage error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (an unknown or malformed flag: one ``error:`` line, exit 2)."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf_path", required=True, help="a llama.cpp .gguf model file")
    p.add_argument("--output_path", required=True, help="HF model directory to write (empty or absent)")
    p.add_argument("--max_shard_size", default="2GB", help="safetensors shard size (default 2GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --output_path (the old one stays until the new one is complete)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 written, 2 bad input (one ``error:`` line)."""
    a = parse_args(argv)
    from mcore_rl.entry import error_line, os_error_line, quiet_third_party

    quiet_third_party(0)
    from mcore_rl.errors import McoreRLError
    from mcore_rl.conversion.gguf_convert import gguf_to_hf

    try:
        s = gguf_to_hf(a.gguf_path, a.output_path, a.overwrite, a.max_shard_size)
    except McoreRLError as e:  # bad input: the message names the value and the fix
        print(error_line(e), file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission, a failing device: the staging is already discarded
        print(os_error_line(e, f"converting {a.gguf_path!r} into {a.output_path!r}"), file=sys.stderr)
        return 2
    print(f"gguf_to_hf: {s.model_type} ({s.layers} layers) written to {a.output_path}: {s.tensors} fp32 tensors, "
          f"{s.bytes / 2**20:.1f} MiB, {s.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
