"""ParallelLayout: the parallel sizes of a job, their validation, and megatron's parallel state."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from mcore_rl.errors import McoreRLError


class LayoutError(McoreRLError, ValueError):
    """A parallel layout that cannot work; the message names every factor and the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes. DP is derived: world_size / (tp * pp * cp).

    tp: tensor parallel; pp: pipeline stages; vpp: virtual stages per pipeline rank (None = off);
    cp: context parallel; ep: expert parallel; etp: expert tensor parallel (None = tp);
    sequence_parallel: split activations along the sequence across TP ranks.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks (validates first)."""
        self.validate(world_size)
        return world_size // self.model_parallel_size()

    def validate(self, world_size: int) -> None:
        """Raises LayoutError naming every factor when the layout cannot run on ``world_size``."""
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be an integer >= 1.")
        for name in ("vpp", "etp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise LayoutError(f"{name}={value!r} must be None or an integer >= 1.")
        mp = self.model_parallel_size()
        if world_size % mp != 0:
            raise LayoutError(
                f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) = {mp} does not divide "
                f"WORLD_SIZE({world_size}); choose sizes whose product divides the world size."
            )
        expert_mp = self.ep * self.expert_tp * self.pp
        if world_size % expert_mp != 0:
            raise LayoutError(
                f"ep({self.ep}) * etp({self.expert_tp}) * pp({self.pp}) = {expert_mp} does not "
                f"divide WORLD_SIZE({world_size}); expert parallel groups must tile the world."
            )
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise LayoutError(
                f"vpp({self.vpp}) needs pp >= 2 (pp={self.pp}); set vpp=None or raise pp."
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "sequence_parallel=True needs tp > 1 (tp=1): it splits activations across TP "
                "ranks; set sequence_parallel=False or raise tp."
            )
        if self.tp > 1 and self.ep > 1 and not self.sequence_parallel:
            raise LayoutError(
                f"tp({self.tp}) with ep({self.ep}) requires sequence_parallel=True "
                "(megatron-core's MoE rule); set sequence_parallel=True."
            )

    def describe(self, world_size: int) -> str:
        """One line for logs: every size including the derived DP."""
        sizes = ", ".join(f"{k}={v}" for k, v in asdict(self).items())
        return f"{sizes}, dp={self.dp(world_size)}, world_size={world_size}"


def initialize_parallel_state(layout: ParallelLayout, seed: int = 1234) -> int:
    """Initializes megatron's parallel groups for ``layout`` and seeds every RNG; returns DP size.

    torch.distributed must already be initialized (``mcore_rl.platform.init_distributed``).
    """
    from megatron.core import parallel_state, tensor_parallel

    world_size = torch.distributed.get_world_size()
    dp = layout.dp(world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dp


def destroy_parallel_state() -> None:
    """Tears down megatron's parallel groups (the process group itself stays)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
