"""Loading a megatron dist-checkpoint runs no foreign code: a real torch_dist checkpoint (tiny
GPTModel at TP=2, fully_reshardable DistributedOptimizer state after one Adam step, a
ShardedObject of RNG state per TP rank) round-trips under ``restricted_unpickling()``; planted
pickles in ``.metadata``, in ShardedObject payloads and in ``common.pt`` are refused with
``UnsafeCheckpointError`` and never run, while the same load without the guard runs them."""
from __future__ import annotations

import glob
import io
import os
import pickle

import pytest
import torch

from tests.ckpt_util import engine, flat_tensors, replace_rng_payloads, save, train_step
from tests.dist import run_ranks

META = {"distrib_optim_sharding_type": "fully_reshardable"}


class _Run:
    """Pickles as ``os.system(cmd)``: what an attacker plants."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _touch(marker: str) -> _Run:
    return _Run(f"touch {marker}.$RANK")  # RANK is set in each rank of tests/dist.py


def _plant_metadata(ckpt: str, marker: str) -> None:
    """A working .metadata whose planner_data also runs the planted command."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    md.planner_data = _touch(marker)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _plant_payloads(ckpt: str, marker: str) -> None:
    """Every rank's RNG ShardedObject payload replaced by a torch.save of the planted object,
    appended to its .distcp file (the .metadata points to it; both stay well-formed)."""
    replace_rng_payloads(ckpt, [_touch(marker)])


def _plant_common(ckpt: str, marker: str) -> None:
    path = os.path.join(ckpt, "common.pt")
    common = torch.load(path, weights_only=True)
    common["planted"] = _touch(marker)
    torch.save(common, path)


PLANTS = {"metadata": _plant_metadata, "payload": _plant_payloads, "common": _plant_common}


def _rng_state() -> dict:
    """RNG state as mcore_rl saves it: tensors and plain values (numpy's state as a tensor)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"random": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}


def _template(eng, rng, loading: bool) -> dict:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedObject

    msd = eng.model[0].sharded_state_dict()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return {
        "model": msd,
        "optimizer": eng.optimizer.sharded_state_dict(msd, is_loading=loading, metadata=META),
        "rng": ShardedObject("rng_state", rng, (tp,), (parallel_state.get_tensor_model_parallel_rank(),),
                             replica_id=0),
    }


def _load(eng, ckpt: str, guarded: bool, force_no_weights_only: bool = False):
    """Loads ckpt; returns (loaded state or None, 'ExceptionType: message' or None)."""
    from megatron.core import dist_checkpointing

    from mcore_rl.fileio.safe_load import restricted_unpickling

    if force_no_weights_only:
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        if guarded:
            with restricted_unpickling():
                return dist_checkpointing.load(_template(eng, None, True), ckpt), None
        return dist_checkpointing.load(_template(eng, None, True), ckpt), None
    except BaseException as e:  # torch wraps rank failures in CheckpointException (BaseException)
        return None, f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        torch.distributed.barrier()


def _rng_equal(a: dict, b: dict) -> bool:
    na, nb = a["numpy"], b["numpy"]
    return (a["random"] == b["random"] and torch.equal(a["torch"], b["torch"])
            and na[0] == nb[0] and torch.equal(na[1], nb[1]) and tuple(na[2:]) == tuple(nb[2:]))


def _save_then_attack(root: str) -> dict:
    import shutil

    eng = engine(dict(tp=2))
    train_step(eng, 0)
    rng = _rng_state()
    saved = _template(eng, rng, False)
    expected = {k: v.clone() for k, v in flat_tensors(saved).items()}
    ckpt = os.path.join(root, "ckpt")
    save(saved, ckpt)
    out: dict = {}
    loaded, error = _load(eng, ckpt, guarded=True)
    assert error is None, error
    got = flat_tensors(loaded)
    out["keys_equal"] = sorted(got) == sorted(expected)
    out["mismatch"] = sorted(k for k in expected if k in got and not torch.equal(got[k], expected[k]))
    out["rng_equal"] = _rng_equal(loaded["rng"], rng)
    out["tensors"] = len(expected)
    rank = torch.distributed.get_rank()
    for name, plant in PLANTS.items():
        bad, marker = os.path.join(root, name), os.path.join(root, f"ran_{name}")
        if rank == 0:
            shutil.copytree(ckpt, bad)
            plant(bad, marker)
        torch.distributed.barrier()
        force = name == "common"  # torch's default already refuses common.pt unless forced off
        _, out[f"{name}_guarded"] = _load(eng, bad, guarded=True, force_no_weights_only=force)
        out[f"{name}_ran_guarded"] = sorted(glob.glob(marker + ".*"))
        _, out[f"{name}_unguarded"] = _load(eng, bad, guarded=False, force_no_weights_only=force)
        out[f"{name}_ran_unguarded"] = sorted(os.path.basename(p) for p in glob.glob(marker + ".*"))
    return out


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    return run_ranks(2, _save_then_attack, str(tmp_path_factory.mktemp("ckpt")))


def test_round_trip_under_restricted_unpickling(attacked):
    for r in attacked:
        assert r["keys_equal"] and r["mismatch"] == [] and r["rng_equal"], r
        assert r["tensors"] > 20  # model, optimizer (param, exp_avg, exp_avg_sq) and RNG tensors


@pytest.mark.parametrize("name,file", [("metadata", ".metadata"), ("payload", ".distcp"),
                                       ("common", "common.pt")])
def test_planted_pickle_is_refused_and_never_runs(attacked, name, file):
    for rank, r in enumerate(attacked):
        error = r[f"{name}_guarded"]
        assert error is not None and error.startswith("UnsafeCheckpointError"), error
        assert file in error and "posix.system" in error and "may be malicious" in error, error
        assert r[f"{name}_ran_guarded"] == [], r
    if name == "payload":  # each rank reads its own payload; rank 1's error names its own file
        assert "rng_state/shard_0_2" in attacked[0]["payload_guarded"]
        assert "rng_state/shard_1_2" in attacked[1]["payload_guarded"]


@pytest.mark.parametrize("name", list(PLANTS))
def test_without_the_guard_the_planted_code_runs(attacked, name):
    """The planted-bug proof: the same files loaded without restricted_unpickling() run the
    command on both ranks (common.pt: with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1)."""
    assert attacked[-1][f"{name}_ran_unguarded"] == [f"ran_{name}.0", f"ran_{name}.1"], attacked[-1]


def test_restricted_unpickler_refuses_before_running(tmp_path):
    from mcore_rl.fileio.safe_load import UnsafeCheckpointError, restricted_pickle_load
    from mcore_rl.errors import McoreRLError

    marker = tmp_path / "ran"
    data = pickle.dumps({"ok": torch.Size([2]), "bad": _Run(f"touch {marker}")})
    with pytest.raises(UnsafeCheckpointError, match=r"x\.metadata.*posix\.system") as info:
        restricted_pickle_load(io.BytesIO(data), source="x.metadata")
    assert isinstance(info.value, McoreRLError) and isinstance(info.value, pickle.UnpicklingError)
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(info.value)).refused == "posix.system"  # crosses ranks


def test_context_restores_everything_and_nests():
    from torch.distributed.checkpoint import default_planner, filesystem

    from mcore_rl.fileio.safe_load import restricted_unpickling

    def current():
        return (torch.load, filesystem.pickle, filesystem.FileSystemReader.read_data,
                default_planner.DefaultLoadPlanner.load_bytes)

    before = current()
    with restricted_unpickling():
        inside = current()
        with restricted_unpickling():
            assert current() == inside
        assert current() == inside  # the inner exit keeps the outer block guarded
        with pytest.raises(ValueError):
            with restricted_unpickling():
                raise ValueError("unrelated errors pass through")
    assert all(a is not b for a, b in zip(before, inside))
    assert current() == before
    assert filesystem.pickle is pickle
