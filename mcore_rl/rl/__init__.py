"""RL losses and advantage estimators (PPO, GRPO, DAPO) in plain torch."""
