"""Reading megatron dist-checkpoints without running code planted in them.

Where megatron-core 0.16.1 (torch_dist format) and torch.distributed.checkpoint unpickle:

- ``.metadata``: ``FileSystemReader.read_metadata`` calls ``pickle.load`` (plain pickle of
  torch.distributed.checkpoint's metadata dataclasses). Used by every ``dist_checkpointing.load``,
  ``load_tensors_metadata``, ``load_sharded_metadata`` and ``load_plain_tensors``.
- ShardedObject payloads (RNG state, ``_extra_state``, dp_reshardable optimizer metadata) are
  BYTE_IO items inside ``.distcp`` files, read by ``DefaultLoadPlanner.load_bytes`` with
  ``torch.load(weights_only=False)``.
- ``common.pt`` (``TorchCommonLoadStrategy.load_common``) and per-object ``.pt`` files
  (``load_sharded_objects``) use ``torch.load`` without ``weights_only``: safe by torch >= 2.6's
  default unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set.
- ``metadata.json`` is JSON; tensor items of ``.distcp`` files are already read with
  ``weights_only=True`` by ``FileSystemReader.read_data``.

``restricted_unpickling()`` routes all of these through allowlists for the duration of a load:
the ``.metadata`` pickle through ``RestrictedUnpickler`` (explicit class allowlist), every
``torch.load`` through torch's own weights_only unpickler (forced, so the environment variable
cannot turn it off) with nothing admitted beyond torch's own allowlist (``SAFE_TORCH_GLOBALS`` is
empty: mcore_rl's RNG payloads hold tensors and plain values, no numpy objects).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
from typing import Any, Iterator

import torch

from mcore_rl.errors import McoreRLError


class UnsafeCheckpointError(McoreRLError, pickle.UnpicklingError):
    """A checkpoint file needs a Python global outside the allowlist; nothing of it was run."""

    def __init__(self, source: str, refused: str) -> None:
        self.source, self.refused = source, refused
        super().__init__(
            f"refused to load {source}: it needs the Python global {refused!r}, which is not on "
            "the allowlist of classes a megatron dist-checkpoint contains. The checkpoint may be "
            "malicious; the refused code was not run. If the checkpoint comes from a trusted "
            "writer and the class is legitimate, add it to mcore_rl.fileio.safe_load's "
            "allowlist (METADATA_GLOBALS or SAFE_TORCH_GLOBALS)."
        )


    def __reduce__(self):  # crosses ranks inside torch's CheckpointException
        return (type(self), (self.source, self.refused))


def _refusal(source: str, refused: str) -> UnsafeCheckpointError:
    """The error for a refused global, remembered so the guard re-raises it however megatron or
    torch wrap (or stringify) it on the way out."""
    error = UnsafeCheckpointError(source, refused)
    _local.refusals = getattr(_local, "refusals", []) + [error]
    return error


def _torch_dtype_globals() -> set[str]:
    return {f"torch.{n}" for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


_DCP = "torch.distributed.checkpoint"
# the classes a torch_dist ``.metadata`` holds (read off real checkpoints of megatron 0.16.1)
METADATA_GLOBALS: frozenset[str] = frozenset(
    {
        "torch.Size",
        "torch.serialization._get_layout",
        f"{_DCP}.filesystem._StorageInfo",
        *(f"{_DCP}.metadata.{n}" for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
        )),
        *(f"{_DCP}.planner.{n}" for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
        "collections.OrderedDict",
        *_torch_dtype_globals(),
    }
)
# beyond torch's weights_only defaults: nothing. Every pickled part mcore_rl writes holds tensors,
# strings, numbers and containers; an admitted class is attack surface no file needs.
SAFE_TORCH_GLOBALS: list[Any] = []


def _registered_by_torch(entry: Any) -> bool:
    obj = entry[0] if isinstance(entry, tuple) else entry
    return (getattr(obj, "__module__", "") or "").split(".")[0] == "torch"


@contextlib.contextmanager
def torch_globals_only() -> Iterator[None]:
    """torch's weights_only allowlist cut to torch's own entries (+ ``SAFE_TORCH_GLOBALS``) for
    the block: megatron-core registers numpy, pathlib, argparse, BytesIO and its config classes
    process-wide when it is imported, none of which a checkpoint of mcore_rl needs. The full
    list is restored on exit."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in saved if _registered_by_torch(g)] + SAFE_TORCH_GLOBALS)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only globals in ``allowed`` ("module.qualname");
    anything else raises ``UnsafeCheckpointError`` before the global is even imported."""

    def __init__(self, file, *, source: str = "<pickle stream>",
                 allowed: frozenset[str] = METADATA_GLOBALS, **kwargs) -> None:
        super().__init__(file, **kwargs)
        self.source, self.allowed = source, allowed

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in self.allowed:
            raise _refusal(self.source, f"{module}.{name}")
        return super().find_class(module, name)


def restricted_pickle_load(file, source: str | None = None) -> Any:
    """Unpickles a plain pickle stream (e.g. ``.metadata``) through ``RestrictedUnpickler``."""
    return RestrictedUnpickler(file, source=source or str(getattr(file, "name", "<pickle stream>"))).load()


class _RestrictedPickleModule:
    """Stands in for the ``pickle`` module inside torch.distributed.checkpoint.filesystem:
    loads are restricted, everything else (``dump`` for writers) is the real module."""

    Unpickler = RestrictedUnpickler

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs) -> Any:
        return restricted_pickle_load(file)

    @staticmethod
    def loads(data: bytes, **kwargs) -> Any:
        return restricted_pickle_load(io.BytesIO(data), source="<pickle bytes>")


_local = threading.local()  # what is being read (names the file in errors)
_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


def _source_of(f) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    return getattr(_local, "source", None) or str(getattr(f, "name", "<in-memory torch.save payload>"))


def _make_safe_torch_load(original_load):
    def safe_torch_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
        """torch.load forced to weights_only=True (explicit, so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
        cannot override it) with the RNG-state numpy classes admitted."""
        source = _source_of(f)
        if pickle_module is not None:
            raise _refusal(source, f"pickle_module={getattr(pickle_module, '__name__', pickle_module)}")
        try:  # inside restricted_unpickling: torch's allowlist is already cut to torch's own entries
            return original_load(f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise _unpickling_error(e, source) from None

    safe_torch_load.__wrapped__ = original_load
    return safe_torch_load


class DamagedPickleError(McoreRLError, pickle.UnpicklingError):
    """A pickled checkpoint part that cannot be read (truncated, corrupt); nothing of it ran."""


def _unpickling_error(e: Exception, source: str) -> Exception:
    """A failed weights_only load: a refused global is UnsafeCheckpointError; anything else (a
    truncated or corrupt payload, torch's zip reader failing) is damage, not malice."""
    found = _REFUSED.search(str(e)) if isinstance(e, pickle.UnpicklingError) else None
    if found:
        return _refusal(source, found.group(1))
    first = (str(e).strip().splitlines() or ["unreadable"])[0]
    return DamagedPickleError(f"{source} cannot be read ({type(e).__name__}: {first[:200]}); the file is "
                              "damaged or truncated: restore it, or load another checkpoint.")


def load_payload(data: bytes, source: str) -> Any:
    """A ShardedObject payload (``torch.save`` bytes) through torch's weights_only unpickler:
    a refused global is UnsafeCheckpointError naming ``source``, damage DamagedPickleError."""
    try:
        with _lock, torch_globals_only():  # the original, not a patched torch.load
            return torch.serialization.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise _unpickling_error(e, source) from None


def _make_read_data(original):
    def read_data(self, plan, planner):
        _local.reader = self  # load_bytes below names the .distcp file it reads from
        try:
            return original(self, plan, planner)
        finally:
            _local.reader = None

    return read_data


def _make_load_bytes(original):
    def load_bytes(self, read_item, value):
        reader = getattr(_local, "reader", None)
        info = getattr(reader, "storage_data", {}).get(read_item.storage_index)
        where = os.path.join(str(reader.path), info.relative_path) if info is not None else "a .distcp file"
        previous, _local.source = getattr(_local, "source", None), (
            f"ShardedObject payload {read_item.storage_index.fqn!r} in {where}"
        )
        try:
            return original(self, read_item, value)
        finally:
            _local.source = previous

    return load_bytes


class CheckpointReadError(McoreRLError, RuntimeError):
    """Restricted unpickling cannot be guaranteed for this read path."""


_MESSAGE = re.compile(r"refused to load (.+?): it needs the Python global '([^']+)'")


def _find_unsafe(exc: BaseException | None, seen: set[int]) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError inside exceptions that megatron or torch wrapped it in
    (``__cause__``/``__context__`` chains, torch's ``CheckpointException.failures`` per rank,
    or only its message: torch re-raises a failed metadata read as AssertionError(str))."""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UnsafeCheckpointError):
            return exc
        for failure in (getattr(exc, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            found = _find_unsafe(inner if isinstance(inner, BaseException) else None, seen)
            if found is not None:
                return found
        message = _MESSAGE.search(str(exc))
        if message:
            return UnsafeCheckpointError(*message.groups())
        exc = exc.__cause__ or exc.__context__
    return None


def _patches() -> list[tuple[Any, str, Any]]:
    from torch.distributed.checkpoint import default_planner, filesystem

    return [
        (torch, "load", _make_safe_torch_load(torch.load)),
        (filesystem, "pickle", _RestrictedPickleModule()),
        (filesystem.FileSystemReader, "read_data", _make_read_data(filesystem.FileSystemReader.read_data)),
        (default_planner.DefaultLoadPlanner, "load_bytes",
         _make_load_bytes(default_planner.DefaultLoadPlanner.load_bytes)),
    ]


_lock = threading.RLock()
_depth = 0
_outer: list = []  # the allowlist cut of the outermost block
_saved: list[tuple[Any, str, Any, bool]] = []


class restricted_unpickling:
    """Context manager: every unpickling done by megatron-core's ``dist_checkpointing.load`` and
    torch.distributed.checkpoint inside the block goes through allowlists; a refused global raises
    ``UnsafeCheckpointError`` (unwrapped from megatron's/torch's wrapping exceptions, on every rank
    that saw it). Patches are process-wide while the outermost block is open (nesting is fine) and
    are all restored on exit.

    Example: ``with restricted_unpickling(): state = dist_checkpointing.load(template, path)``
    """

    def __enter__(self) -> "restricted_unpickling":
        global _depth
        _refuse_unrestricted_readers()
        with _lock:
            if _depth == 0:
                for obj, attr, new in _patches():
                    _saved.append((obj, attr, obj.__dict__.get(attr), attr in obj.__dict__))
                    setattr(obj, attr, new)
                self._globals = torch_globals_only()
                self._globals.__enter__()
                _outer.append(self._globals)
            _depth += 1
        self._refusals_before = len(getattr(_local, "refusals", []))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                _outer.pop().__exit__(None, None, None)
                while _saved:
                    obj, attr, old, had = _saved.pop()
                    if had:
                        setattr(obj, attr, old)
                    else:
                        delattr(obj, attr)
        refusals = getattr(_local, "refusals", [])
        own = refusals[self._refusals_before:]  # refused in this thread inside this block
        _local.refusals = refusals[: self._refusals_before]
        if exc is None:
            return False
        unsafe = own[0] if own else _find_unsafe(exc, set())
        if unsafe is not None and unsafe is not exc:
            raise UnsafeCheckpointError(unsafe.source, unsafe.refused) from exc
        return False


def _refuse_unrestricted_readers() -> None:
    from megatron.core.msc_utils import MultiStorageClientFeature

    if MultiStorageClientFeature.is_enabled():
        raise CheckpointReadError(
            "megatron's multi-storage client is enabled: its msc.torch.load bypasses the "
            "restricted unpickler. Disable it (MultiStorageClientFeature.disable()) before loading."
        )

