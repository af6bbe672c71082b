"""The one N-rank test helper: runs a function in N gloo processes forked from the test process.

Forking after megatron-core/transformers are imported (conftest does that once) saves ~6 s of
imports per process. Each rank sets up the CPU platform, joins a fresh gloo group through a
FileStore, runs the function and reports its return value or traceback. The first failing rank's
traceback is raised in the test; the other ranks are killed if they hang in a collective.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

_CTX = mp.get_context("fork")


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, out) -> None:
    import torch

    from mcore_rl.platform import init_distributed, setup_platform

    try:
        torch.set_num_threads(1)  # N ranks share 2 cores; more threads only thrash
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        platform = setup_platform("cpu")
        init_distributed(platform, rank, world_size, init_method=f"file://{store_path}")
        result = fn(*args)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # tensors by value; read back with weights_only=True
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:
                pass
        out.close()
        out.join_thread()
        import multiprocessing.util

        multiprocessing.util._run_finalizers(0)  # shut down managers (megatron's dist-ckpt writer queue)
        os._exit(0)  # skip atexit handlers inherited from pytest


def _dead_without_answer(procs, results: dict, errors: dict, out) -> list[int]:
    """Ranks whose process ended without a queued answer (checked again after a short drain:
    an answer put just before exit may still be in the pipe)."""
    dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results and r not in errors]
    while dead:
        try:
            rank, status, payload = out.get(timeout=0.5)
        except queue.Empty:
            break
        (results if status == "ok" else errors)[rank] = payload
        dead = [r for r in dead if r not in results and r not in errors]
    return dead


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout_s: float = 600.0,
              daemon: bool = True) -> list[Any]:
    """Runs ``fn(*args)`` on ranks 0..world_size-1; returns the per-rank return values
    (tensors, numbers, strings and containers of them).

    ``daemon=False`` for bodies that start processes of their own (megatron's torch_dist save
    forks its file writers; daemonic processes may not have children).

    ``fn`` sees torch.distributed initialized (gloo) and the CPU platform active; it sets up
    megatron's parallel state itself (usually via ``initialize_parallel_state``).
    """
    assert 1 <= world_size <= 8, world_size
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        out = _CTX.Queue()
        procs = [
            _CTX.Process(target=_worker, args=(r, world_size, store, fn, args, out), daemon=daemon)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        grace = None  # after a failure, the others get 20 s before they are declared hung
        while len(results) + len(errors) < world_size:
            limit = deadline if grace is None else grace
            if time.monotonic() > limit:
                break
            try:  # short waits: a rank killed by a signal never answers, its exit code tells
                rank, status, payload = out.get(timeout=1.0)
            except queue.Empty:
                for r in _dead_without_answer(procs, results, errors, out):
                    errors[r] = f"rank {r} died with exit code {procs[r].exitcode} and no answer"
            else:
                (results if status == "ok" else errors)[rank] = payload
            if errors and grace is None:
                grace = time.monotonic() + 20.0
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if errors:
            first = min(errors)
            hung = sorted(set(range(world_size)) - set(results) - set(errors))
            raise AssertionError(
                f"rank {first} of {world_size} failed (failed ranks: {sorted(errors)}, "
                f"no answer from: {hung}):\n{errors[first]}"
            )
        if len(results) < world_size:
            missing = sorted(set(range(world_size)) - set(results))
            raise AssertionError(f"ranks {missing} of {world_size} timed out after {timeout_s}s")
        import torch

        return [
            torch.load(io.BytesIO(results[r]), weights_only=True) for r in range(world_size)
        ]
