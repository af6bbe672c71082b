"""mcore model dir -> HF model dir, on CPU, tensor by tensor (no megatron, no torch.distributed).

  python converters/mcore_to_hf.py merge --local_dir CKPT --target_dir OUT [--max_shard_size 5GB]
      [--model_class auto|causal_lm|token_classification] [--overwrite]
  python converters/mcore_to_hf.py test --local_dir CKPT --test_hf_dir HF [--atol 0]

CKPT: ``global_step_<N>/actor`` or ``.../critic`` written by CheckpointManager, or a converter
output (``dist_ckpt/`` + ``huggingface/`` + ``mcore_rl.json``). ``test`` compares every merged
tensor with HF's and exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="write the HF model (safetensors shards + config + tokenizer)")
    m.add_argument("--local_dir", required=True, help="model dir: global_step_<N>/actor or .../critic, or a hf_to_mcore.py output")
    m.add_argument("--target_dir", required=True, help="HF output directory (must be empty or absent)")
    m.add_argument("--max_shard_size", default="5GB", help="bytes or e.g. 5GB, 500MB, 2GiB (default 5GB)")
    m.add_argument("--model_class", default="auto", choices=["auto", "causal_lm", "token_classification"],
                   help="auto (default): from the role in mcore_rl.json (actor: causal LM, critic: token "
                   "classification with one label); causal_lm on a critic is an error")
    m.add_argument("--overwrite", action="store_true", help="replace the model files of a non-empty target_dir")
    t = sub.add_parser("test", help="compare the merged tensors with a HF model directory")
    t.add_argument("--local_dir", required=True, help="model dir: global_step_<N>/actor or .../critic, or a hf_to_mcore.py output")
    t.add_argument("--test_hf_dir", required=True, help="HF model directory to compare every tensor with")
    t.add_argument("--atol", type=float, default=0.0, help="allowed max abs diff per tensor (default 0: exact)")
    return p


def _test(local_dir: str, test_hf_dir: str, atol: float) -> int:
    from mcore_rl.checkpoint.merge import compare

    diffs, problems = compare(local_dir, test_hf_dir)
    bad = [c for c, d in diffs.items() if d > atol]
    for cls in sorted(diffs):
        print(f"{'MISMATCH' if cls in bad else 'ok':8s} max|diff| {diffs[cls]:.3e}  {cls}")
    for problem in problems:
        print(f"MISMATCH {problem}")
    if bad or problems:
        print(f"FAILED: {len(bad)} tensor classes above atol={atol}, {len(problems)} name/shape problems")
        return 1
    print(f"OK: {len(diffs)} tensor classes match {test_hf_dir} (atol={atol})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from mcore_rl.errors import McoreRLError

    try:
        if args.command == "test":
            return _test(args.local_dir, args.test_hf_dir, args.atol)
        from mcore_rl.checkpoint.merge import merge

        summary = merge(args.local_dir, args.target_dir, args.max_shard_size, args.model_class,
                        overwrite=args.overwrite, progress=True)
        print(f"{summary.line()} -> {args.target_dir}")
        return 0
    except McoreRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
