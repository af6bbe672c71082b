"""Background HF exports of the main job's CheckpointManager (``hf_model`` in save_contents), at
world 1 on a model started from a block-FP8 HF checkpoint (dequantized at load):

- ``hf_dtype=fp8`` (the exporter-kill root below, exported again by its rerun): the step's HF
  dir equals ``merge --dtype fp8`` of the step byte for byte (every file but the export's
  record), config.json (written at the save) included;
- ``max_ckpt_to_keep=1`` while an export runs (held after its first weight file moved): the
  step being exported stays until a later retention, the queued export of a step retention
  deletes is dropped (one line), no export fails (none read a deleted step), and the kept steps'
  exports are complete; a save that replaces a step whose export runs kills that export first
  (one line) and the new step gets its own export (its record names the new marker);
- the exporter SIGKILLed at each phase (merge staged / first file moved / all moved, no record):
  the failure is raised at ``wait_exports``, at the next ``save`` and at ``close``, naming step,
  role, node and "killed by signal 9"; every such step is partial, never complete;
- the whole job SIGKILLed while its exporter is held at each phase (three jobs, steps 1-3 of one
  root): the exporter dies with it, the step's export is partial;
- a rerun (resume) cleans every partial export (one warning line) and exports again, with
  superseding only the newest step (one line naming the steps left without HF weights); what it
  writes equals ``merge``.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from mcore_rl.fileio.faults import ENV, HOLD_ENV, HOLD_ONLY_ENV
from tests.ckpt_bodies import alive, build_engine, error_of, manager, train
from tests.dist import run_ranks

HF = ("model", "optimizer", "extra", "hf_model")
PHASES = ("merge", "move", "record")
RECORD = "mcore_rl_export.json"


def fp8_source(base: str) -> str:
    """A tiny llama whose linear weights are block FP8 (128x128, float scales) with its
    ``quantization_config``: an FP8-published model."""
    from safetensors.torch import load_file, save_file

    from mcore_rl.mapping.fp8_quant import SCALE_SUFFIX, BlockFp8, is_quantized, quantize_block_fp8
    from tests.tiny import tiny_config, tiny_hf_model

    plain, src = os.path.join(base, "hf_plain"), os.path.join(base, "hf_fp8")
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(plain)
    out = {}
    for name, t in load_file(os.path.join(plain, "model.safetensors")).items():
        if is_quantized(name, tuple(t.shape)):
            out[name], out[name + SCALE_SUFFIX] = quantize_block_fp8(t.float(), BlockFp8(), name)
        else:
            out[name] = t
    os.makedirs(src)
    save_file(out, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(plain, "config.json")))
    config["quantization_config"] = BlockFp8().quantization_config()
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    return src


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _listen() -> _Lines:
    handler = _Lines()
    logger = logging.getLogger("mcore_rl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _command(**env: str):
    """The worker's command with ``env`` set for the exporter alone."""
    from mcore_rl.checkpoint.export_queue import worker_command

    return lambda task, threads: ["env", *(f"{k}={v}" for k, v in env.items()), *worker_command(task, threads)]


def _state(root: str, step: int) -> str:
    from mcore_rl.checkpoint.hf_export_record import export_state

    return export_state(os.path.join(root, f"global_step_{step}", "actor"))


def _steps(root: str) -> list[int]:
    return sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))


def _wait_file(where: str, prefix: str, timeout: float = 120.0) -> str:
    deadline = time.time() + timeout
    while True:
        found = [n for n in os.listdir(where) if n.startswith(prefix)]
        if found:
            return found[0]
        assert time.time() < deadline, f"no {prefix}* in {where}"
        time.sleep(0.02)


def _retention_while_exporting(engine, src: str, base: str) -> dict:
    """keep=1, no superseding; step 1's export held after its first weight file moved."""
    from mcore_rl.checkpoint.export_queue import ExportQueue

    root, hold = f"{base}/keep1", f"{base}/hold_keep1"
    os.makedirs(hold)
    queue = ExportQueue(supersede=False, command=_command(**{HOLD_ENV: hold, HOLD_ONLY_ENV: "hf_export_move"}))
    mgr = manager(root, {"actor": src}, queue, save_contents=HF, max_ckpt_to_keep=1)
    lines, out = _listen(), {}
    mgr.save(1, {"actor": engine}, {"step": 1})
    _wait_file(hold, "hf_export_move.")
    out["held"] = (_state(root, 1), queue.running_steps())
    for step in (2, 3):
        mgr.save(step, {"actor": engine}, {"step": step})
        out[f"dirs_{step}"] = (_steps(root), queue.running_steps(), queue.queued_steps())
    open(os.path.join(hold, "release"), "w").close()
    mgr.wait_exports()
    out["kept"] = {s: _state(root, s) for s in _steps(root)}
    os.remove(os.path.join(hold, "release"))
    mgr.save(4, {"actor": engine}, {"step": 4})  # retention catches up with the deferred step
    out["dirs_4"] = _steps(root)
    while len([n for n in os.listdir(hold) if n.startswith("hf_export_move.")]) < 3:
        time.sleep(0.02)  # step 4's export held after its first file moved
    out["replacing"] = queue.running_steps()
    mgr.save(4, {"actor": engine}, {"step": 4})  # replaces step 4: its running export is killed first
    open(os.path.join(hold, "release"), "w").close()
    mgr.wait_exports()  # the new step 4's export (the killed one's partial files went with the old copy)
    marker = os.path.join(root, "global_step_4", "COMPLETE")
    from mcore_rl.fileio.checksum import file_checksum

    record = json.load(open(os.path.join(root, "global_step_4", "actor", "huggingface", RECORD)))
    out["final"] = (_steps(root), _state(root, 4), record["source"] == file_checksum(marker)[1])
    mgr.close()
    out["lines"] = lines.lines
    logging.getLogger("mcore_rl").removeHandler(lines)
    return out


def _exporter_killed(engine, src: str, base: str) -> dict:
    """Steps 1-3, the exporter of each SIGKILLed at one phase; where each failure surfaces."""
    from mcore_rl.checkpoint.export_queue import ExportQueue, worker_command

    phase = {"now": ""}
    queue = ExportQueue(command=lambda t, n: ["env", f"{ENV}=hf_export_{phase['now']}", *worker_command(t, n)])
    root = f"{base}/killed"
    mgr, out = manager(root, {"actor": src}, queue, save_contents=HF, hf_dtype="fp8"), {}
    phase["now"] = "merge"
    mgr.save(1, {"actor": engine}, {"step": 1})
    out["wait_exports"] = error_of(mgr.wait_exports)
    phase["now"] = "move"
    mgr.save(2, {"actor": engine}, {"step": 2})
    while queue.busy():
        time.sleep(0.02)
    phase["now"] = "record"
    out["save"] = error_of(lambda: mgr.save(3, {"actor": engine}, {"step": 3}))
    out["again"] = error_of(lambda: mgr.save(3, {"actor": engine}, {"step": 3}))  # raised once: this one saves
    while queue.busy():
        time.sleep(0.02)
    out["close"] = error_of(mgr.close)
    out["states"] = {s: _state(root, s) for s in (1, 2, 3)}
    out["hf_dirs"] = {s: sorted(os.listdir(f"{root}/global_step_{s}/actor/huggingface")) for s in (1, 2, 3)}
    return out


def _saves(src: str, base: str) -> dict:
    """World 1: the FP8 export, retention while exporting, the exporter killed, and steps for
    the job-kill runs (saved with an exporter that exports nothing)."""
    from mcore_rl.checkpoint.export_queue import ExportQueue

    engine, model = build_engine(src, {}, "actor", False, seed=1)
    train(model, range(1))  # away from the source's values
    out = {"keep1": _retention_while_exporting(engine, src, base), "killed": _exporter_killed(engine, src, base)}
    jobs = manager(f"{base}/jobs", {"actor": src}, ExportQueue(command=lambda t, n: ["true"]), save_contents=HF)
    for step in (1, 2, 3):  # exported by the killed jobs below, one phase each
        jobs.save(step, {"actor": engine}, {"step": step})
    return out


def _job_holding_an_export(root: str, step: int, phase: str, hold: str, out) -> None:
    """The 'job': a process whose export queue exports ``step``, held at ``phase``."""
    from mcore_rl.checkpoint.export_queue import ExportQueue
    from mcore_rl.checkpoint.hf_export import ExportSpec

    queue = ExportQueue(command=_command(**{HOLD_ENV: hold, HOLD_ONLY_ENV: f"hf_export_{phase}"}))
    queue.submit(step, {"actor": f"{root}/global_step_{step}/actor"}, ExportSpec())
    out.put(int(_wait_file(hold, f"hf_export_{phase}.").split(".")[-1]))
    time.sleep(600)


def _reruns(src: str, base: str) -> dict:
    """The rerun of every root with partial exports: resume, then wait for the exports."""
    engine, _ = build_engine(src, {}, "actor", False, seed=2)
    out, managers = {}, []
    for name in ("killed", "jobs"):  # each resumes; their exports run at once
        lines = _listen()
        mgr = manager(f"{base}/{name}", {"actor": src}, save_contents=HF, hf_dtype="fp8" if name == "killed" else None)
        out[name] = {"state": mgr.resume({"actor": engine}), "lines": lines.lines}
        managers.append(mgr)
        logging.getLogger("mcore_rl").removeHandler(lines)
    for mgr in managers:
        mgr.wait_exports()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hf_exports"))
    src = fp8_source(base)
    saved = run_ranks(1, _saves, src, base, daemon=False)[0]
    ctx, jobs = mp.get_context("fork"), {}
    for step, phase in enumerate(PHASES, 1):  # three jobs at once, each held at its phase, then killed
        hold = f"{base}/hold_{phase}"
        os.makedirs(hold)
        pids = ctx.Queue()
        proc = ctx.Process(target=_job_holding_an_export, args=(f"{base}/jobs", step, phase, hold, pids))
        proc.start()
        jobs[phase] = (proc, pids)
    exporters = {phase: pids.get(timeout=120) for phase, (_, pids) in jobs.items()}
    for proc, _ in jobs.values():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    job_states = {p: _state(f"{base}/jobs", step) for step, p in enumerate(PHASES, 1)}
    rerun = run_ranks(1, _reruns, src, base, daemon=False)[0]
    return {"base": base, "saved": saved, "exporters": exporters, "job_states": job_states, "rerun": rerun}


def same_as_merge(role_dir: str, target: str, **kw) -> list[str]:
    """The files of ``role_dir``'s HF dir (but the export's record) that differ from, or are
    missing in, ``merge``'s output of the same step (and the other way round)."""
    from mcore_rl.conversion.merge import merge

    merge(role_dir, target, **kw)
    hf_dir = os.path.join(role_dir, "huggingface")
    names = sorted(set(os.listdir(hf_dir)) | set(os.listdir(target)) - {RECORD})
    return [n for n in names if n != RECORD and (not os.path.isfile(os.path.join(hf_dir, n))
            or not os.path.isfile(os.path.join(target, n))
            or open(os.path.join(hf_dir, n), "rb").read() != open(os.path.join(target, n), "rb").read())]


def test_fp8_export_equals_merge_dtype_fp8(runs, tmp_path):
    role_dir = f"{runs['base']}/killed/global_step_3/actor"  # exported again by the rerun, hf_dtype=fp8
    assert _state(f"{runs['base']}/killed", 3) == "complete"
    assert same_as_merge(role_dir, str(tmp_path / "merged"), dtype="fp8") == []
    config = json.load(open(f"{role_dir}/huggingface/config.json"))
    assert config["quantization_config"]["quant_method"] == "fp8", config  # written at the save, as merge's
    from safetensors.torch import load_file

    weights = load_file(f"{role_dir}/huggingface/model.safetensors")
    assert sum(t.dtype == torch.float8_e4m3fn for t in weights.values()) >= 7, {k: t.dtype for k, t in weights.items()}


def test_retention_and_replacement_while_exporting(runs):
    k = runs["saved"]["keep1"]
    assert k["held"] == ("partial", {1})  # held after its first weight file moved in
    assert k["dirs_2"] == ([1, 2], {1}, [2])  # step 1 kept while its export runs
    assert k["dirs_3"] == ([1, 3], {1}, [3])  # step 2 deleted, its queued export dropped
    assert k["kept"] == {1: "complete", 3: "complete"}
    assert k["dirs_4"] == [4] and k["replacing"] == {4}
    assert k["final"] == ([4], "complete", True), k["final"]  # the new step 4's export, of its own marker
    cancelled = [ln for ln in k["lines"] if "cancelled" in ln]
    assert cancelled == ["HF export of step 4 cancelled: the step is being replaced by a new save"], k["lines"]
    dropped = [ln for ln in k["lines"] if "dropped" in ln]
    assert dropped == ["HF export of step(s) [2] dropped: retention removes the step(s)"], k["lines"]
    kept = [ln for ln in k["lines"] if ln.startswith("retention: keeping")]
    assert kept == ["retention: keeping step(s) [1] while their HF export runs (removed by a later retention)"] * 2


def test_exporter_killed_at_each_phase_is_raised_and_never_complete(runs):
    k = runs["saved"]["killed"]
    for where, step in (("wait_exports", 1), ("save", 2), ("close", 3)):
        error = k[where]
        assert error is not None and f"the HF export of step {step} role actor on node 0 failed" in error, (where, error)
        assert "the exporter was killed by signal 9 (SIGKILL)" in error and "mcore_to_hf.py merge" in error, error
    assert k["again"] is None  # each failure is raised once
    assert k["states"] == {1: "partial", 2: "partial", 3: "partial"}, k
    weights = {s: [n for n in names if n.startswith("model")] for s, names in k["hf_dirs"].items()}
    # merge: nothing moved; move: the first (here the only) weight file moved; record: all, no record
    assert weights == {1: [], 2: ["model.safetensors"], 3: ["model.safetensors"]}, k["hf_dirs"]
    assert not any(RECORD in names for names in k["hf_dirs"].values()), k["hf_dirs"]


def test_whole_job_killed_at_each_export_phase(runs):
    deadline = time.time() + 10
    while any(alive(p) for p in runs["exporters"].values()) and time.time() < deadline:
        time.sleep(0.02)
    survivors = [p for p in runs["exporters"].values() if alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "an exporter outlived its killed job"
    assert runs["job_states"] == {"merge": "partial", "move": "partial", "record": "partial"}


def test_rerun_cleans_partial_exports_and_exports_again(runs, tmp_path):
    base, rerun = runs["base"], runs["rerun"]
    killed = rerun["killed"]
    assert killed["state"] == {"step": 3}
    warned = [ln for ln in killed["lines"] if ln.startswith("removed partial HF export")]
    assert len(warned) == 1 and all(f"global_step_{s}/" in warned[0] for s in (1, 2, 3)), killed["lines"]
    again = [ln for ln in killed["lines"] if ln.startswith("HF exports missing")]
    assert again == ["HF exports missing or partial for step(s) [1, 2, 3]: exporting [3] again in the background; "
                     "step(s) [1, 2] are left without HF weights (checkpoint.hf_export_supersede; "
                     "`mcore_to_hf.py merge` writes them)"], killed["lines"]
    assert {s: _state(f"{base}/killed", s) for s in (1, 2, 3)} == {1: "absent", 2: "absent", 3: "complete"}
    # (step 3 equals merge --dtype fp8: test_fp8_export_equals_merge_dtype_fp8)
    jobs = rerun["jobs"]  # the killed jobs' steps: 1 held at merge, 2 at move, 3 at record
    assert jobs["state"] == {"step": 3}
    warned = [ln for ln in jobs["lines"] if ln.startswith("removed partial HF export")]
    assert len(warned) == 1 and all(f"global_step_{s}/" in warned[0] for s in (1, 2, 3)), jobs["lines"]
    assert [ln for ln in jobs["lines"] if ln.startswith("HF exports missing")] == [again[0]], jobs["lines"]
    assert {s: _state(f"{base}/jobs", s) for s in (1, 2, 3)} == {1: "absent", 2: "absent", 3: "complete"}
    assert same_as_merge(f"{base}/jobs/global_step_3/actor", str(tmp_path / "jobs3")) == []
