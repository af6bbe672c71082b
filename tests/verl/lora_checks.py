"""What the ``main_ppo`` LoRA tests read from a run's adapter-only steps (``global_step_N/<role>``
saved by the mcore_rl engine): the tensors the step holds (adapter factors, a critic's value head;
never the base), and whether the engine's log-probs in training are those of the base on disk
plus the step's adapters (its base untouched). (A LoRA step saved with ``hf_model`` gets the same
merge as its background export: tests/verl/test_verl_lora.py.)"""
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


def policy_log_prob_gap(role_dir: str, samples: list[dict], temperature: float, with_adapters: bool = True) -> float:
    """max |log-prob difference| over ``samples``' response tokens between the engine's log-probs
    recorded in training (``old_log_probs``, tests/verl/recording_dataset.py) and transformers'
    model of the adapter-only step ``role_dir`` merged onto its base as it is on disk
    (``mcore_to_hf.py merge``: ``W + s B A``; ``with_adapters=False``: the base alone, a
    control), logits divided by ``temperature`` as verl computes them. Within rounding exactly
    when the engine's base at that step is the base it started from, with the step's adapters."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.files import META

    with open(os.path.join(role_dir, META)) as f:
        base = json.load(f)["lora"]["base"]["path"]
    with tempfile.TemporaryDirectory(prefix="lora_merged_") as tmp:
        if with_adapters:
            merge(role_dir, os.path.join(tmp, "hf"))
        model = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "hf") if with_adapters else base,
                                                     attn_implementation="eager", dtype=torch.float32).eval()
    gap = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt"] + s["response"]])
            logits = model(ids).logits[0].float()[len(s["prompt"]) - 1:-1] / temperature
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s["response"])[:, None])[:, 0]
            gap = max(gap, float((mine - s["old_log_probs"]).abs().max()))
    return gap


def same_trained_tensors(a_role_dir: str, b_role_dir: str, where: str) -> None:
    """Two steps' trained tensors (adapters, a critic's value head) agree but for Adam's
    amplified rounding: at most 0.1% of the elements differ by more than 1e-6 (a step from a
    wrong optimizer state or LR moves most elements by ~lr)."""
    a, b = saved_model_tensors(a_role_dir), saved_model_tensors(b_role_dir)
    assert a.keys() == b.keys(), where
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    off = float((diff > 1e-6).float().mean())
    assert off <= 1e-3, f"{where}: {off:.2%} of the trained elements differ by > 1e-6 (max {float(diff.max()):.2e})"
