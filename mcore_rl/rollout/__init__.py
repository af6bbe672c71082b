"""Rollout engines (generate responses with their rollout log-probs; take weights from the
trainer) and the rollout-versus-training mismatch metrics."""
