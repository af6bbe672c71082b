"""The identity of a LoRA engine's HF base (fileio/base_identity.py, issue #37 item 4): every byte
counts (a tensor edited between the old three 64 KiB samples, same size, differs, naming the
file); a record an older version wrote (samples only) is still read, compared on what it holds,
and the callers warn that an edit between its samples goes unnoticed."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.lora_ckpt_bodies import double_between_samples


@pytest.fixture()
def base(tmp_path):
    """A HF directory whose one safetensors file (512 KiB) has tensors between the samples."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(64, 256, generator=g) for i in range(8)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def test_an_edit_between_the_samples_differs_and_older_records_compare_their_samples(base):
    from mcore_rl.fileio.base_identity import SampledBaseWarning, differences, hf_dir_identity, warn_if_sampled_only

    saved = hf_dir_identity(base)
    entry = saved["files"]["model.safetensors"]
    assert entry["checksum"].startswith("xxh3_128:") and entry["size"] == (base / "model.safetensors").stat().st_size
    older = {**saved, "files": {"model.safetensors": {k: v for k, v in entry.items() if k != "checksum"}}}
    assert differences(saved, hf_dir_identity(base)) == []
    double_between_samples(str(base))
    now = hf_dir_identity(base)
    assert now["files"]["model.safetensors"]["size"] == entry["size"]
    assert now["files"]["model.safetensors"]["sample_sha256"] == entry["sample_sha256"]  # the samples miss it
    assert differences(saved, now) == ["model.safetensors: other content (XXH3-128)"]
    assert differences(older, now) == []  # an older record: its samples are all it can compare
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_sampled_only(saved, "step 3")
        warn_if_sampled_only(older, "step 3")
    assert [str(w.message) for w in caught if w.category is SampledBaseWarning] == [
        f"step 3: the base identity it records predates full-content checksums: ['model.safetensors'] of the HF "
        f"model directory {base} are compared by size and three 64 KiB samples only, so an edit between the samples "
        "is not noticed; a step saved by this version records the full checksum."]
