"""Imports megatron-core and transformers once so forked ranks (tests/dist.py) skip that cost."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile (megatron's jit_fuser functions) in forked ranks: compile in the compiling process
# (no worker pool a fork could inherit half-alive) and in a cache of this test session's own, so
# concurrent sessions (the main and verl suites of `make test`, a developer's run) never wait on
# each other's cache locks (inductor waits up to 600 s for one: ranks hung for exactly that long)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="mcore_rl_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import transformers  # noqa: E402,F401

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def straight_job(tmp_path_factory) -> str:
    """Output dir of one uninterrupted 10-step run of the main job through launch/run.sh
    (tests/job_runs.py), the reference the kill/resume tests of both checkpoint files share."""
    from tests.job_runs import straight_run

    return straight_run(tmp_path_factory.mktemp("straight_job") / "straight")


def file_times(reports) -> list[tuple[str, int, float]]:
    """(file, tests, seconds) per test file, slowest first: each test's setup, call and teardown
    durations summed under the file of its node id (a module fixture's setup counts in its file)."""
    seconds: dict[str, float] = {}
    tests: dict[str, set] = {}
    for rep in reports:
        if getattr(rep, "when", None) not in ("setup", "call", "teardown"):
            continue
        path = rep.nodeid.split("::", 1)[0]
        seconds[path] = seconds.get(path, 0.0) + rep.duration
        tests.setdefault(path, set()).add(rep.nodeid)
    return sorted(((p, len(tests[p]), s) for p, s in seconds.items()), key=lambda row: (-row[2], row[0]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Prints the per-file time table (file, tests, seconds; slowest first) at the end of a run."""
    # passed setups and teardowns are filed under the category "" (a module fixture's cost)
    reports = [rep for reps in terminalreporter.stats.values() for rep in reps]
    rows = file_times(reports)
    if not rows:
        return
    terminalreporter.write_sep("=", "time per test file (setup + call + teardown)")
    width = max(len(p) for p, _, _ in rows)
    terminalreporter.write_line(f"{'file':<{width}}  {'tests':>5}  {'seconds':>8}")
    for path, count, secs in rows:
        terminalreporter.write_line(f"{path:<{width}}  {count:>5}  {secs:>8.1f}")
    total = sum(secs for _, _, secs in rows)
    terminalreporter.write_line(f"{'total':<{width}}  {sum(c for _, c, _ in rows):>5}  {total:>8.1f}")
