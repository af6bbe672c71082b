"""The identity of the base weights a LoRA engine trains on: recorded in its adapter-only
checkpoints (``mcore_rl.json``) and compared on resume, so adapters never load onto another base.

* a HF directory: ``config.json``'s SHA-256 and, per ``*.safetensors`` / index file, its size,
  its full-content XXH3-128 (``fileio.checksum``: any edited byte differs) and the SHA-256 of
  three 64 KiB samples (start — the header —, middle, end; a whole small file), which records
  written before the full checksum hold alone. The full checksum is one sequential read of each
  file (XXH3 runs above the disk's speed; right after the engine's own load the bytes are in the
  page cache). A record without it (an older version's) is compared on what it holds — sizes and
  samples, which miss an edit between the samples — and ``sampled_only`` names its files so the
  callers warn;
* a model directory: the size and CRC-32 of every file of its megatron checkpoint (``dist_ckpt/``,
  verl's layout: ``model/dist_ckpt/``; named ``dist_ckpt/<file>`` in either layout, so a base is
  the same base in both) from the record that vouches for it (the step's marker or the converter's RECORD: computed when it was
  written, so free here); without a record, sizes and samples as for a HF directory;
* in-memory HF tensors: a SHA-256 of names, dtypes and shapes (and the bytes of a plain dict);
* nothing loaded (the build's random init): ``{"kind": "none"}``.

The path is recorded but not compared: a base moved or copied elsewhere is the same base.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any, Mapping

import torch

from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.checksum import file_checksum
from mcore_rl.fileio.model_layout import MCORE_RL, layout_of

SAMPLE_BYTES = 64 << 10
Identity = dict[str, Any]  # JSON-able


def _sampled_sha256(path: str, size: int) -> str:
    """SHA-256 of the file's bytes when small, else of 64 KiB at its start, middle and end."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            if size <= 3 * SAMPLE_BYTES:
                h.update(f.read())
            else:
                for offset in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                    f.seek(offset)
                    h.update(f.read(SAMPLE_BYTES))
    except OSError as e:
        raise CheckpointError(f"cannot read {path} to identify the base weights ({e.strerror or e}); "
                              "check the base model directory.") from None
    return h.hexdigest()


def _sampled_files(directory: str, names: list[str], full: bool = False) -> dict[str, dict[str, Any]]:
    """name -> size and sampled SHA-256 (``full``: and the XXH3-128 of every byte)."""
    out = {}
    for name in sorted(names):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        out[name] = {"size": size, "sample_sha256": _sampled_sha256(path, size)}
        if full:
            out[name]["checksum"] = _full_checksum(path, size)
    return out


def _full_checksum(path: str, size: int) -> str:
    """XXH3-128 of every byte of the file (``fileio.checksum``'s recorded form)."""
    try:
        read, value = file_checksum(path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} to identify the base weights ({e.strerror or e}); "
                              "check the base model directory.") from None
    if read != size:
        raise CheckpointError(f"{path} changed size while it was read to identify the base weights ({size} -> "
                              f"{read} bytes); the base is being written: wait until it is complete.")
    return value


def hf_dir_identity(path: str | os.PathLike) -> Identity:
    """The identity of a HF model directory (see the module doc)."""
    path = os.path.abspath(os.fspath(path))
    try:
        names = os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"cannot list the base model directory {path} ({e.strerror or e}).") from None
    weights = [n for n in names if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    config = os.path.join(path, "config.json")
    config_sha = _sampled_sha256(config, os.path.getsize(config)) if os.path.isfile(config) else None
    return {"kind": "hf", "path": path, "config_sha256": config_sha, "files": _sampled_files(path, weights, full=True)}


def model_dir_identity(path: str, record_source: str | None,
                       files: Mapping[str, tuple[int, str | None]] | None) -> Identity:
    """The identity of a model directory: ``files`` (rel -> (size, CRC-32)) from the record at
    ``record_source`` that vouches for it; None: sizes and samples of its megatron checkpoint dir."""
    path = os.path.abspath(path)
    layout = layout_of(path)
    if files is not None:
        prefix = layout.dist + "/"
        listed = {MCORE_RL.dist_rel(rel[len(prefix):]): {"size": int(size), "crc32": crc}
                  for rel, (size, crc) in sorted(files.items()) if rel.startswith(prefix)}
        return {"kind": "mcore", "path": path, "record": record_source, "files": listed}
    dist = layout.dist_dir(path)
    names = sorted(os.listdir(dist))
    sampled = _sampled_files(dist, [n for n in names if os.path.isfile(os.path.join(dist, n))])
    return {"kind": "mcore", "path": path, "record": None,
            "files": {MCORE_RL.dist_rel(rel): v for rel, v in sampled.items()}}


def tensors_identity(tensors: Mapping[str, torch.Tensor]) -> Identity:
    """In-memory HF tensors: names, dtypes and shapes; a plain dict's bytes too (in memory
    already, so hashing them reads nothing from disk)."""
    h, content = hashlib.sha256(), isinstance(tensors, dict)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        if content:
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"kind": "tensors", "path": None, "content": content, "sha256": h.hexdigest()}


def no_base_identity() -> Identity:
    """No base weights were loaded: the model's random init."""
    return {"kind": "none", "path": None}


def describe(identity: Identity | None) -> str:
    """One phrase naming the base, for messages."""
    kind = (identity or {}).get("kind")
    if kind == "hf":
        return f"the HF model directory {identity['path']}"
    if kind == "mcore":
        return f"the model directory {identity['path']}"
    if kind == "tensors":
        return "in-memory HF tensors"
    if kind == "none":
        return "the build's random init (no base weights loaded)"
    return f"an unrecorded base ({identity!r})"


_KINDS = {"hf": "a HF directory", "mcore": "a model directory", "tensors": "in-memory tensors",
          "none": "the random init"}
_FIELDS = {"size": "size", "crc32": "CRC-32", "sample_sha256": "sampled bytes", "checksum": "content (XXH3-128)",
           "config_sha256": "config.json",
           "sha256": "names, shapes and bytes", "content": "content hashed"}


def _changed(key: str, old: Any, new: Any) -> str:
    if key in ("size", "crc32", "content"):
        return f"{_FIELDS[key]} {old!r} vs {new!r}"
    return f"other {_FIELDS.get(key, key)}"  # hashes: the digits tell a reader nothing


def differences(saved: Identity, current: Identity) -> list[str]:
    """What differs between two identities (path aside); [] when they name the same base."""
    if saved.get("kind") != current.get("kind"):
        return [f"{_KINDS.get(saved.get('kind'), saved.get('kind'))} vs "
                f"{_KINDS.get(current.get('kind'), current.get('kind'))}"]
    out = []
    for key in sorted((set(saved) | set(current)) - {"path", "files", "record", "kind"}):
        if saved.get(key) != current.get(key):
            out.append(_changed(key, saved.get(key), current.get(key)))
    old, new = saved.get("files") or {}, current.get("files") or {}
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(f"{name} missing")
        elif name not in old:
            out.append(f"{name} not in the saved base")
        else:  # the saved entry's fields (an older record lacks the full checksum: not compared)
            keys = [k for k in sorted(old[name]) if old[name].get(k) != new[name].get(k)]
            if keys:
                out.append(f"{name}: " + ", ".join(_changed(k, old[name].get(k), new[name].get(k)) for k in keys))
    return out


def sampled_only(saved: Identity | None) -> list[str]:
    """The files of a saved HF-directory identity recorded without a full checksum (by an older
    version: sizes and samples only, which miss an edit between the samples); [] otherwise."""
    if (saved or {}).get("kind") != "hf":
        return []
    return sorted(name for name, entry in (saved.get("files") or {}).items() if "checksum" not in entry)


class SampledBaseWarning(McoreRLError, UserWarning):
    """A recorded base identity without full-content checksums (an older version's record)."""


def warn_if_sampled_only(saved: Identity | None, where: str) -> None:
    """Warns (SampledBaseWarning) when ``saved`` has ``sampled_only`` files: the base was
    accepted on sizes and samples alone."""
    names = sampled_only(saved)
    if names:
        warnings.warn(f"{where}: the base identity it records predates full-content checksums: {names[:4]} of "
                      f"{describe(saved)} are compared by size and three 64 KiB samples only, so an edit between "
                      "the samples is not noticed; a step saved by this version records the full checksum.",
                      SampledBaseWarning, stacklevel=3)
