"""Main job entry point (run every rank under torchrun):

    torchrun --nproc_per_node=2 launch/train.py --config configs/grpo_demo.yaml [key.path=value ...]

Rank 0 prints the layout, a progress bar and a closing summary. Other ranks print nothing
unless they fail (their tracebacks still reach stderr). An error mcore_rl raises on purpose (a
config typo, a refused checkpoint) ends the rank with exit code 2 and one ``error:`` line for the
job (``mcore_rl.entry.report_refusal``; launch/run.sh prints it once, without torchrun's report).
Known third-party notices (megatron's Transformer Engine / apex fallbacks, torch.distributed
renames; the list in mcore_rl/entry.py, shared with the converters) are filtered here, in the
entry point, not in library modules.
"""
from __future__ import annotations

import argparse
import os
import sys


def _use_this_checkout() -> None:
    """Imports mcore_rl from the repository this script lives in (not another installed copy)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


_use_this_checkout()
from mcore_rl.entry import quiet_third_party, report_refusal  # noqa: E402 - shared with the converters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (configs/*.yaml); omitted: schema defaults")
    parser.add_argument("overrides", nargs="*", help="key.path=value, e.g. steps=10 actor_optim.lr=1e-3")
    parser.add_argument("--check", action="store_true", help="only load and validate the config (launch/run.sh "
                        "does this before starting ranks)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    quiet_third_party(rank)
    from mcore_rl.errors import McoreRLError
    from mcore_rl.job.loop import run  # after the filters: megatron warns at import
    from mcore_rl.job.schema import load_job_config

    try:  # a config typo, a refused checkpoint: one line for the job, not a traceback per rank
        cfg = load_job_config(args.config, args.overrides)
        if not args.check:
            run(cfg)
    except McoreRLError as error:
        report_refusal(error, rank)
        sys.exit(2)


if __name__ == "__main__":  # megatron's checkpoint writers re-import the main module
    try:
        main()
    except SystemExit as stop:
        if stop.code != 2:
            raise
        # a refused rank ends at once: interpreter shutdown would destroy its process groups while
        # a peer may still wait in a collective, and a gloo thread destroyed still joinable prints
        # C++'s "terminate called without an active exception" after the error line
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
