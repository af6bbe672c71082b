"""Several runs of verl's SFT trainer in ONE launch of 2 processes (``torchrun -m
tests.verl.sft_runner PLAN.json``), so that a comparison of many (model, engine, layout) cases pays
Python's, torch's and verl's start-up once.

PLAN.json: a list of entries, run in order by both processes:
- ``{"sft": [overrides], "metrics": path}``: verl's SFT trainer as ``python -m
  verl.trainer.sft_trainer <overrides>`` runs it (the same Hydra config, composed here), its
  metrics written by verl's file logger to ``metrics`` (JSON lines, exact floats);
- ``{"call": "module:function", "args": [...], "out": path}``: a rank body; rank 0 writes what
  it returns to ``out`` (torch.save).

Between entries the runner tears down what a run leaves in the process: megatron's parallel state
(the next mcore_rl engine may ask for another layout) and the finished trainer. The process
group is verl's (``initialize_global_process_group``), made once. The test side: ``launch`` and
``read_sft``.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import traceback
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compose(overrides: list[str]):
    """verl's ``sft_trainer_engine`` config with ``overrides``, as its Hydra main composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return hydra_compose("sft_trainer_engine", overrides=list(overrides))


def run_sft(overrides: list[str], metrics: str) -> None:
    """One SFT training (verl's ``SFTTrainer.fit``), its logged metrics into ``metrics``."""
    from verl.trainer.sft_trainer import SFTTrainer

    os.environ["VERL_FILE_LOGGER_PATH"] = metrics
    config = compose([*overrides, "trainer.logger=[console,file]"])
    trainer = SFTTrainer(config=config)
    trainer.fit()
    del trainer


def run_call(target: str, args: list[Any], out: str) -> None:
    """``module:function(*args)`` on every rank; rank 0 saves its result to ``out``."""
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(*args)
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)


def teardown() -> None:
    """What one run leaves behind: megatron's groups (mcore_rl's engine made them), garbage."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    gc.collect()
    torch.distributed.barrier()


def main(plan_path: str) -> None:
    """Runs every entry of the plan in order (see the module docstring). An entry that raises
    on every rank leaves its traceback in ``<metrics or out>.error`` and the next one runs."""
    from verl.utils.distributed import destroy_global_process_group, initialize_global_process_group

    with open(plan_path) as f:
        plan = json.load(f)
    initialize_global_process_group()
    for entry in plan:
        try:
            if "sft" in entry:
                run_sft(entry["sft"], entry["metrics"])
            else:
                run_call(entry["call"], entry.get("args", []), entry["out"])
        except Exception:  # reported through the file: the test names the entry
            with open((entry.get("metrics") or entry["out"]) + ".error", "a") as f:
                f.write(f"rank {torch.distributed.get_rank()}:\n{traceback.format_exc()}\n")
        teardown()
    destroy_global_process_group()


def launch(plan: list[dict], workdir: str, timeout_s: float) -> subprocess.CompletedProcess:
    """The test side: writes ``plan`` to ``workdir`` and runs it on 2 CPU processes (torchrun);
    verl's FSDP engines are found through ``VERL_ENGINE_DEVICE=cuda`` (their registration is for
    cuda and npu; mcore_rl's is for cpu and cuda)."""
    path = os.path.join(workdir, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tests.verl.sft_runner", path]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "VERL_ENGINE_DEVICE": "cuda"}
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)


def read_sft(metrics: str) -> list[tuple[float, float]] | str:
    """An SFT entry's (train loss, grad norm) by step from verl's file logger; its error text
    (or a note that nothing was logged) when it failed."""
    if os.path.isfile(metrics + ".error"):
        with open(metrics + ".error") as f:
            return f.read()
    if not os.path.isfile(metrics):
        return f"no metrics at {metrics}"
    with open(metrics) as f:
        rows = sorted(((r["step"], r["data"]) for r in map(json.loads, filter(str.strip, f))), key=lambda r: r[0])
    return [(float(d["train/loss"]), float(d["train/grad_norm"])) for _, d in rows]


if __name__ == "__main__":
    main(sys.argv[1])
