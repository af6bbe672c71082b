"""Shared set-up for the benchmark scripts (run them with torchrun, see each script)."""
from __future__ import annotations

import torch

from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
from mcore_rl.platform import init_distributed, setup_platform


def start(layout: ParallelLayout):
    """Platform, process group, megatron parallel state; returns the platform."""
    platform = setup_platform()
    init_distributed(platform)
    torch.set_num_threads(1)
    initialize_parallel_state(layout, seed=1)
    return platform


def tiny_llama(vocab_size: int, layers: int = 2, hidden: int = 128, max_positions: int = 512):
    """ModelArgs and HF-named random weights of a llama built from a config."""
    from mcore_rl.job.loop import tiny_model
    from mcore_rl.job.schema import TinyModelConfig

    return tiny_model(TinyModelConfig(vocab_size=vocab_size, hidden_size=hidden,
                                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      max_position_embeddings=max_positions))


def rank0_print(*args) -> None:
    if torch.distributed.get_rank() == 0:
        print(*args, flush=True)
