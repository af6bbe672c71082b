"""Corruption sweep (issue #29): a converted checkpoint, a CheckpointManager step and a HF model
directory damaged file by file — config.json, the index, safetensors header and data,
``.metadata``, shards, ``mcore_rl.json``, ``RECORD``, the marker, the tracker; truncation, bit flips,
byte runs, JSON values of the wrong type, deleted files, directories and symlinks in their place —
a fixed random pick of the systematic cases plus random ones (fixed seed), each run through
``mcore_to_hf.py`` ``merge``/``test`` in this process, and a smaller sweep of the damaged HF directory
through ``hf_to_mcore.py``. Each ends in one ``error:`` line and exit 2,
or in the bit-exact result; never an exception, never exit 0 with other tensors, never a change to
the input. ``benchmarks/corruption_sweep.py`` runs thousands more."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks.corruption_sweep import Case, randomised, scratch_dir, sweep, systematic
from tests.read_fixtures import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEMATIC, RANDOM = 300, 200
READS = frozenset({"merge_step", "merge_conv", "test_conv", "test_hf"})


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return build(tmp_path_factory.getbasetemp())


def test_sweep_covers_every_file_kind(fixtures):
    from benchmarks.corruption_sweep import make_tree
    import random

    base = scratch_dir()
    try:
        tree = make_tree(fixtures, base)
        cases: list[Case] = random.Random(0).sample(systematic(tree), SYSTEMATIC) + randomised(tree, RANDOM, 0)
    finally:
        shutil.rmtree(base)
    names = {os.path.basename(c.rel) for c in cases}
    kinds = {"config.json", "model.safetensors.index.json", "model.safetensors", ".metadata", "__0_0.distcp",
             "mcore_rl.json", "RECORD", "COMPLETE", "latest_checkpointed_iteration.txt"}
    assert kinds <= names, kinds - names
    assert {c.command for c in cases} == READS | {"convert_hf"}
    assert {c.how for c in cases} >= {"truncate", "flip", "json_top", "json_key", "st_len", "st_entry", "delete",
                                      "dir", "link_outside", "link_dangling", "run"}


def test_every_damaged_input_is_one_error_line_or_the_exact_result(fixtures):
    base = scratch_dir()
    try:
        result = sweep(fixtures, base, RANDOM, seed=0, limit=SYSTEMATIC, commands=READS)
    finally:
        shutil.rmtree(base)
    assert result["cases"] >= 300
    assert result["failures"] == [], result["failures"][:10]


def test_every_damaged_hf_input_is_one_error_line_or_converted_faithfully(fixtures, tmp_path_factory):
    """hf_to_mcore on a damaged HF directory (config, index, safetensors header and data, links):
    one error line and nothing written, or an output that merges back to exactly the tensors the
    safetensors library reads from the damaged directory (its data has no checksum to refuse).
    In its own process: the converter sets up megatron's groups in the process it runs in."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "corruption_sweep.py"), "--commands",
                           "convert_hf", "--cases", "40", "--workdir", str(tmp_path_factory.getbasetemp())],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = int(re.search(r"^(\d+) cases, 0 failures", done.stdout, re.M)[1])
    assert cases >= 75, done.stdout[-2000:]
