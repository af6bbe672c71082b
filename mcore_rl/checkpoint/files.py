"""Names in a model directory and the small file helpers the manager, the converter and the
merge share (no megatron import: the merge must run without it)."""
from __future__ import annotations

import os
import resource
import shutil
import threading

META = "mcore_rl.json"  # schema version, role, architecture facts, layout, contents, versions
# HF files that travel with the weights (config, generation config, tokenizer)
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def copy_hf_files(src: str, dst: str) -> None:
    """Copies the ``HF_FILES`` present in ``src`` into ``dst`` (created)."""
    os.makedirs(dst, exist_ok=True)
    for name in HF_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Writeback:
    """Streams a file's written pages to disk while its writer goes on: ``poke()`` after each
    piece (a thread runs fdatasync, coalescing pokes), ``close()`` waits and fsyncs once more.
    The final fsync then finds little left, so disk and CPU work overlap."""

    def __init__(self, fileobj) -> None:
        self._file = fileobj
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mcore_rl-writeback", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Call after writing a piece: its pages start going to disk in the background."""
        self._file.flush()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            os.fdatasync(self._file.fileno())

    def stop(self) -> None:
        """Ends the background thread (after a failed write: no final fsync)."""
        self._stop = True
        self._wake.set()
        self._thread.join()

    def close(self) -> None:
        """Stops the thread, then flush + fsync: the file is durable when this returns."""
        self.stop()
        self._file.flush()
        os.fsync(self._file.fileno())
