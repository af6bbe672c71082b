"""What a converter may replace, and what it must keep apart from its input.

``--overwrite`` replaces only an output this project wrote, recognised by what it left there, or
an empty directory:

- ``model_dir`` (``hf_to_mcore``): ``mcore_rl.json`` (a JSON object) beside nothing but what its
  layout (``model_layout``: ``dist_ckpt/``, ``huggingface/``) puts there and the converter's
  ``RECORD``, and not a training checkpoint's role directory
  (``global_step_<N>/<role>``);
- ``hf_export`` (``mcore_to_hf merge``, ``gguf_to_hf``): ``mcore_rl_export.json``, the record
  ``write_export_record`` leaves in the HF directory, naming every entry in it.

Anything else is refused, and so is an output that overlaps its input on resolved paths: the
input directory itself and every symlink anywhere under it (a hub-cache snapshot's links into
``blobs/``, a ``dist_ckpt`` linked elsewhere). No torch or megatron import.
"""
from __future__ import annotations

import json
import os
import re
from typing import Literal

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.fileio.staging import overlaps, settle

EXPORT_RECORD = "mcore_rl_export.json"
# a HF dir's weight files: what a merge writes and an export adds (transformers reads nothing else)
WEIGHT_FILE = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin)$")
CONVERTER_RECORD = "RECORD"  # checkpoint.model_record.RECORD (fileio sits below checkpoint: not imported)
MODEL_DIR_ENTRIES = frozenset({META, CONVERTER_RECORD})  # and its layout's entries (model_layout)
OutputKind = Literal["model_dir", "hf_export"]
_WALK_LIMIT = 200_000  # entries under an input; a larger tree is refused rather than half-checked


def is_export_file(name: str) -> bool:
    """Whether a file named ``name`` in a HF dir is an export's (weights, index, the export's
    record), never one a merge reads there (it reads config.json and copies the side files)."""
    return bool(WEIGHT_FILE.match(name)) or name == EXPORT_RECORD


def write_export_record(directory: str, writer: str) -> None:
    """Writes ``directory/mcore_rl_export.json``: who wrote the directory and every entry in it
    (call it last, when the directory is complete; transformers ignores the file)."""
    names = sorted(set(os.listdir(directory)) | {EXPORT_RECORD})
    with open(os.path.join(directory, EXPORT_RECORD), "w") as f:
        json.dump({"written_by": "mcore_rl", "writer": writer, "files": names}, f, indent=2)
        f.write("\n")


def settle_output(final: str, error: type[CheckpointError]) -> None:
    """Finishes or undoes what an interrupted run left beside ``final`` (``staging.settle``),
    before anything looks at ``final``; a failed observation is ``error`` naming it."""
    try:
        settle(final)
    except OSError as e:
        raise error(f"cannot settle what an interrupted run left beside {final}: {e}; check the disk, "
                    "then run again.") from e


def refuse_file(final: str, what: str, error: type[CheckpointError]) -> None:
    """A file (or a link to one) where a directory is to be written."""
    if os.path.lexists(final) and not os.path.isdir(final):
        raise error(f"{what} is a file; pass a directory.")


def input_overlap(final: str, source: str) -> str | None:
    """None when ``final`` and the input ``source`` (a directory or a file) are apart on
    resolved paths; else a note naming what overlaps: ``source`` itself, or a link under it
    (and where it resolves to)."""
    if overlaps(final, source):
        return ""
    for link, real in _links_under(source):
        if overlaps(final, real):
            return f" (its entry {link} resolves to {real})"
    return None


def _links_under(source: str):
    """(link, its real path) for every symlink under ``source``, following links to directories
    once each (a loop ends)."""
    seen, todo, count = {os.path.realpath(source)}, [source], 0
    while todo:
        top = todo.pop()
        if not os.path.isdir(top):
            continue
        for dirpath, dirs, files in os.walk(top):
            count += len(dirs) + len(files)
            if count > _WALK_LIMIT:
                raise CheckpointError(f"{source} holds more than {_WALK_LIMIT} entries; pass a directory "
                                      "that holds the model only.")
            for name in dirs + files:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):
                    real = os.path.realpath(path)
                    yield path, real
                    if os.path.isdir(real) and real not in seen:
                        seen.add(real)
                        todo.append(real)


def check_replaceable(final: str, overwrite: bool, kind: OutputKind, what: str,
                      error: type[CheckpointError]) -> None:
    """Refuses a non-empty ``final`` without ``overwrite``, and with it one this project did not
    write as ``kind`` (see module doc)."""
    if not os.path.isdir(final):
        return
    try:
        names = sorted(os.listdir(final))
    except OSError as e:
        raise error(f"{what}: cannot list it ({e}); check the disk and permissions.") from e
    if not names:
        return
    if not overwrite:
        raise error(f"{what} is not empty; pass --overwrite to replace it (the old output is kept until "
                    "the new one is complete) or choose an empty directory.")
    why = (_not_model_dir if kind == "model_dir" else _not_export)(final, names)
    if why:
        raise error(f"{what} was not written by this command: {why}; --overwrite replaces only an earlier "
                    "output of it or an empty directory: choose another path, or remove the directory "
                    "yourself if it may go.")


def _json_object(path: str) -> dict | None:
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _not_model_dir(final: str, names: list[str]) -> str:
    """Why ``final`` is not a converter output ("" when it is one)."""
    if re.fullmatch(r"global_step_\d+", os.path.basename(os.path.dirname(os.path.realpath(final)))):
        return "it is a role directory of a training checkpoint (global_step_<N>/<role>)"
    meta = _json_object(os.path.join(final, META))
    if meta is None:
        return f"it holds {_few(names)} and no {META} object"
    try:
        entries = MODEL_DIR_ENTRIES | layout_of(final, meta).entries()
    except CheckpointError as e:  # a layout this build does not know: not one it replaces
        return f"its {META} names no layout this build writes ({e})"
    other = [n for n in names if n not in entries]
    return f"besides a model it holds {_few(other)}" if other else ""


def _not_export(final: str, names: list[str]) -> str:
    """Why ``final`` is not a HF directory this project exported ("" when it is one)."""
    record = _json_object(os.path.join(final, EXPORT_RECORD))
    listed = record.get("files") if record and record.get("written_by") == "mcore_rl" else None
    if not isinstance(listed, list):
        return f"it holds {_few(names)} and no {EXPORT_RECORD} record"
    other = [n for n in names if n not in listed]
    return f"it holds {_few(other)}, which its {EXPORT_RECORD} does not list" if other else ""


def _few(names: list[str]) -> str:
    return repr(names[:5])[:-1] + (f", ... {len(names) - 5} more]" if len(names) > 5 else "]")
