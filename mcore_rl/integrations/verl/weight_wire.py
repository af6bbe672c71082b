"""The wire of mcore_rl's checkpoint engine: one weight version from trainer rank 0 to every
receiver over a private process group (its own TCPStore; never the trainer's default group).

A version is, in order (every step a collective over the group):

1. *hello*: an all-reduce (MIN) of ``[token, -token]``: every receiver's current version token (0:
   none known), so the sender learns whether all receivers hold the version it last completed
   (a delta needs that);
2. *buckets*: each a header broadcast (int64 ``[kind, meta_bytes, payload_bytes]``) and a body
   broadcast (uint8: JSON meta ``[[name, dtype, shape, offset, nbytes], ...]`` then the tensors'
   bytes), at most ``bucket_bytes`` of tensors (a larger tensor alone);
3. *manifest*: one more header + body, the JSON ``{token, base, names, checksums, sent, peft}``
   (every tensor name of the version in order, the checksum of each, the names this version
   sent; ``base``: the token the unsent ones are kept from, 0 for a full version; ``peft``: the
   PEFT config when the version carries LoRA adapter factors under PEFT names, else null);
4. *ack*: an all-reduce (MIN) of 1 (accepted) or 0 from every receiver; a version counts only
   when every receiver accepted it (each receiver applies it only then).

A receiver refuses a repeated, missing or extra tensor, a checksum that differs from the
manifest's, or a delta whose base it does not hold; it keeps reading to the manifest (so the
sender is not left blocked) and acks 0. A sender whose export fails mid-version sends an
*abort* message (kind 3, the reason) instead of the manifest, so the receivers fail at once; a
sender that dies mid-version makes the receivers' next collective fail (or time out after
``timeout_s``). Either way they drop what they staged.
"""
from __future__ import annotations

import datetime
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from mcore_rl.errors import McoreRLError
from mcore_rl.fileio.checksum import checksum

BUCKET, MANIFEST, ABORT = 1, 2, 3
ALIGN = 64  # bytes: every tensor starts at a multiple (a dtype view needs its alignment)
_BIG = torch.iinfo(torch.int64).max
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
TRANSPORTS = ("gloo", "nccl")


class WeightSyncError(McoreRLError, ValueError):
    """A weight version refused or cut off; names the tensor or value and the fix."""


@dataclass(frozen=True)
class Link:
    """How one member joins one version's group (picklable: handed to rollout servers).
    ``rank`` 0 is the sender; ``prefix`` keeps versions apart on one store."""

    host: str
    port: int
    rank: int
    world_size: int
    prefix: str
    timeout_s: float = 600.0
    transport: str = "gloo"


@dataclass
class Version:
    """A received, checked version: ``tensors`` the ones sent (name -> tensor, as sent),
    ``checksums`` of every tensor of the version, ``names`` in the sender's order."""

    token: int
    base: int
    names: list[str]
    checksums: dict[str, str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    peft: dict[str, Any] | None = None


def tensor_checksum(tensor: torch.Tensor) -> str:
    """XXH3-128 of a tensor's bytes, with its dtype and shape (a changed dtype or shape differs)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{checksum(data)}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}"


def open_group(link: Link, store: dist.Store | None = None) -> dist.ProcessGroup:
    """The version's group: a ProcessGroupGloo (or NCCL) on a PrefixStore of the sender's
    TCPStore (``store`` on the sender, a client connection elsewhere)."""
    timeout = datetime.timedelta(seconds=link.timeout_s)
    if store is None:
        store = dist.TCPStore(link.host, link.port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"mcore_rl_ce/{link.prefix}", store)
    if link.transport == "gloo":
        return dist.ProcessGroupGloo(prefixed, link.rank, link.world_size, timeout)
    if link.transport == "nccl":  # written for GPUs; not run on this CPU-only project's tests
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, link.rank, link.world_size, options)
    raise WeightSyncError(f"checkpoint_engine.engine_kwargs.mcore_rl.transport={link.transport!r}; use one of "
                          f"{list(TRANSPORTS)}.")


def _device(link: Link) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if link.transport == "nccl" else torch.device("cpu")


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


def _all_reduce_min(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([tensor], options).wait()
    return tensor


def _plain(value: Any) -> Any:
    """JSON for what a PEFT config holds besides JSON types (sets of module names)."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _send(group: dist.ProcessGroup, device: torch.device, kind: int, meta: Any,
          tensors: list[tuple[int, torch.Tensor]]) -> int:
    """One message: header then body (meta JSON padded to ``ALIGN`` bytes, then each tensor's
    bytes at its offset). Returns the body's size."""
    meta_bytes = json.dumps(meta, default=_plain).encode()
    meta_bytes += b" " * (_aligned(len(meta_bytes)) - len(meta_bytes))
    payload = max((offset + t.nbytes for offset, t in tensors), default=0)
    body = torch.zeros(len(meta_bytes) + payload, dtype=torch.uint8, device=device)
    body[:len(meta_bytes)].copy_(torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8))
    for offset, t in tensors:
        start = len(meta_bytes) + offset
        body[start:start + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    _broadcast(group, torch.tensor([kind, len(meta_bytes), payload], dtype=torch.int64, device=device))
    _broadcast(group, body)
    return body.numel()


def _receive(group: dist.ProcessGroup, device: torch.device) -> tuple[int, Any, torch.Tensor]:
    """(kind, meta, payload bytes on the CPU) of the next message."""
    header = torch.empty(3, dtype=torch.int64, device=device)
    _broadcast(group, header)
    kind, meta_len, payload_len = (int(v) for v in header.cpu())
    body = torch.empty(meta_len + payload_len, dtype=torch.uint8, device=device)
    _broadcast(group, body)
    body = body.cpu()
    return kind, json.loads(bytes(body[:meta_len].numpy())), body[meta_len:]


class Sender:
    """Trainer rank 0's side; keeps the last version every receiver accepted (for deltas)."""

    def __init__(self, bucket_bytes: int, delta: bool = False) -> None:
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.delta = delta
        self.last: tuple[int, dict[str, str]] | None = None  # (token, checksums) of the last accepted version

    def send(self, group: dist.ProcessGroup, link: Link, weights: Iterable[tuple[str, torch.Tensor]],
             peft_config: dict[str, Any] | None = None) -> dict[str, float]:
        """Streams one version of ``weights`` ((name, full tensor) pairs; with ``peft_config``
        LoRA factors under PEFT names may be among them); returns verl's sync metrics (bytes and
        tensors sent, seconds). Raises WeightSyncError when a receiver refused."""
        start, device = time.perf_counter(), _device(link)
        hello = _all_reduce_min(group, torch.tensor([_BIG, _BIG], dtype=torch.int64, device=device)).cpu()
        low, high = int(hello[0]), -int(hello[1])
        base = self.last if self.delta and self.last is not None and low == high == self.last[0] else None
        token = secrets.randbits(62) | 1
        try:
            names, sums, sent, wire, payload = self._stream(group, device, weights, base)
        except Exception as e:  # the export (or its check) failed: tell the receivers, then fail here
            try:
                _send(group, device, ABORT, {"reason": f"{type(e).__name__}: {e}"}, [])
            except Exception:  # noqa: BLE001 - the group itself broke: the receivers' collective fails too
                pass
            raise
        manifest = {"token": token, "base": base[0] if base else 0, "names": names, "checksums": sums, "sent": sent,
                    "peft": peft_config}
        wire += _send(group, device, MANIFEST, manifest, [])
        accepted = int(_all_reduce_min(group, torch.ones(1, dtype=torch.int64, device=device)).cpu()[0])
        self.last = (token, sums) if accepted else None
        if not accepted:
            raise WeightSyncError(f"a rollout receiver refused weight version {token} ({len(sent)} tensors sent; see "
                                  "the rollout's log for the tensor); the next sync sends every tensor.")
        return {"checkpoint_engine/bytes_sent": float(wire), "checkpoint_engine/tensor_bytes_sent": float(payload),
                "checkpoint_engine/tensors_sent": float(len(sent)), "checkpoint_engine/tensors_total": float(len(names)),
                "checkpoint_engine/delta": float(base is not None),
                "checkpoint_engine/seconds": time.perf_counter() - start}

    def _stream(self, group: dist.ProcessGroup, device: torch.device, weights: Iterable[tuple[str, torch.Tensor]],
                base: tuple[int, dict[str, str]] | None) -> tuple[list[str], dict[str, str], list[str], int, int]:
        """Sends the version's buckets (with ``base``: only tensors whose checksum moved); returns
        (names, checksums, names sent, wire bytes, tensor bytes)."""
        names, sums, sent, wire, payload = [], {}, [], 0, 0
        bucket, meta, size = [], [], 0
        for name, tensor in weights:
            if name in sums:
                raise WeightSyncError(f"the trainer's export yielded tensor {name!r} twice in one version; the export "
                                      "must yield each tensor once.")
            t = tensor.detach().contiguous()
            sums[name] = tensor_checksum(t)
            names.append(name)
            if base is not None and base[1].get(name) == sums[name]:
                continue  # unchanged since the version every receiver holds
            if bucket and size + t.nbytes > self.bucket_bytes:
                wire += _send(group, device, BUCKET, meta, bucket)
                bucket, meta, size = [], [], 0
            meta.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), size, t.nbytes])
            bucket.append((size, t))
            size = _aligned(size + t.nbytes)
            sent.append(name)
            payload += t.nbytes
        if bucket:
            wire += _send(group, device, BUCKET, meta, bucket)
        return names, sums, sent, wire, payload


def receive(group: dist.ProcessGroup, link: Link, known: tuple[int, dict[str, str]] | None,
            check: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
            check_names: Callable[[list[str]], None] | None = None) -> Version:
    """A receiver's side of one version. ``known``: (token, checksums) of the version it holds
    (None: none), ``check(name, tensor)`` returns the tensor as the receiver keeps it (a cast)
    or raises naming it; ``check_names(names)`` refuses a version's set of names. Raises
    WeightSyncError (after acking 0) when the version is refused, or the transport's error."""
    device = _device(link)
    token = known[0] if known else 0
    _all_reduce_min(group, torch.tensor([token, -token], dtype=torch.int64, device=device))
    tensors: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    nbytes = 0
    while True:
        kind, meta, payload = _receive(group, device)
        if kind == ABORT:
            raise WeightSyncError(f"the trainer abandoned the weight version it was sending ({meta['reason']}); "
                                  "nothing of it is applied, the previous version stays served.")
        if kind == MANIFEST:
            break
        nbytes += payload.numel()
        for name, dtype, shape, offset, size in meta:
            if name in tensors:
                errors.append(f"tensor {name!r} arrived twice in one version")
                continue
            t = payload[offset:offset + size].view(DTYPES[dtype]).view(shape)
            tensors[name] = t
    version = Version(int(meta["token"]), int(meta["base"]), list(meta["names"]), dict(meta["checksums"]), {}, nbytes,
                      meta.get("peft"))
    errors += _check_version(version, meta["sent"], tensors, known)
    if not errors:
        try:
            if check_names is not None:
                check_names(version.names)
            version.tensors = {n: (check(n, t) if check is not None else t) for n, t in tensors.items()}
        except McoreRLError as e:
            errors.append(str(e))
    accepted = int(_all_reduce_min(group, torch.tensor([0 if errors else 1], dtype=torch.int64, device=device))
                   .cpu()[0])
    if errors:
        raise WeightSyncError(f"refused weight version {version.token}: {'; '.join(errors[:4])}"
                              f"{f' (+{len(errors) - 4} more)' if len(errors) > 4 else ''}; the previous version "
                              "stays served. The trainer's export and the engine must send each tensor once.")
    if not accepted:
        raise WeightSyncError(f"weight version {version.token} was refused by another rollout receiver; the previous "
                              "version stays served (see that receiver's log).")
    return version


def _check_version(version: Version, sent: list[str], received: dict[str, torch.Tensor],
                   known: tuple[int, dict[str, str]] | None) -> list[str]:
    """What is wrong with a version's tensors against its manifest (empty: nothing)."""
    errors = []
    missing = [n for n in sent if n not in received]
    extra = sorted(set(received) - set(sent))
    if missing:
        errors.append(f"{len(missing)} tensors of the manifest never arrived (e.g. {missing[:3]})")
    if extra:
        errors.append(f"{len(extra)} tensors arrived that the manifest does not list (e.g. {extra[:3]})")
    if len(set(version.names)) != len(version.names) or not set(sent) <= set(version.names):
        errors.append("the manifest lists a tensor twice or sends one it does not name")
    bad = [n for n, t in received.items() if n in version.checksums and tensor_checksum(t) != version.checksums[n]]
    if bad:
        errors.append(f"{len(bad)} tensors differ from the manifest's checksum (e.g. {bad[:3]})")
    kept = [n for n in version.names if n not in set(sent)]
    if kept:
        if known is None or version.base != known[0]:
            errors.append(f"a delta against version {version.base} but this receiver holds "
                          f"{known[0] if known else 'none'} ({len(kept)} tensors not sent, e.g. {kept[:3]})")
        else:
            stale = [n for n in kept if known[1].get(n) != version.checksums.get(n)]
            if stale:
                errors.append(f"{len(stale)} tensors not sent differ from the ones held (e.g. {stale[:3]})")
    return errors


def drain(weights: Iterable[Any]) -> None:
    """Runs a collective export generator to its end (a trainer rank that sends nothing)."""
    for _ in weights:
        pass


def iter_version(version: Version) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a version sent, in the sender's order."""
    return ((n, version.tensors[n]) for n in version.names if n in version.tensors)
