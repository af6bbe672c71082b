"""verl's CPU platform and patches, the engine config's refusals and the checkpoint path rule."""
from __future__ import annotations

import socket

import pytest
import torch

verl = pytest.importorskip("verl")

from mcore_rl.errors import CheckpointError  # noqa: E402
from mcore_rl.integrations.verl import platform  # noqa: E402
from mcore_rl.integrations.verl.config import McoreRLEngineConfig, VerlConfigError  # noqa: E402
from mcore_rl.integrations.verl.verl_checkpoints import step_and_role  # noqa: E402


def test_verl_sees_the_cpu_platform():
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device

    assert not torch.cuda.is_available()
    assert (get_device_name(), get_device_id(), get_nccl_backend()) == ("cpu", "cpu", "gloo")
    assert torch.ones(2, device=get_device_id()).device.type == "cpu"
    assert get_torch_device().max_memory_allocated() == 0  # no accelerator memory on CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_process_group_patch_is_needed_and_works(monkeypatch):
    import verl.utils.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for k in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(k, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    original = dist.initialize_global_process_group.__wrapped__
    with pytest.raises((ValueError, RuntimeError), match="[Dd]uplicate"):
        original()  # verl's own: 'cpu:gloo,cpu:gloo'
    try:
        assert dist.initialize_global_process_group() == (0, 0, 1)
        assert torch.distributed.get_backend() == "gloo"
    finally:
        torch.distributed.destroy_process_group()
    assert "gloo_process_group" in platform.apply_patches(verl.__version__)
    assert platform.apply_patches("0.0.0") == []  # another verl: nothing patched


def test_rollout_dump_patch_is_needed_and_works(tmp_path):
    """verl's one-step-off trainer skips ``RayPPOTrainer.__init__`` (its dump thread pool): verl's
    ``_dump_generations`` fails there; patched, ``trainer.rollout_data_dir``'s file is written at
    once, one JSON line per sample with the reward's extra keys."""
    import json

    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(OneStepOffRayTrainer)  # the attributes its own __init__ sets
    trainer.global_steps = 3
    args = (["q1", "q2"], ["a1", "a2"], ["1", "2"], [0.5, 1.0], {"min_global_steps": [2, 2]}, str(tmp_path))
    with pytest.raises(AttributeError, match="_dump_executor"):
        RayPPOTrainer._dump_generations.__wrapped__(trainer, *args)  # verl's own
    trainer._dump_generations(*args)
    rows = [json.loads(line) for line in (tmp_path / "3.jsonl").read_text().splitlines()]
    assert rows == [{"input": "q1", "output": "a1", "gts": "1", "score": 0.5, "step": 3, "min_global_steps": 2},
                    {"input": "q2", "output": "a2", "gts": "2", "score": 1.0, "step": 3, "min_global_steps": 2}]
    assert "rollout_dump_in_async_trainers" in platform.apply_patches(verl.__version__)


@pytest.mark.parametrize("kwargs,needle", [
    ({"context_parallel_size": 0}, "context_parallel_size"),
    ({"dtype": "float16"}, "dtype"),
    ({"strategy": "megatron"}, "strategy"),
    ({"use_fused_kernels": True}, "use_fused_kernels"),
])
def test_engine_config_refusals_name_the_key(kwargs, needle):
    with pytest.raises(VerlConfigError, match=needle):
        McoreRLEngineConfig(**{"strategy": "mcore_rl", **kwargs})


def test_engine_config_defaults():
    c = McoreRLEngineConfig(tensor_model_parallel_size=1)
    assert c.strategy == "mcore_rl" and c.sequence_parallel is False  # SP needs TP > 1, as verl's


def test_checkpoint_paths(tmp_path):
    root = str(tmp_path)
    assert step_and_role(f"{root}/global_step_7", "actor") == (f"{root}/global_step_7", 7, "actor")
    assert step_and_role(f"{root}/global_step_7/critic", "actor") == (f"{root}/global_step_7", 7, "critic")
    for bad in (f"{root}/step7", f"{root}/global_step_7/../x", f"{root}/global_step_7/other"):
        with pytest.raises(CheckpointError, match="global_step_<N>"):
            step_and_role(bad, "actor")


def test_integration_errors_derive_from_the_base():
    from tests.test_error_base import test_every_package_error_derives_from_the_base

    test_every_package_error_derives_from_the_base()  # here verl is installed: the adapter is scanned too
