"""Main job entry point (run every rank under torchrun):

    torchrun --nproc_per_node=2 launch/train.py --config configs/grpo_demo.yaml [key.path=value ...]
"""
from __future__ import annotations

import argparse

from mcore_rl.config_loader import load_config
from mcore_rl.job.loop import run
from mcore_rl.job.schema import JobConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (configs/*.yaml); omitted: schema defaults")
    parser.add_argument("overrides", nargs="*", help="key.path=value, e.g. steps=10 actor_optim.lr=1e-3")
    args = parser.parse_args()
    run(load_config(JobConfig, args.config, args.overrides))


if __name__ == "__main__":  # megatron's checkpoint writers re-import the main module
    main()
