"""CheckpointManager save/load vs plain torch.save/torch.load + fsync of the same bytes per rank,
disk throughput, time an async save blocks the caller and peak extra memory of a save, for
dp_reshardable, model_space and fully_reshardable; megatron's own dist_checkpointing.save beside them.

    torchrun --standalone --nproc_per_node=2 benchmarks/ckpt_save_load.py [--root DIR] [--reps 3]

World of 2, TP=1 DP=2, a fp32 llama (hidden 1024, 2 layers, vocab 32k) after one Adam step.
The plain baseline writes what a hand-written per-rank checkpoint would: the model state dict on
DP rank 0 only (``model.pt``: it is replicated over DP, megatron writes one replica too) and every
rank's DistributedOptimizer shard (fp32 param, exp_avg, exp_avg_sq) in ``rank<r>.pt``, fsynced.
Its load reads what a resume needs: every rank its model replica (``model.pt``) and its own
shard, as the manager's load does. Before every load the files' pages are dropped from the page
cache (POSIX_FADV_DONTNEED), so both loads read the disk. Peak extra memory: summed PSS of the rank and its child processes, sampled
every ~10 ms by a thread, above the pre-save sample, divided by the rank's state bytes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import rank0_print, start, tiny_llama  # noqa: E402
from mcore_rl.checkpoint.storage import fsync_path  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402

FDATASYNC_CEILING_MB_S = 430.0  # this machine's measured fdatasync write ceiling (brief)
CONTENTS = ("model", "optimizer", "extra")


class PssSampler:
    """Samples the summed PSS (bytes) of this process and its children every ``period`` s."""

    def __init__(self, period: float = 0.01):
        self.period, self.proc = period, psutil.Process(os.getpid())
        self.peak, self._stop = 0, threading.Event()

    def sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # a writer child that just exited
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.period)

    def __enter__(self) -> "PssSampler":
        self.baseline = self.sample()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """This rank's DistributedOptimizer shard tensors (fp32 main param, exp_avg, exp_avg_sq)."""
    out = {}
    for o, opt in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                out[f"{o}.{g}.{p}.param"] = param.data
                for name, value in opt.optimizer.state.get(param, {}).items():
                    if torch.is_tensor(value) and value.numel() > 1:
                        out[f"{o}.{g}.{p}.{name}"] = value
    return out


def rank_state(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model's tensors, this rank's optimizer shard): the plain baseline's two parts."""
    model = {f"model{c}.{k}": v for c, chunk in enumerate(engine.model)
             for k, v in chunk.state_dict().items() if torch.is_tensor(v)}
    # a main-param shard views DDP's whole buffer: torch.save would write the whole storage, so
    # the baseline keeps compact copies (made here, outside every timing) to write the same bytes
    opt = {f"opt.{k}": v if v.untyped_storage().nbytes() == v.numel() * v.element_size() else v.clone()
           for k, v in optimizer_tensors(engine).items()}
    return model, opt


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(engine) -> int:
    """The rank's model + Adam optimizer bytes (every model param it holds + its optimizer shard)."""
    model = nbytes(p for chunk in engine.model for p in chunk.parameters())
    return model + nbytes(optimizer_tensors(engine).values())


def plain_files(directory: str) -> tuple[str, str]:
    return os.path.join(directory, "model.pt"), os.path.join(directory, f"rank{torch.distributed.get_rank()}.pt")


def plain_save(parts: tuple[dict, dict], directory: str) -> None:
    """model.pt on DP rank 0, rank<r>.pt everywhere, each fsynced."""
    from megatron.core import parallel_state

    os.makedirs(directory, exist_ok=True)
    model_path, rank_path = plain_files(directory)
    for state, path in ((parts[0], model_path), (parts[1], rank_path)):
        if path == model_path and parallel_state.get_data_parallel_rank() != 0:
            continue
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    fsync_path(directory)


@torch.no_grad()
def plain_load(parts: tuple[dict, dict], directory: str) -> None:
    """Every rank: the model replica and its own optimizer shard."""
    for state, path in zip(parts, plain_files(directory)):
        for k, v in torch.load(path, weights_only=True).items():
            state[k].copy_(v)


def drop_cache(directory: str) -> None:
    """Evicts the (clean, fsynced) pages of every file under ``directory`` from the page cache."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)


def timed(fn, sampler: PssSampler | None = None) -> float:
    torch.distributed.barrier()
    t = time.perf_counter()
    if sampler is None:
        fn()
    else:
        with sampler:
            fn()
    torch.distributed.barrier()
    return time.perf_counter() - t


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t)


def build_engine():
    """A fp32 llama (hidden 1024, 2 layers, vocab 32k), TP=1 DP=2, after one Adam step."""
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.tiny import rl_batch

    layout = ParallelLayout(tp=1)
    platform = start(layout)
    args, weights = tiny_llama(vocab_size=32000, layers=2, hidden=1024)
    engine = ModelEngine(args, layout, "actor", platform, optim=OptimConfig(lr=1e-5), hf_weights=weights)
    del weights
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=4))
    batch = rl_batch(32000, batch=4, prompt=8, response=4, seed=0)  # dispatch gives each DP rank its rows
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"] - 0.1
    batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(0))
    actor.update_policy(batch)  # Adam state exists and differs from zero
    return engine


@torch.no_grad()
def touch_state(engine) -> None:
    """Stands in for training during an async write: changes every state tensor in place (every
    page is written, so the forked writer's copy-on-write snapshot costs its worst case)."""
    for t in {id(t): t for t in (*[p for c in engine.model for p in c.parameters()],
                                 *optimizer_tensors(engine).values())}.values():
        t.add_(0.0 if t.dtype == torch.int64 else 1e-7)


def async_save(manager, engine, step: int) -> tuple[float, float, tuple[float, float, float]]:
    """(seconds the caller is blocked: the save call plus every poll, seconds until the step is
    complete, the blocked time's parts: save call, polls before the last, the last poll).
    Training is stood in for by ``touch_state`` between polls."""
    torch.distributed.barrier()
    t0 = time.perf_counter()
    manager.save(step, {"actor": engine}, {"step": step})
    blocked = call = time.perf_counter() - t0
    touch_state(engine)
    while True:
        # a training step ends with collectives: ranks reach the poll together (a rank waiting
        # in the poll's all-reduce for a slower one is not time the save costs)
        torch.distributed.barrier()
        t = time.perf_counter()
        done = manager.poll()
        last = time.perf_counter() - t
        blocked += last
        if done is not None:
            return blocked, time.perf_counter() - t0, (call, blocked - call - last, last)
        time.sleep(0.05)  # the training loop's next step


def megatron_save(engine, path: str, sharding: str) -> None:
    """megatron's own dist_checkpointing.save (default torch_dist writer) of the same state."""
    from megatron.core import dist_checkpointing

    from mcore_rl.checkpoint.state import sharded_state

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(sharded_state(engine, ("model", "optimizer", "extra"), sharding, is_loading=False),
                            path, sharded_strategy=("torch_dist", 1))


def bench_sharding(engine, root: str, sharding: str, reps: int, step0: int) -> None:
    """Alternating manager (sync, async), megatron and plain saves and loads; prints medians and ratios."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    rank = torch.distributed.get_rank()

    def make(kind: str, **kw) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(root=os.path.join(root, f"{sharding}_{kind}"), optimizer_sharding=sharding,
                                                  save_contents=CONTENTS, load_contents=CONTENTS, **kw))

    manager, pending = make("sync"), make("async", async_save=True)
    plain_dir = os.path.join(root, f"plain_{sharding}")
    state, mine = rank_state(engine), state_bytes(engine)
    sizes_only = make("sync", verify_content=False)  # loads without the content (CRC-32) pass
    r = {k: [] for k in ("ms", "ps", "ml", "mu", "pl", "mm", "pm", "ab", "at", "am", "gs", "gm", "ac", "ap", "af")}
    written = {}
    for i in range(reps):
        step = 2 * (step0 + i)  # even: timed saves; odd: the same saves with the memory sampler
        megatron_dir = os.path.join(root, f"megatron_{sharding}_{i}")
        r["ms"].append(timed(lambda: manager.save(step, {"actor": engine}, {"step": step})))
        r["ps"].append(timed(lambda: plain_save(state, plain_dir)))
        r["gs"].append(timed(lambda: megatron_save(engine, megatron_dir, sharding)))
        blocked, total, parts = async_save(pending, engine, step)
        r["ab"].append(max_over_ranks(blocked))
        r["at"].append(max_over_ranks(total))
        for key, part in zip(("ac", "ap", "af"), parts):
            r[key].append(max_over_ranks(part))
        # PSS sampling reads /proc/<pid>/smaps, which contends with fork and page faults for the
        # process's memory map lock: memory is measured in separate runs of the same saves
        sm, sp, sa, sg = PssSampler(), PssSampler(), PssSampler(), PssSampler()
        timed(lambda: manager.save(step + 1, {"actor": engine}, {"step": step + 1}), sm)
        timed(lambda: plain_save(state, plain_dir), sp)
        timed(lambda: megatron_save(engine, megatron_dir + "_mem", sharding), sg)
        with sa:
            async_save(pending, engine, step + 1)
        for key, sampler in (("mm", sm), ("pm", sp), ("am", sa), ("gm", sg)):
            r[key].append(max_over_ranks(sampler.extra / mine))
        step_dir = manager.step_dir(step)
        written = {"m": dir_bytes(step_dir) if rank == 0 else 0, "p": dir_bytes(plain_dir) if rank == 0 else 0}
        drop_cache(step_dir)
        r["ml"].append(timed(lambda: manager.load(step_dir, {"actor": engine}, CONTENTS)))
        drop_cache(step_dir)
        r["mu"].append(timed(lambda: sizes_only.load(step_dir, {"actor": engine}, CONTENTS)))
        drop_cache(plain_dir)
        r["pl"].append(timed(lambda: plain_load(state, plain_dir)))
        torch.distributed.barrier()
        if rank == 0:  # keep the disk small; outside the timings
            for path in (megatron_dir, megatron_dir + "_mem", pending.step_dir(step), pending.step_dir(step + 1),
                         manager.step_dir(step + 1)):
                shutil.rmtree(path)
            if i < reps - 1:
                shutil.rmtree(step_dir)
        torch.distributed.barrier()
    report(sharding, reps, mine, written, r)


def report(sharding: str, reps: int, mine: int, written: dict, r: dict) -> None:
    med = {k: statistics.median(v) for k, v in r.items()}
    m_bytes, p_bytes = written["m"], written["p"]
    rank0_print(f"\n[{sharding}] state per rank (model + Adam shard): {mine / 2**20:.0f} MiB; "
                f"written per save: manager {m_bytes / 2**20:.0f} MiB, plain {p_bytes / 2**20:.0f} MiB "
                f"(all ranks); medians of {reps} alternating runs")
    rank0_print(f"  save: manager {med['ms']:.2f} s, plain {med['ps']:.2f} s, ratio {med['ms'] / med['ps']:.2f}x "
                f"(goal {'<= 1.0x' if sharding == 'dp_reshardable' else '<= 1.2x'}); megatron's own save {med['gs']:.2f} s = {med['gs'] / med['ps']:.2f}x   "
                f"all runs manager {fmt(r['ms'])} plain {fmt(r['ps'])} megatron {fmt(r['gs'])}")
    rank0_print(f"  load: manager {med['ml']:.2f} s, plain {med['pl']:.2f} s, ratio {med['ml'] / med['pl']:.2f}x "
                f"(goal <= 1.1x, content verified); without the content check (verify_content=False) {med['mu']:.2f} s = "
                f"{med['mu'] / med['pl']:.2f}x   all runs manager {fmt(r['ml'])} sizes only {fmt(r['mu'])} "
                f"plain {fmt(r['pl'])}")
    rank0_print(f"  disk write throughput: manager {m_bytes / 2**20 / med['ms']:.0f} MB/s, plain "
                f"{p_bytes / 2**20 / med['ps']:.0f} MB/s, ceiling ~{FDATASYNC_CEILING_MB_S:.0f} MB/s (fdatasync); "
                f"manager at {m_bytes / 2**20 / med['ms'] / FDATASYNC_CEILING_MB_S:.0%} of it")
    rank0_print(f"  async save: training blocked {med['ab']:.3f} s = {med['ab'] / med['ms']:.1%} of the sync save "
                f"(goal <= 5%); complete after {med['at']:.2f} s   all runs blocked {fmt(r['ab'])}")
    rank0_print(f"    blocked in (medians, max over ranks): the save call {med['ac']:.3f} s, the polls before "
                f"the last {med['ap']:.3f} s, the last poll (finalize) {med['af']:.3f} s   all runs save call "
                f"{fmt(r['ac'], 3)} polls {fmt(r['ap'], 3)} last poll {fmt(r['af'], 3)}")
    rank0_print(f"  peak extra memory during save (max over ranks, PSS incl. children / state bytes): "
                f"manager sync {med['mm']:.2f}x (goal <= 0.25x), async {med['am']:.2f}x with every state "
                f"page rewritten during the write (goal <= 1.1x); plain {med['pm']:.2f}x, megatron {med['gm']:.2f}x")


def checksum_throughput() -> None:
    """The content checksum's own speed (GB/s) on one 256 MiB buffer in memory, beside a memcpy."""
    from mcore_rl.fileio.checksum import ALGORITHM, Hasher, LEGACY

    buf = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy()
    out = torch.empty(256 << 20, dtype=torch.uint8).numpy()
    rates = {}
    for name in (ALGORITHM, LEGACY, "memcpy"):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            if name == "memcpy":
                out[:] = buf
            else:
                hasher = Hasher(name)
                hasher.update(memoryview(buf))
                hasher.value()
            best = min(best, time.perf_counter() - t)
        rates[name] = buf.nbytes / best / 1e9
    rank0_print(f"\ncontent checksum {ALGORITHM}: {rates[ALGORITHM]:.2f} GB/s (CRC-32 of older steps "
                f"{rates[LEGACY]:.2f} GB/s; memcpy {rates['memcpy']:.2f} GB/s), one 256 MiB buffer, best of 3")


def fmt(values: list[float], digits: int = 2) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def profile_save(engine, root: str, sharding: str, step: int) -> None:
    """One manager save under cProfile on every rank; rank 0 prints its top functions."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(CheckpointConfig(root=os.path.join(root, f"profile_{sharding}"),
                                                 optimizer_sharding=sharding))
    torch.distributed.barrier()
    prof = cProfile.Profile()
    prof.enable()
    manager.save(step, {"actor": engine}, {"step": step})
    prof.disable()
    for order, top in (("tottime", 12), ("cumulative", 30)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()][3:]
        rank0_print(f"\n[profile {sharding}] rank 0, one manager save, top by {order}:")
        rank0_print("\n".join(ln.replace("/work/main/.venv/lib/python3.11/site-packages/", "")[:170]
                               for ln in lines))


SHARDINGS = ("dp_reshardable", "model_space", "fully_reshardable")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/mcore_rl_ckpt_bench")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile one extra manager save")
    parser.add_argument("--formats", default=",".join(SHARDINGS),
                        help="comma-separated optimizer_sharding formats to measure")
    opts = parser.parse_args()
    engine = build_engine()
    root = os.path.abspath(opts.root)
    if torch.distributed.get_rank() == 0 and os.path.isdir(root):
        shutil.rmtree(root)
    torch.distributed.barrier()
    try:
        checksum_throughput()
        formats = [f for f in opts.formats.split(",") if f]
        unknown = [f for f in formats if f not in SHARDINGS]
        if unknown:
            raise SystemExit(f"--formats {opts.formats!r}: unknown {unknown}; use any of {', '.join(SHARDINGS)}")
        for n, sharding in enumerate(formats):
            bench_sharding(engine, root, sharding, opts.reps, step0=100 * (n + 1))
        if opts.profile:
            for n, sharding in enumerate(formats):
                profile_save(engine, root, sharding, step=1000 + n)
    finally:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
