"""Parallel layout: one dataclass for TP/PP/VPP/CP/EP/ETP/SP; DP follows from the world size."""
from mcore_rl.parallel.layout import LayoutError, ParallelLayout, destroy_parallel_state, initialize_parallel_state

__all__ = ["LayoutError", "ParallelLayout", "initialize_parallel_state", "destroy_parallel_state"]
