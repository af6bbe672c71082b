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
    exports["load_model_dir"] = _loads(base, engine)
    return exports


def _loads(base: str, engine) -> dict[str, str]:
    """load_model_dir (a job's model.mcore_dir) of the converter output, of a copy with a flipped
    byte and of a step copy without its marker: "loaded" or the error."""
    from mcore_rl.checkpoint.model_dir import load_model_dir

    flipped, torn = os.path.join(base, "load", "flipped"), os.path.join(base, "load", "root", "global_step_1")
    shutil.copytree(os.path.join(base, "conv"), flipped)
    flip_in_up_proj(flipped)
    shutil.copytree(os.path.join(base, "ckpt", "global_step_1"), torn)
    os.remove(os.path.join(torn, "COMPLETE"))
    out = {}
    for name, d in (("good", os.path.join(base, "conv")), ("flipped", flipped), ("torn", os.path.join(torn, "actor"))):
        try:
            load_model_dir(d, engine)
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test checks the message
            out[name] = f"{type(e).__name__}: {e}"
    shutil.rmtree(os.path.join(base, "load"))
    return out


def flip_in_up_proj(model_dir: str) -> None:
    """Flips one bit of layer 1's up_proj rows inside the shard (found by its bytes)."""
    from mcore_rl.fileio.torch_dist_read import TorchDistReader

    reader = TorchDistReader(os.path.join(model_dir, "dist_ckpt"))
    fc1 = reader.read("decoder.layers.mlp.linear_fc1.weight", (1,)).contiguous()
    del reader
    shard = os.path.join(model_dir, "dist_ckpt", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    at = data.find(fc1.numpy().tobytes()[:64])
    assert at > 0
    data[at + fc1.numel() * 4 * 3 // 4 + 1] ^= 0x10  # in the second half of fc1: up_proj
    open(shard, "wb").write(bytes(data))


def build(base) -> dict:
    """{"hf", "conv", "step" (global_step_1/actor), "step_new" (its replacement's), "export",
    "export_new", "load_model_dir"}: paths, the HF exports of the two saves (name -> tensor), and
    what load_model_dir said of a good, a flipped and a torn model dir (``_loads``)."""
    base = os.path.join(str(base), "read_fixtures")
    done = os.path.join(base, "exports.pt")
    if not os.path.isfile(done):
        shutil.rmtree(base, ignore_errors=True)  # a build cut short
        os.makedirs(base)
        exports = run_ranks(1, _body, base)[0]
        torch.save(exports, done)
    exports = torch.load(done, weights_only=True)
    loads = exports.pop("load_model_dir")
    return {"hf": os.path.join(base, "hf"), "conv": os.path.join(base, "conv"),
            "step": os.path.join(base, "ckpt", "global_step_1", "actor"),
            "step_new": os.path.join(base, "ckpt_new", "global_step_1", "actor"),
            "export": exports["ckpt"], "export_new": exports["ckpt_new"], "load_model_dir": loads}
