"""Small model directories the read-path tests damage (built once per test session under the
session's base temp dir): a tiny HF llama, its converter output (with RECORD), and a
CheckpointManager step of an engine started from it, saved twice under one step number in two
roots with different weights (a step and its replacement), with each save's HF export."""
from __future__ import annotations

import os
import shutil

import torch

from tests.dist import run_ranks


def _body(base: str) -> dict:
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager
    from mcore_rl.conversion.convert import ConvertOptions, convert
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.ckpt_util import train_step, writer_processes_allowed
    from tests.tiny import saved_tiny_llama

    hf = saved_tiny_llama(os.path.join(base, "hf"), num_hidden_layers=2)
    convert(ConvertOptions(hf, os.path.join(base, "conv")), progress=False)
    layout = ParallelLayout()
    destroy_parallel_state()  # the conversion's
    initialize_parallel_state(layout, seed=5)
    args = model_args_from_hf(hf)
    engine = ModelEngine(args, layout, "actor", active_platform(), optim=OptimConfig(lr=0.05), hf_weights=hf)
    exports = {}
    for name in ("ckpt", "ckpt_new"):
        train_step(engine, len(exports) + 1)  # the two saves hold different weights
        manager = CheckpointManager(CheckpointConfig(root=os.path.join(base, name), save_contents=("model",)),
                                    hf_sources={"actor": hf})
        with writer_processes_allowed():
            manager.save(1, {"actor": engine}, {"step": 1})
        manager.close()
        exports[name] = {k: v.clone() for k, v in export_hf(engine.model, args, "actor").items()}
    return exports


def build(base) -> dict:
    """{"hf", "conv", "step" (global_step_1/actor), "step_new" (its replacement's), "export",
    "export_new"}: paths, and the HF exports of the two saves (name -> tensor)."""
    base = os.path.join(str(base), "read_fixtures")
    done = os.path.join(base, "exports.pt")
    if not os.path.isfile(done):
        shutil.rmtree(base, ignore_errors=True)  # a build cut short
        os.makedirs(base)
        exports = run_ranks(1, _body, base)[0]
        torch.save(exports, done)
    exports = torch.load(done, weights_only=True)
    return {"hf": os.path.join(base, "hf"), "conv": os.path.join(base, "conv"),
            "step": os.path.join(base, "ckpt", "global_step_1", "actor"),
            "step_new": os.path.join(base, "ckpt_new", "global_step_1", "actor"),
            "export": exports["ckpt"], "export_new": exports["ckpt_new"]}
