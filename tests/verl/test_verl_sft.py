"""verl's own SFT trainer (``python -m verl.trainer.sft_trainer`` under torchrun, no Ray) drives
mcore_rl on CPU: the loss falls, verl saves through our engine (with ``hf_model``: the HF weights
exported in the background into ``actor/model/huggingface/``), a rerun resumes exactly, and other
layouts and micro-batchings compute the same losses as DP=2 with padded rows: TP=2 + SP with
packed rows in dynamic micro-batches, PP=2 with padded rows in micro-batches of 1 (each differs
from the reference in both, so a fault in either shows).

The steps are written in verl 0.9.1's checkpoint layout: verl's own path helpers, old-layout
detector and manifest schema accept them, and verl's merger (on CPU, ``verl_merger_cpu``) writes
the same weights as ``mcore_to_hf.py merge --dtype bf16`` (the TP=2 step; tests/verl/layout_checks.py).
The resumed step is first rewritten in the older layout (``<role>/dist_ckpt/``): it still resumes
exactly and merges."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

from tests.verl.export_checks import assert_exported, engine_log_prob_gap  # noqa: E402
from tests.verl.layout_checks import check_verl_reads, to_old_layout, verl_merge, weight_differences  # noqa: E402
from tests.verl.verl_fixtures import save_sft_parquet, save_tiny_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl_sft")
    return {"model": save_tiny_model(str(d / "model")), "train": save_sft_parquet(str(d / "train.parquet")),
            "dir": str(d)}


PADDED = "model.use_remove_padding=False"
HF_MODEL = "checkpoint.save_contents=[model,optimizer,extra,hf_model]"


@pytest.fixture(scope="module")
def dp_padded(inputs, tmp_path_factory) -> tuple[list[tuple[float, float]], str]:
    """3 steps at DP=2 without remove-padding, saving step 3 with ``hf_model``: the reference for
    the other layouts and the first run of the resume test; (losses and grad norms, checkpoint
    dir). Its HF weights were exported in the background from the written part (the trainer's
    last save waited for them): they equal ``mcore_to_hf.py merge`` of the part, and transformers
    computes from them the log-probs of mcore_rl's engine loaded from the part (fp32 both). The
    step is then rewritten as builds before verl's layout wrote it (``to_old_layout``: its HF
    weights recorded inline, as such builds wrote them), after its merge (``<dir>/v2_merged``):
    the resume reads it."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.model_layout import VERL_V2, layout_of

    root = str(tmp_path_factory.mktemp("dp") / "ckpt")
    losses = sft(inputs, root, 3, PADDED, HF_MODEL)
    actor = os.path.join(root, "global_step_3", "actor")
    assert layout_of(actor) is VERL_V2
    assert_exported(actor, 3)
    gap = engine_log_prob_gap(actor)
    assert gap["gap"] <= 1e-5 and gap["tokens"] > 50, gap
    merge(actor, os.path.join(os.path.dirname(root), "v2_merged"), dtype="bf16")
    to_old_layout(actor)
    return losses, root


def merged_alike(role_dir: str, tmp: Path) -> None:
    """verl's megatron merger and ``mcore_to_hf.py merge --dtype bf16`` of ``role_dir`` write the
    same weights, bit for bit; verl's helpers accept the directory first."""
    from mcore_rl.conversion.merge import merge

    check_verl_reads(role_dir)
    verl_merge(role_dir, str(tmp / "verl_merged"))
    merge(role_dir, str(tmp / "merged"), dtype="bf16")
    assert weight_differences(str(tmp / "verl_merged"), str(tmp / "merged")) == []


def sft(inputs: dict, ckpt: str, steps: int, *overrides: str) -> list[tuple[float, float]]:
    """Runs verl's SFT trainer on 2 CPU processes; returns the logged (train loss, grad norm) by
    step (the grad norm shows a wrongly scaled loss, which Adam's update would hide)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "verl.trainer.sft_trainer",
           "hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]", "engine=mcore_rl", "optim=megatron",
           "engine.dtype=float32", f"model.path={inputs['model']}", "model.enable_gradient_checkpointing=False",
           f"data.train_files={inputs['train']}", "data.val_files=null", "data.train_batch_size=8",
           "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False", "data.max_length=64", "data.num_workers=0",
           "optim.lr=1e-3", "optim.lr_warmup_steps=0", "trainer.test_freq=-1", "trainer.save_freq=3",
           f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={ckpt}", "trainer.logger=[console]",
           "trainer.device=cpu", *overrides]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=inputs["dir"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = re.findall(r"step:(\d+) - .*?train/loss:([0-9.e+-]+) - train/grad_norm:([0-9.e+-]+)",
                       proc.stdout + proc.stderr)
    return [(float(v), float(g)) for _, (v, g) in sorted({int(s): (v, g) for s, v, g in found}.items())]


def test_sft_trainer_trains_saves_and_resumes_exactly(inputs, dp_padded, tmp_path):
    straight = sft(inputs, str(tmp_path / "a"), 6, PADDED)
    assert len(straight) == 6 and straight[-1][0] < 0.5 * straight[0][0], straight
    first, root = dp_padded[0], Path(dp_padded[1])  # this test is the first to use it: step 3 only
    assert first == straight[:3]
    step = root / "global_step_3"
    # the engine wrote its role part (record last); verl then its data files and its tracker; the
    # step is sealed (COMPLETE) by the next save or by the load that resumes it
    assert (step / "actor" / "PART").is_file() and (step / "actor" / "mcore_rl.json").is_file()
    assert (step / "data_0.pt").is_file() and not (step / "COMPLETE").exists()
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = sft(inputs, str(root), 6, PADDED)
    assert resumed == straight[3:], (resumed, straight)  # steps 4..6, bit for bit
    assert sorted(os.listdir(root)) == ["global_step_3", "global_step_6", "latest_checkpointed_iteration.txt"]
    sealed = json.loads((step / "COMPLETE").read_text())  # sealed at the resume: the model and verl's files
    assert sealed["roles"] == ["actor"] and {"data_0.pt", "data_1.pt", "actor/PART"} <= set(sealed["files"])
    assert not (root / "global_step_6" / "COMPLETE").exists()  # the newest step, until a resume seals it
    # step 3 (the older layout) resumed exactly above, and merges; verl's own detector refuses it
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    from mcore_rl.conversion.merge import merge

    assert (step / "actor" / "dist_ckpt").is_dir() and not (step / "actor" / "model").exists()
    merge(str(step / "actor"), str(tmp_path / "old_merged"), dtype="bf16")
    assert weight_differences(str(tmp_path / "old_merged"), str(root.parent / "v2_merged")) == []
    with pytest.raises(RuntimeError, match="deprecated Megatron checkpoint layout"):
        MegatronCheckpointManager._raise_for_old_layout(str(step / "actor"))
    check_verl_reads(str(root / "global_step_6" / "actor"))  # written by the resumed run (verl's merger: TP=2 below)


@pytest.mark.parametrize("overrides", [
    ("engine.tensor_model_parallel_size=2", "engine.sequence_parallel=True", "model.use_remove_padding=True",
     "data.use_dynamic_bsz=True", "data.max_token_len_per_gpu=24"),
    # more micro-batches: the loss scaling by their count must keep the gradient the same
    ("engine.pipeline_model_parallel_size=2", "data.micro_batch_size_per_gpu=1", PADDED),
], ids=["tp2_sp_packed_dynamic", "pp2_padded_micro1"])
def test_sft_trainer_other_layouts_same_losses(inputs, tmp_path, dp_padded, overrides):
    reference = dp_padded[0]
    other = sft(inputs, str(tmp_path / "other"), 3, *overrides)
    assert len(other) == len(reference) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(other, reference):
        assert loss == pytest.approx(ref_loss, abs=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), (other, reference)
    if "engine.tensor_model_parallel_size=2" in overrides:  # its step 3 holds TP=2 shards
        merged_alike(str(tmp_path / "other" / "global_step_3" / "actor"), tmp_path)


def test_model_path_may_be_a_role_dir_of_either_layout(tmp_path):
    """verl's ``model.path``: a step's role dir in verl's layout builds from its model/huggingface/."""
    from mcore_rl.fileio.model_layout import MCORE_RL, VERL_V2
    from mcore_rl.integrations.verl.verl_checkpoints import ModelStart, model_start

    for layout in (MCORE_RL, VERL_V2):
        d = str(tmp_path / layout.name)
        os.makedirs(layout.hf_dir(d))
        meta = {"role": "actor", **({"model_layout": layout.name} if layout is VERL_V2 else {})}
        Path(d, "mcore_rl.json").write_text(json.dumps(meta))
        assert model_start(d, "critic") == ModelStart(layout.hf_dir(d), True, d)
