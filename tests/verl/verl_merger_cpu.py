"""verl's own merger, ``python -m verl.model_merger merge --backend megatron ...``, run on CPU:
``python -m tests.verl.verl_merger_cpu merge --backend megatron --use_cpu_initialization
--local_dir <step>/actor --target_dir OUT``.

The CPU workarounds verl's merger needs, and only those (the merger itself, its argument parsing,
its model, its load and its save are verl's code, unchanged):

1. megatron's ``model_parallel_cuda_manual_seed`` (called by ``MegatronModelMerger.__init__``)
   becomes a no-op: it seeds the CUDA RNG tracker (``torch.cuda.get_rng_state``, absent on a CPU
   build); the seed only matters for an initialisation the merger overwrites with the checkpoint.
2. verl's model initializer asks megatron for the Transformer Engine layer spec
   (``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``); TE is CUDA-only, so
   megatron's local spec is built instead (same checkpoint keys for these dense models: megatron's
   local spec maps its norms onto TE's fused ``layer_norm_weight`` keys).
3. ``--use_cpu_initialization`` (verl's own flag) so the model is built on the CPU.

verl's communication backend and device come from verl's platform layer, which resolves to the
CPU platform mcore_rl registers for verl (gloo, no device to set), as for every verl test here.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import verl.model_merger.megatron_model_merger as merger
    import verl.models.mcore.model_initializer as initializer

    merger.model_parallel_cuda_manual_seed = lambda seed: None  # 1: no CUDA RNG on CPU
    te_spec = initializer.get_gpt_decoder_block_spec

    def local_spec(config, use_transformer_engine: bool = True, **kwargs):  # 2: no TE on CPU
        return te_spec(config, use_transformer_engine=False, **kwargs)

    initializer.get_gpt_decoder_block_spec = local_spec
    from verl.model_merger.__main__ import main as verl_main

    sys.argv = ["verl.model_merger", *argv]
    verl_main()


if __name__ == "__main__":
    main(sys.argv[1:])
