"""Names in a model directory and the small file helpers the manager, the converter and the
merge share (no megatron import: the merge must run without it)."""
from __future__ import annotations

import fnmatch
import os
import resource
import shutil
import threading

from mcore_rl.fileio.checksum import Hasher
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.paths import contained

META = "mcore_rl.json"  # schema version, role, architecture facts, layout, contents, versions
STORED_KEY = "hf_stored_dtypes"  # mcore_rl.json of a quantized import: HF name -> the source's stored dtype
# HF files that travel with the weights (config, generation config, tokenizer, chat template:
# transformers 5 writes the template to its own file; a vision-language checkpoint's tensors that
# mcore_rl carries through: models/hf_layout.CARRIED_FILE)
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
            "chat_template.jinja", "chat_template.json", "tiktoken.model", "mcore_rl_carried.safetensors")
# tokenizer code some checkpoints carry (Kimi-K2: tokenization_kimi.py beside tiktoken.model)
HF_FILE_PATTERNS = ("tokenization_*.py",)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (opened read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hf_side_files(src: str) -> list[tuple[str, str]]:
    """(name, real path) of the ``HF_FILES`` and ``HF_FILE_PATTERNS`` present in ``src``, each inside
    ``src`` on resolved paths (``paths.contained``; a hub-cache snapshot's links into its repo's ``blobs/``): a
    side file that is a link leaving the model directory raises ``UnsafePathError``."""
    found = []
    listing = sorted(os.listdir(src)) if os.path.isdir(src) else []
    patterned = [n for n in listing if any(fnmatch.fnmatchcase(n, p) for p in HF_FILE_PATTERNS)]
    for name in (*HF_FILES, *patterned):
        path = contained(src, name, f"the HF model directory {src}", hub_cache=True)
        if os.path.isfile(path):
            found.append((name, os.path.realpath(path)))
    return found


def copy_hf_files(src: str, dst: str) -> None:
    """Copies the ``HF_FILES`` present in ``src`` into ``dst`` (created), as regular files;
    refused (``UnsafePathError``, nothing copied) when one is a link leaving ``src``."""
    files = hf_side_files(src)
    os.makedirs(dst, exist_ok=True)
    for name, real in files:
        shutil.copyfile(real, os.path.join(dst, name))


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB: ``VmHWM`` of /proc/self/status (the
    high-water mark of this program's own memory; ``getrusage``'s maxrss, the fallback, carries a
    parent's peak across ``exec``, so a subprocess of a large rank would report the rank's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Writeback:
    """Streams a file's written pages to disk while its writer goes on: ``poke()`` after each
    piece (a thread runs fdatasync, coalescing pokes), ``close()`` waits and fsyncs once more.
    The final fsync then finds little left, so disk and CPU work overlap.

    An error of the background fdatasync is kept and raised by the next ``poke()`` or by
    ``close()``: Linux reports a write-back error to one fsync only, so the final fsync may
    succeed after pages were lost, and the file must not count as written."""

    def __init__(self, fileobj) -> None:
        self._file = fileobj
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mcore_rl-writeback", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Call after writing a piece: its pages start going to disk in the background."""
        self._raise_error()
        self._file.flush()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:  # also once more when stopping: what the last poke handed over is flushed here
                io_fault("flush", getattr(self._file, "name", ""))
                os.fdatasync(self._file.fileno())
            except BaseException as e:  # noqa: BLE001 - handed to the writer, which fails the file
                self._error = e
                return
            if self._stop:
                return

    def _raise_error(self) -> None:
        if self._error is not None:
            name = getattr(self._file, "name", "the file")
            raise OSError(getattr(self._error, "errno", None),
                          f"background flush of {name} failed: {self._error}") from self._error

    def stop(self) -> None:
        """Ends the background thread (after a failed write: no final fsync)."""
        self._stop = True
        self._wake.set()
        self._thread.join()

    def close(self) -> None:
        """Stops the thread, then flush + fsync: the file is durable when this returns; raises
        when any flush of the file failed."""
        self.stop()
        self._raise_error()
        self._file.flush()
        os.fsync(self._file.fileno())


class ChecksumStream:
    """A binary file wrapper that keeps the size and checksum (``checksum.Hasher``) of everything
    written through it, and of each item between ``begin_item()`` and ``end_item()`` (the
    checksums a checkpoint records; computed while writing, never by reading the file back)."""

    def __init__(self, fileobj) -> None:
        self._file = fileobj
        self._whole, self._item = Hasher(), None
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self._file.write(view)
        self._whole.update(view)
        if self._item is not None:
            self._item.update(view)
        self.size += len(view)
        return n

    def begin_item(self) -> None:
        self._item = Hasher()

    def end_item(self) -> str:
        """The checksum of what was written since ``begin_item()``."""
        value, self._item = self._item.value(), None
        return value

    def checksum(self) -> str:
        return self._whole.value()

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def name(self) -> str:
        return self._file.name


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``, 10 ms resolution; 0.0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0
