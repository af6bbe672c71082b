"""What the ``main_ppo`` LoRA tests read from a run's adapter-only steps (``global_step_N/<role>``
saved by the mcore_rl engine): the tensors the step holds (adapter factors, a critic's value head;
never the base), how close two runs' trained tensors are, and whether a step's background HF export
(``hf_model``: ``<role>/model/huggingface/``) holds the base on disk plus the step's ``s B A``,
recomputed here from the saved factors (more of that export: tests/verl/test_verl_lora.py)."""
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


def base_mismatches(role_dir: str, base_dir: str) -> tuple[int, list[str]]:
    """The step's background HF export (``W + s B A``, merged from the saved step) against the
    base on disk ``W`` plus the step's saved adapters, recomputed here on purpose instead of
    calling the merge: ``delta = (B @ A) * s`` in fp64 (``B [out, r]``, ``A [r, in]``), split into
    the HF pieces by the weight's transform, ``W + delta`` in fp64, cast to ``W``'s dtype; equal
    bit for bit (dtype included) exactly when the export merged these factors into this base.
    Returns (HF tensors compared, names that differ); tensors the step holds itself (a critic's
    value head, trained in full) are not base weights and are skipped."""
    from mcore_rl.conversion.merge_io import canonical_rules, open_model_dir
    from mcore_rl.conversion.merge_lora import step_tensor
    from mcore_rl.fileio.model_layout import layout_of
    from mcore_rl.mapping.hf_io import SafetensorsReader

    step = open_model_dir(role_dir)
    exported = SafetensorsReader(layout_of(role_dir).hf_dir(role_dir))
    base = SafetensorsReader(base_dir)
    dims = step.args.mapping_dims(step.args.vocab_size)
    compared, differ = 0, []
    try:
        for canonical, hf_names, transform in canonical_rules(step.args, step.role):
            if step_tensor(step, canonical) is not None:  # trained in full
                continue
            transform = transform.bind(dims)
            pieces = [base[n] for n in hf_names]
            linear = canonical.removesuffix(".weight")
            a = step_tensor(step, linear + ".lora.A") if linear != canonical else None
            if a is not None:
                b, scale = step_tensor(step, linear + ".lora.B"), step_tensor(step, linear + ".lora.scale")
                delta = (b.double() @ a.double()) * float(scale.reshape(-1)[0])
                pieces = [(p.double() + d).to(p.dtype) for p, d in zip(pieces, transform.to_hf(delta, dims))]
            for name, expected in zip(hf_names, pieces):
                compared += 1
                got = exported[name]
                if got.dtype != expected.dtype or not torch.equal(got, expected):
                    differ.append(name)
    finally:
        step.reader.close()
    return compared, differ


def same_trained_tensors(a_role_dir: str, b_role_dir: str, where: str) -> None:
    """Two steps' trained tensors (adapters, a critic's value head) agree but for Adam's
    amplified rounding: at most 0.1% of the elements differ by more than 1e-6 (a step from a
    wrong optimizer state or LR moves most elements by ~lr)."""
    a, b = saved_model_tensors(a_role_dir), saved_model_tensors(b_role_dir)
    assert a.keys() == b.keys(), where
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    off = float((diff > 1e-6).float().mean())
    assert off <= 1e-3, f"{where}: {off:.2%} of the trained elements differ by > 1e-6 (max {float(diff.max()):.2e})"
