"""Main job entry point (run every rank under torchrun):

    torchrun --nproc_per_node=2 launch/train.py --config configs/grpo_demo.yaml [key.path=value ...]

Rank 0 prints the layout, a progress bar and a closing summary. Other ranks print nothing
unless they fail (their tracebacks still reach stderr). Known third-party notices (megatron's
Transformer Engine / apex fallbacks, torch.distributed renames; the list in mcore_rl/entry.py,
shared with the converters) are filtered here, in the entry point, not in library modules.
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
from mcore_rl.entry import quiet_third_party  # noqa: E402 - the list both entry points filter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (configs/*.yaml); omitted: schema defaults")
    parser.add_argument("overrides", nargs="*", help="key.path=value, e.g. steps=10 actor_optim.lr=1e-3")
    parser.add_argument("--check", action="store_true", help="only load and validate the config (launch/run.sh "
                        "does this before starting ranks)")
    args = parser.parse_args()
    quiet_third_party(int(os.environ.get("RANK", "0")))
    from mcore_rl.config_loader import ConfigError
    from mcore_rl.job.loop import run  # after the filters: megatron warns at import
    from mcore_rl.job.schema import load_job_config

    try:
        cfg = load_job_config(args.config, args.overrides)
    except ConfigError as error:  # a typo is one line, not a traceback per rank
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if not args.check:
        run(cfg)


if __name__ == "__main__":  # megatron's checkpoint writers re-import the main module
    main()
