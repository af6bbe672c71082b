"""verl's ``model.mtp`` section (verl 0.9.1 ``workers/config/model.py`` MtpConfig) as mcore_rl's
``MtpConfig``: ``enable`` builds the checkpoint's multi-token-prediction layers (loaded, saved,
sent to the rollout engines; verl's default false leaves them out), ``enable_train`` adds their
loss in the training forward, ``detach_encoder`` and ``mtp_loss_scaling_factor`` as verl's.
``enable_rollout`` and the speculative-decoding keys are the rollout engine's business."""
from __future__ import annotations

import dataclasses
from typing import Any

from mcore_rl.integrations.verl.engine_config import VerlConfigError
from mcore_rl.integrations.verl.verl_lora import _get, _plain
from mcore_rl.models.mtp import MtpConfig, MtpConfigError

OFF = MtpConfig(enable=False)


def mtp_config(model_config: Any, where: str = "model") -> MtpConfig:
    """The ``MtpConfig`` of verl's model config (its ``mtp`` dataclass or mapping); ``where``
    names the section in errors. No ``mtp`` section: MTP layers left out, as verl's default."""
    raw = _get(model_config, "mtp", None)
    if raw is None:
        return OFF
    if dataclasses.is_dataclass(raw):
        values = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)}
    else:
        values = dict(_plain(raw))
    known = {f.name for f in dataclasses.fields(MtpConfig)}
    try:  # verl validates its own keys; ours are read, the rollout engines' left to them
        return MtpConfig(**{k: v for k, v in values.items() if k in known})
    except MtpConfigError as e:
        raise VerlConfigError(f"{where}.{e}") from e
