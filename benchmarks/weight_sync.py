"""One full trainer -> rollout weight sync (``sync_weights``, bucket by bucket) against a baseline
that gathers the same tensors into one dict (``export_hf``) and calls ``load_state_dict`` on the
rollout model; time and peak extra memory on the engine rank, alternately, medians, ratios.

    torchrun --standalone --nproc_per_node=1 benchmarks/weight_sync.py --tp 1 [--repeat 3] [--bucket-mb 256]
    torchrun --standalone --nproc_per_node=2 benchmarks/weight_sync.py --tp 2

Model: SmolLM2-135M's shape with heads that split over TP=2 (hidden 576, 8 heads, 4 KV heads,
head_dim 72, intermediate 1536, 30 layers (``--layers``), vocab 49152, tied embeddings; SmolLM2
itself has 9 heads), random fp32 weights; the actor is a trainable ``ModelEngine`` (DDP-wrapped
chunks, optimizer), the rollout a ``TransformersRollout`` on rank 0 (both from one temporary HF
dir). The export leaves out the tied ``lm_head.weight``; the baseline's
``load_state_dict(strict=False)`` must report it as the only missing key (the run fails
otherwise), and tying makes it the embedding.

Peak extra memory: rank 0's peak RSS during the op (the kernel's VmHWM, reset before it; RSS
sampled every ~1 ms by a thread where that reset is not allowed) minus its RSS just before it.
RSS is made to follow live tensor bytes: glibc's mmap threshold is fixed at 64 KiB (``mallopt``;
by default it grows to 32 MiB and freed smaller tensors stay in the heap, counted until the op
ends), and ``gc.collect()`` + ``malloc_trim(0)`` run before each op. ``--glibc-default`` skips
the mallopt (what a plain process holds from the OS; fewer page faults, so somewhat faster).
Columns: median wall time, its range, median CPU time of rank 0, median and max extra over the
measured runs, max |retained| (RSS after the op, collected and trimmed, minus before: ~0 unless it
leaks); one warm-up pair is left out. Goals (issue #17): sync time <= 1.5x the baseline's;
extra <= one bucket + the largest tensor. Wall times on a 2-core machine are noisy under load
(the header prints the load average); the CPU-time ratio is the steadier figure then.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import start  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402

MIB = 1 << 20
_LIBC = ctypes.CDLL("libc.so.6")


def _hwm() -> int:
    """The kernel's peak RSS of this process since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


class PeakRss:
    """Context manager: peak RSS above the RSS at entry (bytes). The kernel's high-water mark,
    reset at entry (``/proc/self/clear_refs``: exact, no thread); a thread sampling RSS every
    ~1 ms where it cannot be reset (it may miss short peaks when the CPU is busy)."""

    def __init__(self, interval: float = 1e-3) -> None:
        self.proc, self.interval, self.thread = psutil.Process(), interval, None

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRss":
        gc.collect()
        _LIBC.malloc_trim(0)  # freed heap pages back to the OS: reuse would hide growth
        self.base = self.peak = self.proc.memory_info().rss
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := current RSS
        except OSError:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.thread is None:
            self.peak = _hwm()
        else:
            self.stop.set()
            self.thread.join()
        self.extra = max(self.peak, self.proc.memory_info().rss) - self.base
        gc.collect()
        _LIBC.malloc_trim(0)
        self.retained = self.proc.memory_info().rss - self.base


def write_model(layers: int) -> str:
    """A random fp32 llama of SmolLM2-135M's size, heads divisible by 2, saved to a temp dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="weight_sync_")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def measure(fn: Callable[[], None], mine: bool) -> tuple[float, float, PeakRss | None]:
    """Wall time of a collective ``fn`` (barriers on both sides), this process's CPU time (less
    sensitive to other load) and, on rank 0, its memory."""
    torch.distributed.barrier()
    with PeakRss() if mine else contextlib.nullcontext() as mem:
        t, cpu = time.perf_counter(), time.process_time()
        fn()
        torch.distributed.barrier()  # the op ends when every rank is done
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    return elapsed, cpu, mem


def main() -> None:
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from mcore_rl.rollout.engine import DEFAULT_SYNC_BUCKET_BYTES, sync_weights
    from mcore_rl.rollout.group import replica_group
    from mcore_rl.rollout.hf_generate import TransformersRollout

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=30, help="decoder layers (30 = SmolLM2-135M)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_SYNC_BUCKET_BYTES / MIB)
    p.add_argument("--repeat", type=int, default=3, help="measured (sync, baseline) pairs after one warm-up")
    p.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    a = p.parse_args()
    if not a.glibc_default:
        assert _LIBC.mallopt(-3, 64 << 10) == 1  # M_MMAP_THRESHOLD: RSS rises and falls with each tensor

    layout = ParallelLayout(tp=a.tp)
    platform = start(layout)
    rank = torch.distributed.get_rank()
    box = [write_model(a.layers) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)  # one directory for every rank (one machine)
    hf_dir = box[0]
    try:
        args = model_args_from_hf(hf_dir)
        engine = ModelEngine(args, layout, "actor", platform, BuildOptions(), OptimConfig(lr=1e-5), hf_dir)
        mine = rank == replica_group()[0]  # the engine lives on the replica's first rank
        rollout = TransformersRollout(hf_dir) if mine else None
    finally:
        torch.distributed.barrier()  # every rank has read the directory
        if rank == 0:
            shutil.rmtree(hf_dir)
    bucket = int(a.bucket_mb * MIB)
    if mine:
        model = rollout.model
        assert model.lm_head.weight is model.model.embed_tokens.weight, "rollout model is not tied"
        n_params = len({id(t) for t in model.parameters()})
        largest = max(t.numel() * t.element_size() for t in model.parameters())
        size = sum(t.numel() * t.element_size() for t in model.parameters())

    def sync() -> None:
        taken = sync_weights(rollout, engine.model, args, bucket_bytes=bucket)
        assert not mine or taken == n_params, f"sync took {taken} tensors, the model has {n_params}"

    def baseline() -> None:
        full = export_hf(engine.model, args, "actor")  # every rank gathers the whole model
        if mine:
            missing, unexpected = model.load_state_dict(full, strict=False)
            assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)
        del full

    load0 = os.getloadavg()
    runs: dict[str, list[tuple[float, float, PeakRss | None]]] = {"sync": [], "baseline": []}
    for i in range(a.repeat + 1):
        for name, fn in (("sync", sync), ("baseline", baseline)):
            out = measure(fn, mine)
            if i >= 1:  # warm-up pair left out
                runs[name].append(out)
    if mine:
        print(f"TP={a.tp}, {torch.distributed.get_world_size()} process(es), {a.layers} layers, "
              f"{size / MIB:.0f} MiB fp32 ({n_params} tensors, tied), bucket {bucket / MIB:.0f} MiB, largest "
              f"tensor {largest / MIB:.0f} MiB; medians of {a.repeat} alternating pairs after one warm-up; "
              f"load avg {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
        print(f"{'op':<10}{'time ms':>9}{'min-max ms':>13}{'cpu ms':>8}{'extra MiB':>11}{'max extra':>11}"
              f"{'retained':>10}")
        med, extra, max_extra = {}, {}, {}
        for k, v in runs.items():
            times = [t * 1e3 for t, _, _ in v]
            med[k] = statistics.median(times), statistics.median(c * 1e3 for _, c, _ in v)
            extra[k], max_extra[k] = statistics.median(m.extra / MIB for *_, m in v), max(m.extra / MIB for *_, m in v)
            print(f"{k:<10}{med[k][0]:>9.1f}{f'{min(times):.0f}-{max(times):.0f}':>13}{med[k][1]:>8.1f}"
                  f"{extra[k]:>11.1f}{max_extra[k]:>11.1f}{max(abs(m.retained) / MIB for *_, m in v):>10.1f}")
        ratio, cpu_ratio = (med["sync"][i] / med["baseline"][i] for i in (0, 1))
        limit = (bucket + largest) / MIB
        print(f"time: sync/baseline {ratio:.2f} (goal <= 1.5x: {'met' if ratio <= 1.5 else 'missed'}); "
              f"cpu time {cpu_ratio:.2f}")
        print(f"memory: sync extra {extra['sync']:.0f} MiB (max {max_extra['sync']:.0f}) vs bucket + largest tensor "
              f"{limit:.0f} MiB (goal: {'met' if max_extra['sync'] <= limit else 'missed'}, "
              f"{max_extra['sync'] / limit:.2f}x); sync/baseline {extra['sync'] / max(extra['baseline'], 1):.2f}",
              flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
