"""The identity of the base weights a LoRA engine trains on: recorded in its adapter-only
checkpoints (``mcore_rl.json``) and compared on resume, so adapters never load onto another base.

Cheap by design (no full read of the weights):

* a HF directory: ``config.json``'s SHA-256 and, per ``*.safetensors`` / index file, its size
  and the SHA-256 of three 64 KiB samples (start — the header with every tensor's name, dtype,
  shape and offset —, middle, end; a whole small file). A fine-tuned variant of the same model
  (same names and sizes) differs in the sampled bytes;
* a model directory (``dist_ckpt/``): the size and CRC-32 of every ``dist_ckpt/`` file from the
  record that vouches for it (the step's marker or the converter's RECORD: computed when it was
  written, so free here); without a record, sizes and samples as for a HF directory;
* in-memory HF tensors: a SHA-256 of names, dtypes and shapes (and the bytes of a plain dict);
* nothing loaded (the build's random init): ``{"kind": "none"}``.

The path is recorded but not compared: a base moved or copied elsewhere is the same base.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import torch

from mcore_rl.errors import CheckpointError

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


def _sampled_files(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(names):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        out[name] = {"size": size, "sample_sha256": _sampled_sha256(path, size)}
    return out


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
    return {"kind": "hf", "path": path, "config_sha256": config_sha, "files": _sampled_files(path, weights)}


def model_dir_identity(path: str, record_source: str | None,
                       files: Mapping[str, tuple[int, str | None]] | None) -> Identity:
    """The identity of a model directory: ``files`` (rel -> (size, CRC-32)) from the record at
    ``record_source`` that vouches for it; None: sizes and samples of ``dist_ckpt/`` itself."""
    path = os.path.abspath(path)
    if files is not None:
        listed = {rel: {"size": int(size), "crc32": crc} for rel, (size, crc) in sorted(files.items())
                  if rel.startswith("dist_ckpt/")}
        return {"kind": "mcore", "path": path, "record": record_source, "files": listed}
    dist = os.path.join(path, "dist_ckpt")
    names = sorted(os.listdir(dist))
    sampled = _sampled_files(dist, [n for n in names if os.path.isfile(os.path.join(dist, n))])
    return {"kind": "mcore", "path": path, "record": None,
            "files": {f"dist_ckpt/{rel}": v for rel, v in sampled.items()}}


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
_FIELDS = {"size": "size", "crc32": "CRC-32", "sample_sha256": "sampled bytes", "config_sha256": "config.json",
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
        elif old[name] != new[name]:
            keys = [k for k in sorted(set(old[name]) | set(new[name])) if old[name].get(k) != new[name].get(k)]
            out.append(f"{name}: " + ", ".join(_changed(k, old[name].get(k), new[name].get(k)) for k in keys))
    return out
