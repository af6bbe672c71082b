"""A shaped rule reward for verl's ``reward.custom_reward_function`` (no imports from the repo:
verl loads this file by path in its reward workers): 1 for the exact answer as the first integer
of the response, else half the share of its characters that are digits or spaces — partial
credit that differs between the samples of one group even from a random policy (ties within a
GRPO group give zero gradient)."""
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    found = re.search(r"-?\d+", solution_str)
    if found is not None and found.group() == str(ground_truth).strip():
        return 1.0
    if not solution_str:
        return 0.0
    return 0.5 * sum(c.isdigit() or c == " " for c in solution_str) / len(solution_str)
