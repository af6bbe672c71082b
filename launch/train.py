"""Main job entry point (run every rank under torchrun):

    torchrun --nproc_per_node=2 launch/train.py --config configs/grpo_demo.yaml [key.path=value ...]

Rank 0 prints the layout, a progress bar and a closing summary. Other ranks print nothing
unless they fail (their tracebacks still reach stderr). Known third-party notices (megatron's
Transformer Engine / apex fallbacks, torch.distributed renames) are filtered here, in the entry
point, not in library modules.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

# (category, message regex) of notices that say nothing a user of the job can act on
QUIET_WARNINGS = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"Transformer Engine is not installed"),
    (UserWarning, r"full scope is deprecated"),  # megatron's own default for cuda_graph_scope
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),  # megatron calls the old names
)


def quiet_third_party(rank: int) -> None:
    """Filters known notices on rank 0; non-zero ranks drop stdout and every warning (errors
    and tracebacks still go to stderr)."""
    if rank != 0:
        warnings.simplefilter("ignore")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        return
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def _use_this_checkout() -> None:
    """Imports mcore_rl from the repository this script lives in (not another installed copy)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (configs/*.yaml); omitted: schema defaults")
    parser.add_argument("overrides", nargs="*", help="key.path=value, e.g. steps=10 actor_optim.lr=1e-3")
    args = parser.parse_args()
    quiet_third_party(int(os.environ.get("RANK", "0")))
    _use_this_checkout()
    from mcore_rl.job.loop import run  # after the filters: megatron warns at import
    from mcore_rl.job.schema import load_job_config

    run(load_job_config(args.config, args.overrides))


if __name__ == "__main__":  # megatron's checkpoint writers re-import the main module
    main()
