"""The background HF exporter as a process: ``python -m mcore_rl.conversion.hf_export_worker
--role_dir global_step_N/<role> --step N [--dtype X] [--max_shard_size S] [--threads T]
[--nice K] [--fp8_block_size R [C]] [--scale_fmt F]``.

It lowers its own CPU priority (``nice``, by ``--nice``, default 10) and IO priority (idle, else best-effort 7), runs torch
(and OpenMP / MKL) on ``--threads`` threads, exports the step (``hf_export.export_step``) and prints
one summary line: exit 0. Bad input or a failed export: ONE ``error: ...`` line on stderr, exit 2,
no traceback. The parent that starts it makes it die with the parent
(``child_process.die_with_parent_preexec()`` as ``Popen``'s ``preexec_fn``).
"""
from __future__ import annotations

import argparse
import os
import sys

from mcore_rl.errors import OneLineParser, positive_int

DTYPES = ("fp32", "bf16", "fp16", "fp8", "mxfp4")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hf_export_worker", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--role_dir", required=True, help="the role dir of a complete step: global_step_<N>/<role>")
    p.add_argument("--step", required=True, type=int, help="the step N (must be the role dir's)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="as mcore_to_hf.py merge --dtype (default: the "
                   "checkpoint's)")
    p.add_argument("--max_shard_size", default="5GB", help="largest shard (e.g. 5GB, 500MiB)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch / OpenMP / MKL threads (default 1)")
    p.add_argument("--nice", type=int, choices=range(0, 20), default=10, metavar="0..19",
                   help="how much to lower the CPU priority (default 10); the IO priority is idle either way")
    p.add_argument("--fp8_block_size", nargs="+", default=None, help="--dtype fp8: the block, e.g. 128 128")
    p.add_argument("--scale_fmt", default=None, help="--dtype fp8: the scale format (float, ue8m0)")
    return p


def _spec(args: argparse.Namespace):
    from mcore_rl.checkpoint.hf_export import ExportError, ExportSpec
    from mcore_rl.mapping.fp8_quant import BlockFp8, parse_block

    given = [f for f, v in (("--fp8_block_size", args.fp8_block_size), ("--scale_fmt", args.scale_fmt)) if v]
    if args.dtype != "fp8" and given:
        raise ExportError(f"{' and '.join(given)} given with --dtype {args.dtype}; they apply to --dtype fp8 only.")
    fp8 = None
    if args.dtype == "fp8":
        block = parse_block(" ".join(args.fp8_block_size)) if args.fp8_block_size else (128, 128)
        fp8 = BlockFp8(block, args.scale_fmt or "float")
    return ExportSpec(args.dtype, args.max_shard_size, fp8)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 exported (or complete already), 2 bad input or a failed export (one line).
    The input is checked before the process lowers its priority (a refusal changes nothing)."""
    args = _parser().parse_args(argv)
    threads = str(args.threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch starts its pools
        os.environ[name] = threads
    from mcore_rl.errors import McoreRLError, error_line

    try:
        import torch

        from mcore_rl.checkpoint.hf_export import check_role_dir
        from mcore_rl.conversion.hf_export_step import export_step

        spec = _spec(args)
        check_role_dir(args.role_dir, args.step)
        from mcore_rl.checkpoint.child_process import lower_priority

        priority = lower_priority(args.nice)
        torch.set_num_threads(args.threads)
        result = export_step(args.role_dir, spec, args.step)
    except McoreRLError as e:
        print(error_line(e), file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # a full disk, a permission, a failing device
        where = f": {e.filename!r}" if e.filename else ""
        print(error_line(f"exporting step {args.step} of {args.role_dir!r} failed: [Errno {e.errno}] {e.strerror or e}"
                         f"{where}; what it wrote is a partial export (hf_export_record.clean_partial removes it): "
                         "check free space, permissions and the device, then export again."), file=sys.stderr,
              flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 - the parent reads one line, never a traceback
        print(error_line(f"exporting step {args.step} of {args.role_dir!r} failed: {type(e).__name__}: {e} (not a "
                         "refusal of mcore_rl's: report it with this line)"), file=sys.stderr, flush=True)
        return 2
    print(f"{result.line()} ({priority}, {torch.get_num_threads()} torch thread(s))", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
