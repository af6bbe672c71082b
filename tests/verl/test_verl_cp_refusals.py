"""Combinations the verl engine refuses at context parallelism > 1 that depend on the model (no
processes): MTP training and Gated DeltaNet layers, each error naming both settings. Router
replay at CP > 1 is refused by the engine config (test_verl_config.REFUSED_KEYS)."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")

from mcore_rl.integrations.verl.engine_config import VerlConfigError  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402


def test_context_parallel_with_mtp_training_is_refused(tmp_path):
    """model.mtp.enable_train at CP > 1: refused by the engine before any process group is used,
    naming both settings; MTP layers built but not trained pass that check."""
    from verl.workers.config import HFModelConfig
    from verl.workers.config.model import MtpConfig as VerlMtpConfig

    from mcore_rl.integrations.verl.config import McoreRLEngineConfig
    from mcore_rl.integrations.verl.engine import McoreRLEngineWithLMHead, check_context_parallel
    from mcore_rl.models.mtp import MtpConfig

    model = HFModelConfig(path=save_tiny_model(str(tmp_path / "model")),
                          mtp=VerlMtpConfig(enable=True, enable_train=True))
    with pytest.raises(VerlConfigError, match=r"model\.mtp\.enable_train=True with engine\.context_parallel_size=2"):
        McoreRLEngineWithLMHead(model, McoreRLEngineConfig(context_parallel_size=2), None, None)
    check_context_parallel(2, MtpConfig(enable=True, enable_train=False))
    check_context_parallel(1, MtpConfig(enable=True, enable_train=True))


def test_context_parallel_with_gated_deltanet_layers_is_refused():
    """A hybrid model (Gated DeltaNet layers) at CP > 1, from its HF config: refused naming the
    CP size and the model type; its CP=1 and a plain llama at CP=2 pass."""
    from mcore_rl.integrations.verl.engine import check_context_parallel
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.mtp import MtpConfig
    from tests.hybrid_bodies import HYBRID
    from tests.tiny import tiny_config

    hybrid = model_args_from_hf(tiny_config("qwen3_5_text", **HYBRID))
    refused = r"engine\.context_parallel_size=2 with qwen3_5_text's Gated DeltaNet layers"
    with pytest.raises(VerlConfigError, match=refused):
        check_context_parallel(2, MtpConfig(enable=False), hybrid)
    check_context_parallel(1, MtpConfig(enable=False), hybrid)
    check_context_parallel(2, MtpConfig(enable=False), model_args_from_hf(tiny_config("llama")))
