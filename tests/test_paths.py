"""paths.contained, the one gate for file names read from checkpoints and HF indexes: names that
leave their directory are refused; a Hugging Face hub-cache snapshot (files linked into the same
repo's blobs/) is readable as a HF model folder, and nothing else outside it is."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from mcore_rl.fileio.paths import UnsafePathError, contained
from mcore_rl.mapping.hf_io import SafetensorsReader


def _hub_snapshot(tmp_path) -> str:
    """<repo>/snapshots/<rev>/ whose files link into <repo>/blobs/, as huggingface_hub writes it."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(repo / "blobs" / "aaa"))
    (repo / "blobs" / "bbb").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    os.symlink("../../blobs/aaa", snap / "model.safetensors")
    os.symlink("../../blobs/bbb", snap / "model.safetensors.index.json")
    return str(snap)


def test_names_leaving_the_directory_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "outside").write_text("x")
    os.symlink(tmp_path / "outside", tmp_path / "d" / "link")
    for rel, why in (("../outside", "which leaves"), (str(tmp_path / "outside"), "which leaves"),
                     ("link", "a symlink leaves the directory"), ("", "not a file name"), ("a\0b", "not a file name")):
        with pytest.raises(UnsafePathError, match=why):
            contained(str(tmp_path / "d"), rel, "the test's index")
    assert contained(str(tmp_path / "d"), "sub/file", "x") == str(tmp_path / "d" / "sub" / "file")


def test_a_hub_cache_snapshot_is_a_readable_hf_folder(tmp_path):
    snap = _hub_snapshot(tmp_path)
    assert torch.equal(SafetensorsReader(snap)["w"], torch.ones(2))
    with pytest.raises(UnsafePathError, match="a symlink leaves the directory"):
        contained(snap, "model.safetensors", "a checkpoint")  # checkpoints get no such allowance
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "ccc").write_text("x")
    os.symlink(str(other / "ccc"), os.path.join(snap, "stolen.safetensors"))
    os.symlink("/etc/hostname", os.path.join(snap, "host.safetensors"))
    for name in ("stolen.safetensors", "host.safetensors"):  # another repo's blobs, or anywhere else
        with pytest.raises(UnsafePathError, match="a symlink leaves the directory"):
            contained(snap, name, "the listing", hub_cache=True)
