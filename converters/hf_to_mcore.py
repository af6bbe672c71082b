"""HF safetensors -> mcore_rl model directory (dist_ckpt/, huggingface/, mcore_rl.json), on CPU.

  python converters/hf_to_mcore.py --hf_model_path DIR --output_path DIR [--dtype fp32|bf16|fp16]
  torchrun --nproc_per_node 2 converters/hf_to_mcore.py ... --tp 2     # the work split over 2 ranks

The output does not depend on --tp/--pp/--ep (they only split the work; load it at any layout).
--dtype: default the weights' own (mixed fp32/bf16/fp16: fp32; no tensor is rounded); a config.json
stating another dtype is a warning naming both; the output's config states the dtype written.
FP8 checkpoints (block FP8, compressed-tensors FP8, per-tensor FP8) are dequantized while read;
their default dtype is that of most of their other weights (bf16 for DeepSeek/Qwen3/GLM).
MXFP4 checkpoints (gpt-oss: X_blocks + X_scales) are dequantized the same way (exact in bf16/fp32).
--test: afterwards, in a fresh process, load the output at TP=1 and compare logits with
transformers' model (fails with exit code 1 when max |diff| > 1e-4 in fp32); of an FP8/MXFP4 input,
transformers' model of its dequantized weights (converters/verify_logits.py).
Bad input: one line "error: ..." on stderr, exit code 2, nothing written.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from mcore_rl.errors import positive_int
from mcore_rl.entry import OneLineParser  # argparse, one ``error:`` line on a usage error
import tempfile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (an unknown or malformed flag: one ``error:`` line, exit 2)."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_model_path", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--output_path", required=True, help="model directory to write (must be empty or absent)")
    for name in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{name}", type=positive_int, default=1,
                       help=f"{name.upper()} size to split the work over (torchrun world = tp*pp*ep; default 1)")
    p.add_argument("--use_cpu_initialization", action="store_true",
                   help="accepted for compatibility: the conversion never touches a GPU")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the written weights (default: the weights' own, whatever config.json says)")
    p.add_argument("--role", choices=["actor", "critic"], default=None,
                   help="default: from config.json architectures")
    p.add_argument("--test", action="store_true", help="verify logits against transformers afterwards")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --output_path (the old output stays until the new one is complete)")
    return p.parse_args(argv)


def run_conversion(a: argparse.Namespace) -> int:
    """Imports the converter (after the pre-flight checks passed) and runs it in this process's
    world: torchrun's, or a world of one through a file store in a temporary directory."""
    from mcore_rl.platform.fixes import megatron_import_fixes

    with megatron_import_fixes(on_cpu=True):  # megatron's import-time torch.compile deferred
        import torch

        from mcore_rl.conversion.convert import ConvertOptions, convert
    from mcore_rl.platform import init_distributed, setup_platform

    platform = setup_platform("cpu")
    single = "WORLD_SIZE" not in os.environ
    store_dir = tempfile.mkdtemp(prefix="hf_to_mcore_store_") if single else None
    try:
        init_distributed(platform, 0 if single else None, 1 if single else None,
                         init_method=f"file://{store_dir}/store" if single else None)
        try:
            opts = ConvertOptions(a.hf_model_path, a.output_path, a.tp, a.pp, a.ep, a.etp, a.dtype, a.role,
                                  a.overwrite)
            s = convert(opts, progress=sys.stderr.isatty())
            if torch.distributed.get_rank() == 0:
                print(f"hf_to_mcore: {s.role} ({s.dtype}) written to {a.output_path}: {s.tensors} tensors, "
                      f"{s.bytes / 2**20:.1f} MiB, {s.seconds:.1f} s; start-up {s.startup_s:.1f} s (process "
                      f"start to first tensor); peak RSS {s.peak_rss_mb:.0f} MiB (largest rank), at most "
                      f"{s.peak_live_params} parameter(s) in memory at once")
        finally:
            torch.distributed.destroy_process_group()
    finally:
        if store_dir is not None:  # gloo may already have removed the store file
            shutil.rmtree(store_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 done, 1 the --test check failed, 2 bad input (one ``error:`` line)."""
    a = parse_args(argv)
    from mcore_rl.entry import error_line, one_line_warnings, os_error_line, quiet_third_party

    quiet_third_party(int(os.environ.get("RANK", "0")))
    one_line_warnings()
    from mcore_rl.conversion.convert_input import preflight
    from mcore_rl.errors import McoreRLError

    try:
        preflight(a.hf_model_path, a.output_path, a.overwrite, a.dtype, a.role)  # before heavy imports
        code = run_conversion(a)
    except McoreRLError as e:  # bad input: the message names the value and the fix
        print(error_line(e), file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission, a failing device: the staging is already discarded
        print(os_error_line(e, f"converting {a.hf_model_path!r} into {a.output_path!r}"), file=sys.stderr)
        return 2
    if code == 0 and a.test and os.environ.get("RANK", "0") == "0":
        verify = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_logits.py")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        code = subprocess.run([sys.executable, verify, a.output_path, a.hf_model_path], env=env).returncode
    return code


if __name__ == "__main__":  # megatron's checkpoint writers re-import the main module
    sys.exit(main())
