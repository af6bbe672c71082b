"""verl's model.mtp section (its own MtpConfig dataclass, or a mapping) read as mcore_rl's
MtpConfig: the switches carried over, the rollout engines' keys left alone, a bad value refused
with the section named."""
from __future__ import annotations

import pytest
from verl.workers.config.model import MtpConfig as VerlMtpConfig

from mcore_rl.integrations.verl.engine_config import VerlConfigError
from mcore_rl.integrations.verl.verl_mtp import mtp_config
from mcore_rl.models.mtp import MtpConfig


def test_verl_mtp_section_is_read():
    verl = VerlMtpConfig(enable=True, enable_train=True, detach_encoder=True, mtp_loss_scaling_factor=0.25,
                         speculative_num_steps=5)
    assert mtp_config({"mtp": verl}) == MtpConfig(True, True, False, True, 0.25)
    assert mtp_config({"mtp": {"enable": True, "method": "mtp"}}) == MtpConfig(enable=True)
    assert mtp_config({}) == MtpConfig(enable=False)  # verl's default: MTP layers left out
    assert mtp_config({"mtp": VerlMtpConfig()}).enable is False
    with pytest.raises(VerlConfigError, match=r"^model\.mtp\.mtp_loss_scaling_factor=-1"):
        mtp_config({"mtp": {"enable": True, "mtp_loss_scaling_factor": -1}})
    with pytest.raises(VerlConfigError, match=r"model\.mtp\.enable_train=true with mtp\.enable=false"):
        mtp_config({"mtp": VerlMtpConfig(enable=False, enable_train=True)})
