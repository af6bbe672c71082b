"""HF safetensors -> mcore_rl model directory (dist_ckpt/, huggingface/, mcore_rl.json), on CPU.

  python converters/hf_to_mcore.py --hf_model_path DIR --output_path DIR [--dtype fp32|bf16]
  torchrun --nproc_per_node 2 converters/hf_to_mcore.py ... --tp 2     # the work split over 2 ranks

The output does not depend on --tp/--pp/--ep (they only split the work; load it at any layout).
--test: afterwards, in a fresh process, load the output at TP=1 and compare logits with
transformers' model (fails with exit code 1 when max |diff| > 1e-4 in fp32).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_model_path", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--output_path", required=True, help="model directory to write (must be empty or absent)")
    for name in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{name}", type=int, default=1,
                       help=f"{name.upper()} size to split the work over (torchrun world = tp*pp*ep; default 1)")
    p.add_argument("--use_cpu_initialization", action="store_true",
                   help="accepted for compatibility: the conversion never touches a GPU")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights (default fp32)")
    p.add_argument("--role", choices=["actor", "critic"], default=None,
                   help="default: from config.json architectures")
    p.add_argument("--test", action="store_true", help="verify logits against transformers afterwards")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_path")
    return p.parse_args(argv)


def run_conversion(a: argparse.Namespace) -> int:
    import torch

    from mcore_rl.checkpoint.convert import ConvertOptions, convert
    from mcore_rl.platform import init_distributed, setup_platform

    platform = setup_platform("cpu")
    single = "WORLD_SIZE" not in os.environ
    store = tempfile.NamedTemporaryFile(prefix="hf_to_mcore_store_", delete=False) if single else None
    init_distributed(platform, 0 if single else None, 1 if single else None,
                     init_method=f"file://{store.name}" if single else None)
    try:
        opts = ConvertOptions(a.hf_model_path, a.output_path, a.tp, a.pp, a.ep, a.etp, a.dtype, a.role, a.overwrite)
        s = convert(opts)
        if torch.distributed.get_rank() == 0:
            print(f"hf_to_mcore: {s.role} written to {a.output_path}: {s.tensors} tensors, "
                  f"{s.bytes / 2**20:.1f} MiB, {s.seconds:.1f} s, peak RSS {s.peak_rss_mb:.0f} MiB "
                  f"(largest rank), at most {s.peak_live_params} parameter(s) in memory at once")
    finally:
        torch.distributed.destroy_process_group()
        if store is not None:
            os.unlink(store.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    from mcore_rl.errors import McoreRLError

    a = parse_args(argv)
    try:
        code = run_conversion(a)
    except McoreRLError as e:  # bad input: the message names the value and the fix
        print(f"hf_to_mcore: error: {e}", file=sys.stderr)
        return 2
    if code == 0 and a.test and os.environ.get("RANK", "0") == "0":
        verify = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_logits.py")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        code = subprocess.run([sys.executable, verify, a.output_path, a.hf_model_path], env=env).returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
