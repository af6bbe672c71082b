"""The shaped arithmetic reward (arithmetic_reward.py) that also returns, per sample, the versions
of the weights that generated it, so verl writes them into ``trainer.rollout_data_dir`` (its
reward manager keeps a dict reward's other keys as ``reward_extra_info``, dumped per sample).

verl's LLM-server client stores the version the rollout server reports for a request
(``TokenOutput.extra_fields['global_steps']``) as ``min_global_steps`` / ``max_global_steps`` (a
partial rollout resumed after a sync spans two versions); the agent loop passes the output's
extra fields to the reward as ``extra_info``. A missing version is written as -1 (the tests
refuse it). Loaded by path in verl's reward workers: imports its sibling by path too."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "arithmetic_reward", os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic_reward.py"))
_shaped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shaped)


def _version(extra_info, key):
    value = (extra_info or {}).get(key)
    return -1 if value is None else int(value)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": _shaped.compute_score(data_source, solution_str, ground_truth),
            "min_global_steps": _version(extra_info, "min_global_steps"),
            "max_global_steps": _version(extra_info, "max_global_steps"), "index": _version(extra_info, "index")}
