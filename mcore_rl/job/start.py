"""Where the job's models start: a HF directory (``model.hf_dir``), a model directory written by
converters/hf_to_mcore.py or by the checkpoint manager (``model.mcore_dir``), or the embedded
tiny model; the critic from the actor's start (fresh value head) or from ``model.critic_dir``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.checkpoint.model_dir import load_model_dir
from mcore_rl.config_loader import ConfigError
from mcore_rl.models.hf_config import ModelArgs, model_args_from_hf

Tensor = torch.Tensor


@dataclass(frozen=True)
class Start:
    """One model's starting weights. ``hf``: a HF directory or HF name -> tensor, loaded while the
    engine is built; ``mcore_dir``: a model directory loaded into the built engine (any layout);
    ``init_value_head``: a critic that takes a causal LM's trunk and keeps its value head's
    init; ``hf_files``: the HF config source each checkpoint copies into ``huggingface/``."""

    args: ModelArgs
    hf: str | Mapping[str, Tensor] | None
    mcore_dir: str | None
    init_value_head: bool
    hf_files: Any

    def load_into(self, engine) -> None:
        """Loads ``mcore_dir`` into ``engine`` (collective); HF starts are loaded at build time."""
        if self.mcore_dir is not None:
            load_model_dir(self.mcore_dir, engine, init_value_head=self.init_value_head)


def _model_dir_role(path: str, key: str) -> str | None:
    """The role recorded in a model directory's mcore_rl.json; None for a HF directory."""
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is not a directory; pass a HF model directory or a model "
                          "directory written by converters/hf_to_mcore.py (or a checkpoint's global_step_N/actor).")
    meta = os.path.join(path, META)
    if os.path.isfile(meta):
        with open(meta) as f:
            return json.load(f).get("role")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={path!r} holds neither {META} (a model directory) nor config.json (a HF "
                          "model); a checkpoint step holds one model directory per role: pass .../actor.")
    return None


def actor_start(hf_dir: str | None, mcore_dir: str | None,
                tiny: tuple[ModelArgs, Mapping[str, Tensor], Any] | None) -> Start:
    """The actor's (and the reference's) start: ``mcore_dir`` (role actor), ``hf_dir``, or
    ``tiny`` = (args, HF tensors, HF config) of the embedded model."""
    if hf_dir and mcore_dir:
        raise ConfigError(f"model.hf_dir={hf_dir!r} and model.mcore_dir={mcore_dir!r} are both set; "
                          "the actor starts from one of them: drop the other.")
    if mcore_dir:
        role = _model_dir_role(mcore_dir, "model.mcore_dir")
        if role != "actor":
            raise ConfigError(f"model.mcore_dir={mcore_dir!r} holds {f'role {role!r}' if role else 'a HF model'}"
                              "; it must be an actor model directory (a HF model goes in model.hf_dir, "
                              "a critic in model.critic_dir).")
        hf_files = layout_of(mcore_dir).hf_dir(mcore_dir)
        return Start(model_args_from_hf(hf_files), None, mcore_dir, False, hf_files)
    if hf_dir:
        if _model_dir_role(hf_dir, "model.hf_dir") is not None:
            raise ConfigError(f"model.hf_dir={hf_dir!r} is a model directory ({META}); pass it as model.mcore_dir.")
        return Start(model_args_from_hf(hf_dir), hf_dir, None, False, hf_dir)
    args, tensors, config = tiny
    return Start(args, tensors, None, False, config)


def critic_start(critic_dir: str | None, actor: Start) -> Start:
    """The critic's start: from the actor's start with a fresh value head when ``critic_dir`` is
    None; else from ``critic_dir``: a model directory (role critic: value head loaded; role actor:
    fresh value head) or a HF directory (*ForCausalLM: fresh value head; *ForTokenClassification
    or *ForSequenceClassification: its score head loaded)."""
    if critic_dir is None:
        return Start(actor.args, actor.hf, actor.mcore_dir, True, actor.hf_files)
    role = _model_dir_role(critic_dir, "model.critic_dir")
    if role is not None:
        hf_files = layout_of(critic_dir).hf_dir(critic_dir)
        return Start(model_args_from_hf(hf_files), None, critic_dir, role == "actor", hf_files)
    from mcore_rl.conversion.convert import role_from_config

    head_from_lm = role_from_config(critic_dir) == "actor"
    return Start(model_args_from_hf(critic_dir), critic_dir, None, head_from_lm, critic_dir)
