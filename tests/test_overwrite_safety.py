"""--overwrite replaces only what this project wrote, judged on resolved paths, and HF side files
never come through a link that leaves the model directory (issue #29, defects 6 and 7). The
merge's reproducers (a dist_ckpt linked into the target, a sibling model) are in
test_convert_safety.py, beside the converted checkpoint they need."""
from __future__ import annotations

import hashlib
import os

import pytest

from tests.tiny import tiny_config, tiny_hf_model


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A tiny llama in a transformers hub-cache layout: ``<repo>/snapshots/<rev>/<file>`` are
    relative links to ``<repo>/blobs/<sha256>``."""
    base = tmp_path_factory.mktemp("hub")
    plain = base / "plain"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1)).save_pretrained(plain)
    (plain / "tokenizer.json").write_text('{"version": "1.0"}')
    repo = base / "models--tiny--llama"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(plain):
        data = (plain / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    return {"plain": plain, "repo": repo, "snapshot": snapshot}


def _tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_hub_cache_output_into_the_inputs_blobs_is_refused(hub):
    """hf_to_mcore --hf_model_path <repo>/snapshots/<rev> --output_path <repo>/blobs --overwrite:
    the input's files are links into blobs/, so the output overlaps the input (resolved)."""
    from mcore_rl.conversion.convert_input import ConvertError, check_input, check_output

    blobs = hub["repo"] / "blobs"
    before = _tree(blobs)
    check_input(str(hub["snapshot"]))  # links into the same repo's blobs/ are allowed to read
    with pytest.raises(ConvertError, match=rf"--output_path '{blobs}' overlaps --hf_model_path "
                                           rf"'{hub['snapshot']}' \(its entry .*/snapshots/0123abcd/\S+ resolves to "
                                           rf"{blobs}/[0-9a-f]{{64}}\)"):
        check_output(str(blobs), str(hub["snapshot"]), True)
    assert _tree(blobs) == before


def test_overwrite_replaces_only_an_earlier_converter_output(hub, tmp_path):
    """A directory of the user's, a converter output with a file of the user's added, and a
    training checkpoint's role directory are refused with --overwrite; an earlier converter
    output (mcore_rl.json beside dist_ckpt/ and huggingface/) or an empty directory is not."""
    from mcore_rl.conversion.convert_input import ConvertError, check_output

    def make(path, names):
        path.mkdir(parents=True)
        for name in names:
            (path / name).mkdir() if name in ("dist_ckpt", "huggingface") else (path / name).write_text("{}")
        return str(path)

    refused = {
        make(tmp_path / "mine", ["notes.txt", "data.csv"]): r"it holds \['data.csv', 'notes.txt'\] and no "
                                                            r"mcore_rl.json object",
        make(tmp_path / "added", ["dist_ckpt", "huggingface", "mcore_rl.json", "notes.txt"]):
            r"besides a model it holds \['notes.txt'\]",
        make(tmp_path / "ckpt" / "global_step_3" / "actor", ["dist_ckpt", "mcore_rl.json"]):
            r"it is a role directory of a training checkpoint \(global_step_<N>/<role>\)",
    }
    for path, why in refused.items():
        before = _tree(tmp_path)
        with pytest.raises(ConvertError, match=rf"--output_path '{path}' was not written by this command: {why}; "
                                               r"--overwrite replaces only an earlier output of it or an empty"):
            check_output(path, str(hub["plain"]), True)
        assert _tree(tmp_path) == before
    check_output(make(tmp_path / "earlier", ["dist_ckpt", "huggingface", "mcore_rl.json"]), str(hub["plain"]), True)
    check_output(make(tmp_path / "empty", []), str(hub["plain"]), False)


def test_gguf_overwrite_of_a_directory_it_did_not_write_is_refused(tmp_path):
    from mcore_rl.conversion.gguf_convert import gguf_to_hf
    from mcore_rl.errors import McoreRLError

    (tmp_path / "models" / "other").mkdir(parents=True)
    (tmp_path / "models" / "other" / "model.safetensors").write_bytes(b"a sibling model")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(McoreRLError, match=r"'.*/models' was not written by this command: it holds \['other'\] "
                                           r"and no mcore_rl_export.json record"):
        gguf_to_hf(str(tmp_path / "m.gguf"), str(tmp_path / "models"), overwrite=True)
    assert (tmp_path / "models" / "other" / "model.safetensors").read_bytes() == b"a sibling model"


def test_side_files_linked_out_of_the_model_dir_are_refused(hub, tmp_path):
    """tokenizer.json linked to a private file and vocab.json linked to /etc/passwd: the
    converter's input check and copy_hf_files (the converter's and the checkpoint manager's
    copy) refuse them, naming the file, and copy nothing; a hub snapshot's links into its own
    blobs/ are copied as regular files."""
    from mcore_rl.conversion.convert_input import check_input
    from mcore_rl.fileio.files import copy_hf_files
    from mcore_rl.fileio.paths import UnsafePathError

    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        (hf / name).write_bytes((hub["plain"] / name).read_bytes())
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "secret.json").write_text('{"token": "s3cret"}')
    for name, target in (("tokenizer.json", tmp_path / "private" / "secret.json"), ("vocab.json", "/etc/passwd")):
        (hf / name).symlink_to(target)
        for attempt in (lambda: check_input(str(hf)), lambda: copy_hf_files(str(hf), str(tmp_path / "out"))):
            with pytest.raises(UnsafePathError, match=rf"names the file '{name}', which resolves to "
                                                      rf"{os.path.realpath(target)} outside {hf}"):
                attempt()
        assert not (tmp_path / "out").exists()
        (hf / name).unlink()
    copy_hf_files(str(hub["snapshot"]), str(tmp_path / "from_hub"))
    copied = tmp_path / "from_hub" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"version": "1.0"}'
