"""LoRA (rank 16 on every linear) vs full fine-tuning of SmolLM2-135M at world 1, side by side in
one run: optimizer + gradient memory, update step time, weight-sync bytes (adapter-only vs
merged). Each goal is printed beside its measured ratio.

    torchrun --standalone --nproc_per_node=1 benchmarks/lora_bench.py [--rounds 4]

Needs the prepared model (``make prepare-smollm2``: ~/.cache/mcore_rl/smollm2/hf, or
$MCORE_RL_CACHE/smollm2/hf). Memory counts bytes, not the allocator: the DDP gradient buffers
(``main_grad``) and every optimizer-held tensor that is not a model parameter (Adam's moments,
fp32 main copies where the parameters are bf16), after one step (Adam allocates lazily). Step
time: ``update_policy`` on the same batch and micro-batches, the two engines alternating, median
of ``--rounds`` runs each after one warm-up, as wall-clock time and as the process's CPU time
(one thread: the work done, much less disturbed than wall time on a machine shared with other
jobs). Sync: the bytes of the HF tensors the sync hands a
rollout engine, merged (W + s B A, every base weight) vs the adapters alone (PEFT factors).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

from benchmarks.common import rank0_print, start  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402

GOALS = {"memory": 0.05, "step_time": 0.75}
LORA = dict(rank=16, alpha=32, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def hf_dir() -> str:
    root = os.environ.get("MCORE_RL_CACHE", os.path.expanduser("~/.cache/mcore_rl"))
    path = os.path.join(root, "smollm2", "hf")
    if not os.path.isfile(os.path.join(path, "config.json")):
        sys.exit(f"{path} holds no prepared model; run `make prepare-smollm2` first")
    return path


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside nested dicts/lists/tuples (an optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def optimizer_and_grad_bytes(engine) -> tuple[int, int]:
    """(bytes of optimizer-held tensors that are not model parameters, bytes of DDP grad buffers)."""
    buffers = [b for ddp in engine.model for b in ddp.buffers + ddp.expert_parallel_buffers]
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    model = {p.untyped_storage().data_ptr() for c in engine.model for p in c.parameters()}
    model |= {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
    inner = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    seen, total = set(), 0
    for opt in inner:
        torch_opt = opt.optimizer
        held = _tensors(list(torch_opt.state.values()))
        held += [p for group in torch_opt.param_groups for p in group["params"]]
        for t in held:
            ptr = t.untyped_storage().data_ptr()
            if ptr in model or ptr in seen:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total, grads


def build(layout, platform, lora: dict | None):
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    path = hf_dir()
    options = BuildOptions(lora=LoraConfig(**lora)) if lora else BuildOptions()
    engine = ModelEngine(model_args_from_hf(path), layout, "actor", platform, options,
                         OptimConfig(lr=1e-4 if lora else 1e-5, clip_grad=1.0), path)
    return Actor(engine, ActorConfig(micro_batch_size=8, ppo_mini_batch_size=16))


def sync_bytes(engine) -> dict[str, tuple[int, float]]:
    """{'merged' | 'adapters': (bytes handed over, seconds)} of one full export."""
    from mcore_rl.mapping.peft import AdapterMap
    from mcore_rl.mapping.weights import iter_hf_buckets
    from mcore_rl.models.hf_weights import export_hf_buckets, weight_map
    from mcore_rl.lora.layers import merged_tensor_of
    from mcore_rl.lora.build import adapter_sites

    amap = AdapterMap(weight_map(engine.args, "actor", engine.layout.tp), adapter_sites(engine.model))
    runs = {
        "merged": lambda: export_hf_buckets(engine.model, engine.args, "actor", 64 << 20,
                                            tensor_of=merged_tensor_of(engine.model)),
        "adapters": lambda: iter_hf_buckets(engine.model, amap, 64 << 20, adapters=True),
    }
    out = {}
    for name, make in runs.items():
        clock, total = time.perf_counter(), 0
        for bucket in make():
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket
        out[name] = (total, time.perf_counter() - clock)
    return out


def _ratio_line(what: str, lora: float, full: float, unit: str, goal: float | None) -> str:
    ratio = lora / full
    verdict = "" if goal is None else f"  goal <= {goal:.2f}x: {'met' if ratio <= goal else 'MISSED'}"
    return f"{what:<34} LoRA {lora:>12.2f} {unit:<3} full {full:>12.2f} {unit:<3} ratio {ratio:.4f}x{verdict}"


def main() -> None:
    from tests.tiny import rl_batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4, help="timed update_policy runs per engine")
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--response", type=int, default=16)
    opts = parser.parse_args()
    layout = ParallelLayout(tp=1)
    platform = start(layout)
    actors = {"full": build(layout, platform, None), "lora": build(layout, platform, LORA)}
    vocab = actors["full"].engine.args.vocab_size
    batch = rl_batch(vocab, batch=16, prompt=opts.prompt, response=opts.response)
    batch["old_log_probs"] = actors["full"].compute_log_prob(batch)["log_probs"]
    batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in actors}
    cpu = {name: [] for name in actors}
    for i in range(opts.rounds + 1):  # round 0: warm-up (and Adam's lazy state)
        for name, actor in actors.items():
            clock, cpu_clock = time.perf_counter(), time.process_time()
            actor.update_policy(batch)
            if i:
                times[name].append(time.perf_counter() - clock)
                cpu[name].append(time.process_time() - cpu_clock)
    memory = {name: optimizer_and_grad_bytes(a.engine) for name, a in actors.items()}
    trainable = {name: sum(p.numel() for c in a.engine.model for p in c.parameters() if p.requires_grad)
                 for name, a in actors.items()}
    sync = sync_bytes(actors["lora"].engine)
    full_sync = sync_bytes_full(actors["full"].engine)
    mib = 1 << 20
    lines = [
        f"SmolLM2-135M, world 1, fp32; LoRA rank {LORA['rank']} alpha {LORA['alpha']} on "
        f"{', '.join(LORA['target_modules'])}",
        f"trainable parameters: LoRA {trainable['lora']:,}, full {trainable['full']:,} "
        f"(ratio {trainable['lora'] / trainable['full']:.4f})",
        _ratio_line("optimizer states", memory["lora"][0] / mib, memory["full"][0] / mib, "MiB", None),
        _ratio_line("gradient buffers", memory["lora"][1] / mib, memory["full"][1] / mib, "MiB", None),
        _ratio_line("optimizer + gradients", sum(memory["lora"]) / mib, sum(memory["full"]) / mib, "MiB",
                    GOALS["memory"]),
        _ratio_line(f"update step, wall (median of {opts.rounds})", statistics.median(times["lora"]),
                    statistics.median(times["full"]), "s", GOALS["step_time"]),
        _ratio_line("update step, CPU time (median)", statistics.median(cpu["lora"]),
                    statistics.median(cpu["full"]), "s", GOALS["step_time"]),
        f"  update step runs (wall): LoRA {[round(t, 2) for t in times['lora']]}, "
        f"full {[round(t, 2) for t in times['full']]}",
        _ratio_line("sync bytes, adapters vs merged", sync["adapters"][0] / mib, sync["merged"][0] / mib, "MiB", None),
        f"  sync export time: LoRA merged {sync['merged'][1]:.2f} s, adapters only {sync['adapters'][1]:.2f} s, "
        f"full fine-tuning {full_sync:.2f} s",
    ]
    rank0_print("\n".join(lines))
    torch.distributed.destroy_process_group()


def sync_bytes_full(engine) -> float:
    """Seconds of one full export of a full fine-tuning engine (the merged sync's baseline)."""
    from mcore_rl.models.hf_weights import export_hf_buckets

    clock = time.perf_counter()
    for bucket in export_hf_buckets(engine.model, engine.args, "actor", 64 << 20):
        del bucket
    return time.perf_counter() - clock


if __name__ == "__main__":
    main()
