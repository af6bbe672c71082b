"""Writes the arithmetic task (mcore_rl/job/arithmetic_task.py: every "What is a +/- b? Answer with
the number only." with operands 0..20, a fixed held-out quarter) as verl RL parquets:
``<out>/train.parquet`` and ``<out>/val.parquet`` (chat messages, ground truth).

    python launch/verl/arithmetic_data.py --out outputs/verl_grpo_smollm2/data
"""
from __future__ import annotations

import argparse
import os


def write(out: str) -> tuple[int, int]:
    import pandas as pd

    from mcore_rl.job.arithmetic_task import ArithmeticConfig, questions

    os.makedirs(out, exist_ok=True)
    counts = []
    for name, rows in zip(("train", "val"), questions(ArithmeticConfig())):
        records = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": text}],
                    "reward_model": {"style": "rule", "ground_truth": str(answer)}, "extra_info": {"index": i}}
                   for i, (text, answer) in enumerate(rows)]
        pd.DataFrame(records).to_parquet(os.path.join(out, f"{name}.parquet"))
        counts.append(len(records))
    return counts[0], counts[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    train, val = write(parser.parse_args().out)
    print(f"arithmetic task: {train} training and {val} held-out questions")
