"""Staging.commit is crash-atomic and its leftovers do not live forever (issue #29, defects 5 and
14): a kill at every rename of a commit (MCORE_RL_CKPT_FAULT=stage_commit|stage_aside|
stage_swapped) followed by the next run leaves the newest complete output in place and nothing
hidden; a Ctrl-C in the window between the renames loses neither copy; a failed removal of the
old copy is a warning naming it and the next run removes it; a live owner's staging directory
is never touched."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest

from mcore_rl.fileio import staging
from mcore_rl.fileio.faults import ENV, IO_ENV
from mcore_rl.fileio.staging import Staging, StagingWarning, settle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one output, written the way the converters do: staged in full, committed, discarded on failure
WRITE = """
import os, sys
from mcore_rl.fileio.staging import Staging
final, tag = sys.argv[1], sys.argv[2]
stage = Staging.create(final)
os.mkdir(os.path.join(stage.path, "sub"))
for name in ("tag", "sub/tag"):
    with open(os.path.join(stage.path, name), "w") as f:
        f.write(tag)
try:
    stage.commit(replace=True)
except BaseException:
    stage.discard()
    raise
"""


def _write(final, tag: str, **env: str) -> subprocess.CompletedProcess:
    """WRITE in a fresh interpreter (its own pid: dead once it returns)."""
    full = {k: v for k, v in os.environ.items() if k not in (ENV, IO_ENV)}
    full.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", WRITE, str(final), tag], env=full, capture_output=True,
                          text=True, timeout=60)


def _state(final) -> tuple[str | None, list[str]]:
    """(the output's tag, both files agreeing, or None when absent; what else is beside it)."""
    parent, name = os.path.split(str(final))
    others = sorted(n for n in os.listdir(parent) if n != name)
    if not os.path.isdir(final):
        return None, others
    tags = {open(os.path.join(final, n)).read() for n in ("tag", "sub/tag")}
    assert len(tags) == 1, tags  # never a mix of two writes
    return tags.pop(), others


@pytest.mark.parametrize("old", [True, False], ids=["replacing", "first_write"])
def test_kill_at_every_rename_then_the_next_run_settles(tmp_path, old):
    """Killed at each rename of commit (replacing an old output, and writing the first one): the
    next run finds the old or the new complete output in place, and none of the hidden
    directories; the killed run's copy is the one in place once its old output was moved aside."""
    expect = {"stage_commit": "old" if old else None, "stage_aside": "new", "stage_swapped": "new"}
    for phase, settled in expect.items():
        final = tmp_path / phase / "out"
        if old:
            assert _write(final, "old").returncode == 0
        run = _write(final, "new", **{ENV: phase})
        if not old and phase != "stage_commit":
            assert run.returncode == 0  # no old output: a single rename, these phases are never reached
            continue
        assert run.returncode == -9, run.stderr
        assert _state(final)[1], phase  # the kill left hidden directories beside the output
        if phase != "stage_swapped":  # there: the next run's Staging.create settles by itself
            settle(str(final))  # what the next run's output check does first
            assert _state(final) == (settled, []), (phase, _state(final))
        assert _write(final, "next").returncode == 0  # and the run itself
        assert _state(final) == ("next", []), phase


def test_next_converter_run_settles_before_checking_its_output(tmp_path):
    """The converters' output checks settle first: a kill between the renames (no output, two
    hidden copies) is finished before 'is the output empty' is asked, so the killed run's
    complete output counts as the output (refused without --overwrite)."""
    from mcore_rl.conversion.convert_input import ConvertError, check_output
    from mcore_rl.conversion.merge import MergeError, check_target

    hf = tmp_path / "hf"
    hf.mkdir()
    for name, check, error in (("merged", check_target, MergeError), ("converted", check_output, ConvertError)):
        final = tmp_path / name
        assert _write(final, "old").returncode == 0
        assert _write(final, "new", **{ENV: "stage_aside"}).returncode == -9
        assert _state(final)[0] is None
        with pytest.raises(error, match="is not empty; pass --overwrite"):
            check(str(final), str(hf), False)
        assert _state(final)[0] == "new" and not [n for n in os.listdir(tmp_path) if n.startswith(".")], name
    # a failed observation while settling is a refusal naming it, never a guess: nothing moves
    final = tmp_path / "eio"
    assert _write(final, "old").returncode == 0
    assert _write(final, "new", **{ENV: "stage_aside"}).returncode == -9
    left = _state(final)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IO_ENV, f"stat:EIO@{final}")
        with pytest.raises(ConvertError, match=rf"cannot settle what an interrupted run left beside {final}: "
                                               r".*Input/output error \(injected"):
            check_output(str(final), str(hf), True)
    assert _state(final) == left


def test_ctrl_c_between_the_renames_loses_neither_copy(tmp_path, monkeypatch):
    """KeyboardInterrupt right after the old output was moved aside, and right after the new one
    was renamed into place (as a signal between two statements would): the old output is back
    in place, or the new one is, and nothing hidden is left."""
    real_rename = os.rename
    for which, settled in ((1, "old"), (2, "new")):
        final = tmp_path / f"after_rename_{which}" / "out"
        assert _write(final, "old").returncode == 0
        stage = Staging.create(str(final))
        os.mkdir(os.path.join(stage.path, "sub"))
        for name in ("tag", "sub/tag"):
            with open(os.path.join(stage.path, name), "w") as f:
                f.write("new")
        calls = []

        def rename(src, dst, which=which):
            real_rename(src, dst)
            calls.append(src)
            if len(calls) == which:
                raise KeyboardInterrupt

        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(KeyboardInterrupt):
            try:
                stage.commit(replace=True)
            except BaseException:
                stage.discard()
                raise
        monkeypatch.setattr(os, "rename", real_rename)
        assert _state(final) == (settled, []), which


def test_failed_removal_of_the_old_copy_is_named_and_the_next_run_removes_it(tmp_path):
    """EACCES removing the replaced copy: the commit succeeds (the new output is in place), a
    warning names the directory left, and the next run removes it."""
    final = tmp_path / "out"
    assert _write(final, "old").returncode == 0
    run = _write(final, "new", **{IO_ENV: "cleanup:EACCES"})
    assert run.returncode == 0, run.stderr
    tag, left = _state(final)
    assert tag == "new" and len(left) == 1 and left[0].startswith(".out.replaced-"), left
    assert "StagingWarning: could not remove " + str(tmp_path / left[0]) in run.stderr, run.stderr
    assert "the next run writing the same output removes it" in run.stderr
    settle(str(final))
    assert _state(final) == ("new", [])


def test_a_live_or_foreign_owner_is_never_touched(tmp_path):
    """Leftovers of a running process (this one), of another host and of the old name format stay,
    each named in a warning with its owner; those of a dead owner (this pid, but another start time: the pid was reused) go."""
    final = tmp_path / "out"
    live = Staging.create(str(final))
    host = staging._host()
    foreign = tmp_path / f".out.staging-{os.getpid()}-1-{'0' * 8 if host != '0' * 8 else '1' * 8}-aaaaaaaa"
    old_format = tmp_path / ".out.staging-0123456789ab"
    dead = tmp_path / f".out.staging-{os.getpid()}-1-{host}-bbbbbbbb"
    for path in (foreign, old_format, dead):
        path.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settle(str(final))
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, foreign.name, old_format.name])
    kept = f"it may still be writing {final}, so it is not removed; remove it once no converter writes {final}."
    assert sorted(str(w.message) for w in caught if issubclass(w.category, StagingWarning)) == sorted([
        f"{old_format} was left by an interrupted run of an older mcore_rl (no owner recorded, so it is not "
        f"removed); remove it once no converter writes {final}.",
        f"{foreign} belongs to process {os.getpid()} on another host (host hash {foreign.name[-17:-9]}): {kept}",
        f"{live.path} belongs to process {os.getpid()}, which is still running on this host: {kept}"])  # issue #37/14
    with open(os.path.join(live.path, "tag"), "w") as f:
        f.write("live")
    live.commit(replace=True)
    assert open(final / "tag").read() == "live"


def test_another_running_process_is_untouched_until_it_dies(tmp_path):
    """A concurrently running writer of the same output (another process) keeps its staging
    directory while it runs; killed and not yet reaped (a zombie), it counts as dead."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = f"{child.pid}-{staging._start_ticks(child.pid)}-{staging._host()}-cccccccc"
        (tmp_path / f".out.staging-{ident}").mkdir()
        settle(str(tmp_path / "out"))
        assert os.listdir(tmp_path) == [f".out.staging-{ident}"]
        child.kill()
        for _ in range(1000):  # the kill lands: a zombie until reaped
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        settle(str(tmp_path / "out"))
        assert os.listdir(tmp_path) == []
    finally:
        child.kill()
        child.wait()
