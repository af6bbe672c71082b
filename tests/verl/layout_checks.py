"""Checks of a role part mcore_rl writes under verl against verl 0.9.1's own code: its path
helpers, its old-layout detector, its manifest schema and its merger (on CPU: ``verl_merger_cpu``)
against ``converters/mcore_to_hf.py merge --dtype bf16``; and ``to_old_layout``, a role part
rewritten as builds before verl's layout wrote it (``<role>/dist_ckpt/``, ``<role>/huggingface/``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _listing(base: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), base) for d, dirs, names in os.walk(base) for n in dirs + names)


def check_verl_reads(role_dir: str) -> dict:
    """verl's helpers and detector on ``role_dir`` (an assertion names what fails); returns the
    parsed ``ckpt_contents.json``."""
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron_utils import (get_checkpoint_contents_manifest_path, get_hf_model_checkpoint_path,
                                           get_model_dist_checkpoint_path)

    from mcore_rl.fileio.torch_dist_read import TorchDistReader

    before = _listing(role_dir)
    hf, dist = get_hf_model_checkpoint_path(role_dir), get_model_dist_checkpoint_path(role_dir)
    assert _listing(role_dir) == before, "verl's helpers had to create a directory: they point at nothing"
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["architectures"], hf
    reader = TorchDistReader(dist)
    try:
        keys = set(reader.tensors)
    finally:
        reader.close()
    assert "embedding.word_embeddings.weight" in keys and any(k.startswith("decoder.layers.") for k in keys), keys
    MegatronCheckpointManager._raise_for_old_layout(role_dir)  # raises RuntimeError on the old layout
    with open(get_checkpoint_contents_manifest_path(role_dir)) as f:
        manifest = json.load(f)
    assert manifest["schema_version"] == MegatronCheckpointManager.MANIFEST_SCHEMA_VERSION == 2, manifest
    assert manifest["framework"] == "megatron" and manifest["role"] == os.path.basename(role_dir), manifest
    named = [e["path"] for e in manifest["contents"].values()] + list(manifest["directories"])
    assert named and all(os.path.isdir(os.path.join(role_dir, p)) for p in named), named
    assert manifest["contents"]["model"]["path"] == os.path.relpath(dist, role_dir)
    assert manifest["contents"]["hf_config"]["path"] == os.path.relpath(hf, role_dir)
    from mcore_rl.checkpoint.role_parts import read_part

    role = os.path.basename(role_dir)  # the part's record (written after it) vouches for the manifest
    assert f"{role}/ckpt_contents.json" in read_part(os.path.join(role_dir, "PART")).files
    return manifest


def verl_merge(role_dir: str, target: str) -> None:
    """verl's ``model_merger merge --backend megatron`` of ``role_dir`` into ``target`` (a process)."""
    cmd = [sys.executable, "-m", "tests.verl.verl_merger_cpu", "merge", "--backend", "megatron",
           "--use_cpu_initialization", "--local_dir", role_dir, "--target_dir", target]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weight_differences(a_dir: str, b_dir: str) -> list[str]:
    """Tensors of two HF directories that differ in name, dtype, shape or any bit."""
    import torch
    from safetensors.torch import load_file

    def tensors(d: str) -> dict:
        out = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, name)))
        return out

    a, b = tensors(a_dir), tensors(b_dir)
    assert a, a_dir
    differ = sorted(set(a) ^ set(b))
    return differ + [n for n in sorted(set(a) & set(b)) if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def to_old_layout(role_dir: str) -> None:
    """Rewrites a verl_v2 role part as builds before verl's layout wrote it: ``dist_ckpt/`` and
    ``huggingface/`` in the role dir, no manifest, ``mcore_rl.json`` without ``model_layout`` at
    schema 1 (2: adapters), its ``PART`` record listing those files."""
    from mcore_rl.checkpoint.role_parts import PartRecord, read_part, write_part
    from mcore_rl.fileio.checksum import file_checksum

    os.rename(os.path.join(role_dir, "model", "dist_ckpt"), os.path.join(role_dir, "dist_ckpt"))
    os.rename(os.path.join(role_dir, "model", "huggingface"), os.path.join(role_dir, "huggingface"))
    os.rmdir(os.path.join(role_dir, "model"))
    os.remove(os.path.join(role_dir, "ckpt_contents.json"))
    meta_path = os.path.join(role_dir, "mcore_rl.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["model_layout"]
    meta["schema_version"] = 2 if meta.get("lora") else 1
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    part_path, role = os.path.join(role_dir, "PART"), os.path.basename(role_dir)
    old = read_part(part_path)
    files = {f"{role}/{rel}": file_checksum(os.path.join(role_dir, rel))
             for rel in _listing(role_dir) if rel != "PART" and os.path.isfile(os.path.join(role_dir, rel))}
    write_part(part_path, PartRecord(old.step, old.role, old.written, files))
