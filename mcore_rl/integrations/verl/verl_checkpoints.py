"""Where a verl engine's model starts, and its checkpoints as role parts of verl's steps
(``mcore_rl.checkpoint.role_parts``: the protocol; ``role_steps``: the manager).

Who owns what when verl drives: verl's trainer picks the directory (``local_path``): the step
directory ``<root>/global_step_<N>`` (verl's SFT trainer: the model goes to
``global_step_<N>/<role>``) or ``<root>/global_step_<N>/<role>`` (verl's PPO trainer: the actor,
then the critic, each engine its own part). After the engines' saves verl writes its own files
into the step (``data.pt``; SFT: ``data_<dp>.pt``) and then its tracker
``latest_checkpointed_iteration.txt``, which mcore_rl never writes. A step is complete (sealed,
``COMPLETE``) once verl's tracker names it and every part is whole on every node; sealing happens
at the next save or at the load that resumes it. Retention: per role, verl's
``max_ckpt_to_keep`` for that role, over sealed steps (see role_parts). A load never deletes a
checkpoint.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.checkpoint.config import CheckpointConfig
from mcore_rl.conversion.convert_input import role_from_config
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import VERL_V2, layout_of
from mcore_rl.checkpoint.role_steps import RoleStepManager
from mcore_rl.integrations.verl import verl_exports
from mcore_rl.integrations.verl.engine_config import VerlConfigError

log = logging.getLogger("mcore_rl.integrations.verl")
STEP = re.compile(r"global_step_(\d+)")
ROLES = ("actor", "critic", "ref")


@dataclass(frozen=True)
class ModelStart:
    """A HF directory to build from; ``init_value_head``: a value model from a causal LM (its
    trunk, a fresh value head); ``mcore_dir``: a mcore_rl model directory loaded after the build."""

    hf_dir: str
    init_value_head: bool
    mcore_dir: str | None = None


def model_start(path: str, role: str) -> ModelStart:
    """verl's ``model.path``: a HF directory (a policy: ``*ForCausalLM``; a value model: that, or
    ``*ForTokenClassification`` / ``*ForSequenceClassification``), or a mcore_rl model directory
    (converters/hf_to_mcore.py output or a checkpoint's ``global_step_N/<role>``, in either layout)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, META)):
        return ModelStart(layout_of(path).hf_dir(path), role == "critic", path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise VerlConfigError(f"model.path={path!r} holds neither config.json (a HF model) nor {META} (a mcore_rl "
                              "model directory); point it at one of them.")
    kind = role_from_config(path)
    if role == "actor" and kind != "actor":
        raise VerlConfigError(f"model.path={path!r} is a value/reward model ({kind}); a language_model engine "
                              "needs a *ForCausalLM checkpoint.")
    return ModelStart(path, role == "critic" and kind == "actor")


def load_model_dir_into(model_dir: str, engine) -> None:
    """Loads a mcore_rl model directory (any layout) into a built engine (collective)."""
    from mcore_rl.checkpoint.model_dir import load_model_dir

    load_model_dir(model_dir, engine, init_value_head=engine.role == "critic" and _dir_role(model_dir) == "actor")


def _dir_role(model_dir: str) -> str | None:
    import json

    with open(os.path.join(model_dir, META)) as f:
        return json.load(f).get("role")


def step_and_role(local_path: str, default_role: str) -> tuple[str, int, str]:
    """(step dir, step, role) for verl's ``local_path`` (see the module doc)."""
    path = os.path.abspath(os.path.expanduser(local_path))
    name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if STEP.fullmatch(name):
        return path, int(STEP.fullmatch(name).group(1)), default_role
    if STEP.fullmatch(parent) and name in ROLES:
        return os.path.dirname(path), int(STEP.fullmatch(parent).group(1)), name
    raise CheckpointError(f"checkpoint path {local_path!r}: the mcore_rl engine saves into <root>/global_step_<N> "
                          f"or <root>/global_step_<N>/<{'|'.join(ROLES)}>; verl's trainers pass such paths.")


def _manager(engine, root: str, max_ckpt_to_keep: int | None, contents: str) -> RoleStepManager:
    c = engine.checkpoint_config
    save = tuple(getattr(c, "save_contents", None) or ("model", "optimizer", "extra"))
    load = tuple(x for x in (getattr(c, "load_contents", None) or save) if x != "hf_model")
    if engine.engine.optimizer is None:  # a frozen model (forward_only): weights only
        save, load = ("model",), ("model",)
    # the per-save manager's close() does not wait for the exports: they run on in the process's queue
    e = engine.engine_config
    cfg = CheckpointConfig(root=root, max_ckpt_to_keep=max_ckpt_to_keep or None, save_contents=save,
                           load_contents=load, verify_content=e.verify_content, optimizer_sharding=e.optimizer_sharding,
                           hf_dtype=e.hf_dtype, hf_export_threads=e.hf_export_threads,
                           hf_export_supersede=e.hf_export_supersede, hf_export_wait_at_close=False)
    # the process's queue, for a load too: a resume re-exports sealed steps that lack their export
    # there, and a queue the per-load manager made would die with its close()
    queue = verl_exports.process_queue(cfg.hf_export_threads, cfg.hf_export_supersede) if "hf_model" in save else None
    return RoleStepManager(cfg, hf_sources={engine.role: engine.hf_source} if contents == "save" else None,
                           exports=queue, layout=VERL_V2)  # verl 0.9.1's layout: its merger and path helpers read it


def check_checkpoint_config(checkpoint_config) -> None:
    """verl's checkpoint settings the engine cannot honour (the engine's constructor may call it
    to refuse them before training rather than at the first save)."""
    if getattr(checkpoint_config, "async_save", False):
        raise VerlConfigError("checkpoint.async_save=True: verl then skips its latest_checkpointed_iteration.txt and "
                              "expects the engine to write it, but a step of the mcore_rl engine completes only "
                              "once verl's own tracker names it; set checkpoint.async_save=False.")


def save(engine, local_path: str, hdfs_path: str | None, global_step: int, max_ckpt_to_keep: int | None) -> None:
    """Saves the engine as the ``<role>`` part of step ``global_step`` (collective); verl's
    ``max_ckpt_to_keep`` for this role (None or 0: keep all) is the role's retention count."""
    if hdfs_path:
        raise CheckpointError(f"hdfs_path={hdfs_path!r}: the mcore_rl engine writes local or shared paths only "
                              "(node-local disks are synchronized by mcore_rl); leave default_hdfs_dir unset.")
    check_checkpoint_config(engine.checkpoint_config)
    step_dir, step, role = step_and_role(local_path, engine.role)
    if step != global_step:
        raise CheckpointError(f"checkpoint path {local_path!r} names step {step} but global_step={global_step}.")
    manager = _manager(engine, os.path.dirname(step_dir), max_ckpt_to_keep, "save")
    manager.save_role(step, role, engine.engine)
    if verl_exports.last_step(engine.optimizer_config, global_step):  # the job may end right after it
        _wait_exports(manager, step, role)
    manager.close()


def _wait_exports(manager: RoleStepManager, step: int, role: str) -> None:
    """Collective: the trainer's last save waits for every node's HF exports; a failure is
    logged (verl completes the step after this save: raising would cost it)."""
    try:
        manager.wait_exports()
    except CheckpointError as e:
        if torch.distributed.get_rank() == 0:
            log.error("the last save (step %d, %s) found a failed HF export: %s", step, role, e)


def load(engine, local_path: str, hdfs_path: str | None, del_local_after_load: bool) -> None:
    """Loads the engine from the step ``local_path`` names (collective), sealing the step first
    when verl's tracker names it and it is not sealed yet; deletes nothing."""
    if hdfs_path:
        raise CheckpointError(f"hdfs_path={hdfs_path!r}: the mcore_rl engine loads local or shared paths only.")
    step_dir, _, role = step_and_role(local_path, engine.role)
    if del_local_after_load:
        log.info("del_local_after_load=True ignored: the mcore_rl engine never deletes a checkpoint it loads")
    manager = _manager(engine, os.path.dirname(step_dir), None, "load")
    manager.load_role(step_dir, role, engine.engine, manager.cfg.load_contents)
    manager.close()


__all__: list[Any] = ["ModelStart", "model_start", "step_and_role", "check_checkpoint_config", "save", "load"]
