"""mcore model dir -> HF model dir, on CPU, tensor by tensor (no megatron, no torch.distributed).

  python converters/mcore_to_hf.py merge --local_dir CKPT --target_dir OUT [--max_shard_size 5GB]
      [--model_class auto|causal_lm|token_classification|sequence_classification] [--dtype fp32|bf16|fp16]
      [--overwrite] [--dtype fp8 [--fp8_block_size 128x128] [--scale_fmt float|ue8m0]] [--dtype mxfp4]
  python converters/mcore_to_hf.py test --local_dir CKPT --test_hf_dir HF [--atol 0]

CKPT: ``global_step_<N>/actor`` or ``.../critic`` written by CheckpointManager, or a converter
output (``dist_ckpt/`` + ``huggingface/`` + ``mcore_rl.json``). The merged model has the dtype of
the checkpoint's model parameters unless --dtype says otherwise; config.json states it. --dtype
fp8 writes the linear weights of the decoder layers as block FP8 (DeepSeek-V3 style: float8_e4m3fn +
float32 ``*_scale_inv`` per block, ``quantization_config`` in config.json), the rest in the
checkpoint's dtype (mcore_rl/mapping/fp8_quant.py says which tensors and how). --dtype mxfp4
(gpt-oss) writes the tensors the source checkpoint stored as MXFP4 (converted from bf16: the
experts' gate_up_proj and down_proj) as ``*_blocks`` + ``*_scales``, the rest as the source stored
it (bf16), with the published ``quantization_config`` (mcore_rl/conversion/merge_mxfp4.py). ``test``
compares every merged tensor with HF's and exits 1 on any mismatch (a NaN or inf always is one).
Both first check every file of CKPT against its record (the step's COMPLETE marker, a role part's
PART, a converter output's RECORD: size and CRC-32); --skip_verify reads it unchecked and says so.
Bad input: one line "error: ..." on stderr, exit code 2, nothing written.
"""
from __future__ import annotations

import argparse
import math
import sys

from mcore_rl.entry import OneLineParser  # argparse, one ``error:`` line on a usage error


def _atol(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite tolerance >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="write the HF model (safetensors shards + config + tokenizer)")
    m.add_argument("--local_dir", required=True, help="model dir: global_step_<N>/actor or .../critic, or a hf_to_mcore.py output")
    m.add_argument("--target_dir", required=True, help="HF output directory (must be empty or absent)")
    m.add_argument("--max_shard_size", default="5GB", help="bytes or e.g. 5GB, 500MB, 2GiB (default 5GB)")
    m.add_argument("--model_class", default="auto",
                   choices=["auto", "causal_lm", "token_classification", "sequence_classification"],
                   help="auto (default): the class huggingface/config.json records when it fits the role in "
                   "mcore_rl.json (a reward model stays *ForSequenceClassification), else actor: causal LM, "
                   "critic: token classification with one label; causal_lm on a critic is an error")
    m.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8", "mxfp4"], default=None,
                   help="dtype of the merged weights (default: the checkpoint's model parameters'); fp8: the "
                   "decoder layers' linear weights as block FP8 (e4m3 + float32 scales), the rest as the checkpoint's; "
                   "mxfp4 (gpt-oss): the tensors the source stored as MXFP4 (from bf16: the experts) as blocks + "
                   "scales, the rest as the source stored it (bf16)")
    m.add_argument("--fp8_block_size", nargs="+", default=None, metavar="ROWSxCOLS",
                   help="with --dtype fp8: the block one scale covers, ROWSxCOLS or ROWS COLS (default 128x128)")
    m.add_argument("--scale_fmt", choices=["float", "ue8m0"], default=None,
                   help="with --dtype fp8: float (default, amax/448) or ue8m0 (rounded up to a power of two)")
    m.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty target_dir (the old one stays until the new model is complete)")
    _skip_flag(m)
    t = sub.add_parser("test", help="compare the merged tensors with a HF model directory")
    t.add_argument("--local_dir", required=True, help="model dir: global_step_<N>/actor or .../critic, or a hf_to_mcore.py output")
    t.add_argument("--test_hf_dir", required=True, help="HF model directory to compare every tensor with")
    t.add_argument("--atol", type=_atol, default=0.0, help="allowed max abs diff per tensor (default 0: exact)")
    _skip_flag(t)
    return p


def _skip_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip_verify", action="store_true",
                   help="read the model dir without checking its files against its record (the step's COMPLETE "
                   "marker, a part's PART, a converter's RECORD: sizes and CRC-32); the output says so")


def _test(local_dir: str, test_hf_dir: str, atol: float, verify: bool) -> int:
    from mcore_rl.conversion.merge import compare

    diffs, problems = compare(local_dir, test_hf_dir, verify=verify)
    bad = [c for c, d in diffs.items() if not d <= atol]  # a NaN difference is never within atol
    for cls in sorted(diffs):
        print(f"{'MISMATCH' if cls in bad else 'ok':8s} max|diff| {diffs[cls]:.3e}  {cls}")
    for problem in problems:
        print(f"MISMATCH {problem}")
    if bad or problems:
        print(f"FAILED: {len(bad)} tensor classes above atol={atol}, {len(problems)} name, shape or value problems")
        return 1
    print(f"OK: {len(diffs)} tensor classes match {test_hf_dir} (atol={atol})")
    return 0


def _fp8_format(args: argparse.Namespace):
    """The BlockFp8 of --dtype fp8 (None otherwise); fp8 options without it are an error."""
    from mcore_rl.conversion.merge import MergeError
    from mcore_rl.mapping.fp8_quant import BlockFp8, parse_block

    given = [f for f, v in (("--fp8_block_size", args.fp8_block_size), ("--scale_fmt", args.scale_fmt)) if v is not None]
    if args.dtype != "fp8":
        if given:
            raise MergeError(f"{' and '.join(given)} given with --dtype {args.dtype}; they apply to --dtype fp8 only.")
        return None
    block = parse_block(" ".join(args.fp8_block_size)) if args.fp8_block_size else (128, 128)
    return BlockFp8(block, args.scale_fmt or "float")


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 done, 1 ``test`` found a mismatch, 2 bad input (one ``error:`` line)."""
    args = _parser().parse_args(argv)
    from mcore_rl.entry import error_line, os_error_line, quiet_third_party
    from mcore_rl.errors import McoreRLError

    quiet_third_party(0)
    if args.skip_verify:
        print(f"--skip_verify: {args.local_dir} is read WITHOUT checking its files against its record")
    try:
        if args.command == "test":
            return _test(args.local_dir, args.test_hf_dir, args.atol, not args.skip_verify)
        from mcore_rl.conversion.merge import merge

        summary = merge(args.local_dir, args.target_dir, args.max_shard_size, args.model_class,
                        overwrite=args.overwrite, progress=sys.stderr.isatty(), dtype=args.dtype,
                        verify=not args.skip_verify, fp8=_fp8_format(args))
        print(f"{summary.line()} -> {args.target_dir}")
        return 0
    except McoreRLError as e:  # bad input: the message names the value and the fix
        print(error_line(e), file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a permission, a failing device: the staging is already discarded
        doing = (f"comparing {args.local_dir!r} with {args.test_hf_dir!r}" if args.command == "test"
                 else f"merging {args.local_dir!r} into {args.target_dir!r}")
        print(os_error_line(e, doing), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
