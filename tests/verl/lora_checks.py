"""What the ``main_ppo`` LoRA tests read from a run's adapter-only steps (``global_step_N/<role>``
saved by the mcore_rl engine): the tensors the step holds (adapter factors, a critic's value head;
never the base) and how close two runs' trained tensors are. (A LoRA step saved with ``hf_model``
gets its merged HF weights from the background export: tests/verl/test_verl_lora.py.)"""
from __future__ import annotations

import json
import os

import torch

ADAPTER = ".lora."


def saved_model_tensors(role_dir: str) -> dict[str, torch.Tensor]:
    """The model tensors of a step (its optimizer state left out), full (unsharded), by
    megatron name (a layer stack ``[layers, ...]`` per name)."""
    from mcore_rl.conversion.merge_io import open_model_dir

    model = open_model_dir(role_dir)
    try:
        return {k: model.reader.read(k).clone() for k in model.reader.tensors if not k.startswith("optimizer.")}
    finally:
        model.reader.close()


def assert_adapter_only(role_dir: str) -> None:
    """The step is an adapter-only LoRA step: its record says so and it holds adapter factors
    (and a critic's value head), no base weight."""
    with open(os.path.join(role_dir, "mcore_rl.json")) as f:
        assert json.load(f)["lora"]["adapter_only"] is True, role_dir
    names = saved_model_tensors(role_dir)
    base = [n for n in names if ADAPTER not in n and not n.startswith("output_layer.")]
    assert not base and any(ADAPTER in n for n in names), (role_dir, sorted(names))


def same_trained_tensors(a_role_dir: str, b_role_dir: str, where: str) -> None:
    """Two steps' trained tensors (adapters, a critic's value head) agree but for Adam's
    amplified rounding: at most 0.1% of the elements differ by more than 1e-6 (a step from a
    wrong optimizer state or LR moves most elements by ~lr)."""
    a, b = saved_model_tensors(a_role_dir), saved_model_tensors(b_role_dir)
    assert a.keys() == b.keys(), where
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    off = float((diff > 1e-6).float().mean())
    assert off <= 1e-3, f"{where}: {off:.2%} of the trained elements differ by > 1e-6 (max {float(diff.max()):.2e})"
