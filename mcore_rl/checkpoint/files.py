"""Names in a model directory and the small file helpers the manager, the converter and the
merge share (no megatron import: the merge must run without it)."""
from __future__ import annotations

import os
import resource
import shutil

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
