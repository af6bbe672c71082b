"""verl's ``reward.custom_reward_function`` for the arithmetic task: 1.0 when the last integer in
the response is exactly the answer, else 0.0 (the main job's reward, mcore_rl/job/arithmetic_task.py)."""
from mcore_rl.job.arithmetic_task import last_integer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(last_integer(solution_str) == str(ground_truth).strip())
