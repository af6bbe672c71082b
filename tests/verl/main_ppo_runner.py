"""verl's RL entry point, ``python -m verl.trainer.main_ppo``, as the tests launch it on 2 CPU cores.

One Ray head per test module (``RayHead``: started by ``ray.init`` in the test process, 2 fake
GPUs so verl's GPU count is met, enough logical CPUs for verl's TaskRunner, TransferQueue, agent
and reward workers; stopped with ``ray.shutdown``, then any process it started that is still
alive is killed by its pid — never other Ray processes on the machine).
Each launch is its own Ray job on that head; its metrics come from verl's file logger (JSON lines,
exact floats) and its generations from ``trainer.rollout_data_dir`` (one JSON line per sample).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
       "RAY_DEDUP_LOGS": "0", "HYDRA_FULL_ERROR": "1"}
SEARCH_PATH = "hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]"
# verl's asynchronous trainers keep their configs next to their code and find verl's ppo_trainer
# through a search path of their own, which the command line's replaces: it is named again.
ASYNC_SEARCH_PATH = "hydra.searchpath=[pkg://verl.trainer.config,pkg://mcore_rl.integrations.verl.hydra]"


@dataclass
class Run:
    """A finished (or killed) launch: exit code, metrics by step, generations by step, output."""

    returncode: int
    metrics: dict[int, dict[str, float]]
    generations: dict[int, list[dict]] = field(default_factory=dict)
    log: str = ""

    def tail(self, chars: int = 6000) -> str:
        return self.log[-chars:]


class RayHead:
    """A local Ray head for the module's launches (``address`` for ``ray_kwargs.ray_init``)."""

    def __init__(self, num_cpus: int = 8, num_gpus: int = 2) -> None:
        self.num_cpus, self.num_gpus, self.address = num_cpus, num_gpus, None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "RayHead":
        import ray

        for key, value in ENV.items():  # the raylet's workers inherit them
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        info = ray.init(num_cpus=self.num_cpus, num_gpus=self.num_gpus, include_dashboard=False,
                        log_to_driver=False)
        self.address = info.address_info["gcs_address"]
        self._started = psutil.Process().children(recursive=True)  # gcs, raylet, ... (the head's)
        return self

    def __exit__(self, *exc) -> None:
        import ray

        started = {p.pid: p for p in self._started + psutil.Process().children(recursive=True)}  # + its workers
        ray.shutdown()
        _, alive = psutil.wait_procs(list(started.values()), timeout=10)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch(head: RayHead, workdir: str, overrides: list[str], job_env: dict[str, str] | None = None,
           timeout_s: float = 600, module: str = "verl.trainer.main_ppo") -> Run:
    """Runs ``module`` (verl's main_ppo, or one of its asynchronous trainers' entry points) with
    ``overrides`` on ``head``; ``job_env`` reaches every process of the job. A launch that failed
    before its first step because it lost verl's port race (``lost_port_race``) runs once more."""
    run = _launch_once(head, workdir, overrides, job_env, timeout_s, module)
    if run.returncode != 0 and not run.metrics and lost_port_race(run.log):
        os.rename(workdir, workdir + ".port_race")  # the failed attempt's files, kept for reading
        print(f"[test] {module} relaunched: a process group's port was taken between verl's choice "
              f"and its bind (EADDRINUSE; see {workdir}.port_race)", file=sys.stderr)
        run = _launch_once(head, workdir, overrides, job_env, timeout_s, module)
        run.log += "\n[test] the first attempt lost verl's port race (EADDRINUSE), this is the second"
    return run


def lost_port_race(log: str) -> bool:
    """verl picks a worker group's ``MASTER_PORT`` by binding port 0 and closing it; the group's
    TCPStore binds it seconds later, when workers have started. Any connection opened on the machine
    in between (gloo's, the main suite's beside this one) may take it: the launch fails at start-up,
    before a step, with ``EADDRINUSE`` from ``_create_c10d_store``. Nothing the test checks."""
    return "_create_c10d_store" in log and "EADDRINUSE" in log


def _launch_once(head: RayHead, workdir: str, overrides: list[str], job_env: dict[str, str] | None,
                 timeout_s: float, module: str) -> Run:
    os.makedirs(workdir, exist_ok=True)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    dumps = os.path.join(workdir, "generations")
    env_vars = {"VERL_FILE_LOGGER_PATH": metrics_path, **(job_env or {})}
    search = SEARCH_PATH if module == "verl.trainer.main_ppo" else ASYNC_SEARCH_PATH
    cmd = [sys.executable, "-m", module, search, *overrides,
           "trainer.logger=[console,file]", f"trainer.rollout_data_dir={dumps}",
           f"+ray_kwargs.ray_init.address={head.address}", "ray_kwargs.ray_init.num_cpus=null",
           *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in env_vars.items())]  # strings
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=workdir, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[test] {module} killed after {timeout_s} s"
    out += f"\n[test] {module} took {time.time() - started:.0f} s"
    return Run(proc.returncode, read_metrics(metrics_path), read_generations(dumps), out)


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    """verl's file logger: one JSON object per step, ``{"step": N, "data": {...}}``."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {row["step"]: row["data"] for row in rows}


def read_generations(directory: str) -> dict[int, list[dict]]:
    """``trainer.rollout_data_dir``: ``<step>.jsonl`` with input, output, ground truth, score."""
    out = {}
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path) as f:
            out[int(os.path.basename(path).split(".")[0])] = [json.loads(line) for line in f if line.strip()]
    return out
