"""Small collectives of the checkpoint code (bytes and flags over torch.distributed, no pickling)
and ``agreed``: the rule that a refusal on one rank is a refusal on every rank.

A save or load is a sequence of steps; some run on a few ranks only (rank 0 writes the marker,
each node's leader removes a torn step). If such a step fails on one rank and the others walk on
into the next collective, they wait forever. ``agreed(action, what)`` runs the step, then every
rank learns every rank's error and raises the same ``CheckpointError``.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.safe_load import UnsafeCheckpointError

T = TypeVar("T")
_MAX_ERROR = 4000  # characters of one rank's error carried to the others
_UNSAFE = "\x00unsafe\x00"  # marks a refused pickle global: every rank raises UnsafeCheckpointError


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def comm_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and the CPU platform) only CPU ones
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Collective: every rank's ``payload``, indexed by global rank (no pickling)."""
    if not distributed():
        return [payload]
    dev = comm_device()
    world = torch.distributed.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(world)]
    torch.distributed.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)  # host: filled from bytes, then sent on dev
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty_like(buf, device=dev) for _ in range(world)]
    torch.distributed.all_gather(bufs, buf.to(dev))
    return [bytes(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]


def any_rank(flags: list[int]) -> list[int]:
    """Collective: element-wise max of ``flags`` over all ranks."""
    if not distributed():
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int64, device=comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.cpu()]


class PendingMax:
    """Collective, non-blocking: the element-wise max of ``flags`` over the ranks of ``group``
    (a gloo group: the flags stay in host memory, no device stream waits), sent at construction,
    read by ``result()``, which waits only for ranks that have not sent theirs yet."""

    def __init__(self, flags: list[int], group=None) -> None:
        self._flags = torch.tensor(flags, dtype=torch.int64)  # host: reduced on the gloo host group
        self._work = (torch.distributed.all_reduce(self._flags, op=torch.distributed.ReduceOp.MAX,
                                                   group=group, async_op=True) if distributed() else None)

    def result(self) -> list[int]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return [int(v) for v in self._flags]


def host_group():
    """A process group over every rank that reduces host tensors: the default group when its
    backend has gloo, else a new gloo group (collective, the same order on every rank)."""
    if not distributed() or "gloo" in str(torch.distributed.get_backend()):
        return None
    return torch.distributed.new_group(backend="gloo")


def all_ranks_ok(ok: bool) -> bool:
    """Collective: True when ``ok`` holds on every rank."""
    return any_rank([0 if ok else 1]) == [0]


def gather_errors(error: str | None) -> dict[int, str]:
    """Collective: rank -> error text of every rank that reports one (one flag all-reduce when
    no rank does, the texts only when some rank failed)."""
    if not any_rank([1 if error else 0])[0]:
        return {}
    texts = all_gather_bytes((error or "")[:_MAX_ERROR].encode())
    return {r: t.decode(errors="replace") for r, t in enumerate(texts) if t}


def raise_if_any(errors: dict[int, str], what: str, cause: BaseException | None = None) -> None:
    """Raises the one CheckpointError every rank raises for ``errors`` (rank -> text)."""
    if not errors:
        return
    first = min(errors)
    if errors[first].startswith(_UNSAFE):
        source, refused = errors[first][len(_UNSAFE):].split("\x00", 1)
        raise UnsafeCheckpointError(source, refused) from cause
    others = f" (also failed on ranks {sorted(errors)[1:]})" if len(errors) > 1 else ""
    raise CheckpointError(f"{what} failed on rank {first}{others}: {errors[first]}") from cause


def agreed(action: Callable[[], T] | None, what: str) -> T | None:
    """Collective: runs ``action`` on this rank (``None``: nothing to do here); when it raised on
    any rank, every rank raises one CheckpointError naming the failed ranks and the first error
    (the save or load is refused everywhere, nobody is left waiting). Returns the action's value."""
    result, error, cause = None, None, None
    try:
        if action is not None:
            result = action()
    except Exception as e:  # noqa: BLE001 - every error is carried to every rank
        error, cause = describe(e), e
    raise_if_any(gather_errors(error), what, cause)
    return result


def describe(e: BaseException) -> str:
    """An error as carried to the other ranks (a refused pickle keeps its kind)."""
    if isinstance(e, UnsafeCheckpointError):
        return f"{_UNSAFE}{e.source}\x00{e.refused}"
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
