"""Typed schema of the main job's YAML configs (configs/*.yaml); loaded by mcore_rl.config_loader."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.job.toy_task import ToyTaskConfig
from mcore_rl.rl.actor import ActorConfig
from mcore_rl.rl.critic import CriticConfig
from mcore_rl.rl.engine import OptimConfig


@dataclass(frozen=True)
class TinyModelConfig:
    """A HF config built in memory (nothing downloaded) and randomly initialised with ``seed``."""

    model_type: str = "llama"
    vocab_size: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """``hf_dir``: a HF model directory to start from; otherwise the embedded tiny model."""

    hf_dir: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass(frozen=True)
class LayoutConfig:
    """Parallel sizes of the actor (and critic); DP is what is left of the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    """Samples per step = prompts_per_step * samples_per_prompt."""

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0


@dataclass(frozen=True)
class AlgorithmConfig:
    """GRPO (group-normalised rewards) or PPO (critic + GAE); optional KL penalty on rewards."""

    name: Literal["grpo", "ppo"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    kl_in_reward_coeff: float = 0.0


@dataclass(frozen=True)
class JobConfig:
    """The whole job."""

    steps: int = 40
    seed: int = 1
    output_dir: str = "outputs/grpo_demo"
    progress_bar: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    task: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    critic: CriticConfig = field(default_factory=CriticConfig)
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
