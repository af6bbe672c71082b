"""mcore_rl: a Megatron-Core training backend for RL trainers (PPO, GRPO and kin).

Importing mcore_rl changes nothing in torch or megatron-core: call
``mcore_rl.platform.setup_platform()`` in every process that runs model code.
"""

__version__ = "0.1.0"
