"""GPU smoke check of the CUDA path, one process per GPU under torchrun:

    torchrun --standalone --nproc_per_node=1 launch/gpu_smoke.py --out DIR [--device cuda|cpu]

On the device it was given (``--device``; default: detect) it builds tiny random HF models of
several architectures, loads them into mcore_rl engines and checks, printing one line each:
  * parity: the actor's log-probs and entropies equal transformers' on the same device
    (fp32, max abs diff printed, <= 1e-4);
  * placement: every parameter and buffer of the engine is on the platform's device;
  * export: ``export_hf`` gives back the HF weights bit for bit;
  * training: two PPO updates (fp32 and bf16 parameters), finite metrics, weights moved;
  * checkpoints: a sync, an async and a model_space save on the device, a fresh engine loads each and
    gives the same log-probs, and one more update from each equals the uninterrupted one.
It writes ``DIR/<device>.pt`` (the training results, for comparing a GPU run with a CPU run of the
same script: ``--compare DIR/cuda.pt DIR/cpu.pt``) and exits 1 when any check fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ARCHS = {  # name -> (model_type, config overrides): dense, tied, qk-norm, MoE, MLA + group routing
    "llama": ("llama", {}),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
}
FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def on_device(engine, device: torch.device) -> list[str]:
    """Names of parameters/buffers of the engine's chunks that are not on ``device``."""
    wrong = []
    for c in engine.model:
        for n, t in list(c.named_parameters()) + list(c.named_buffers()):
            if t.device.type != device.type:
                wrong.append(f"{n}@{t.device}")
    return wrong


def rl_inputs(vocab: int, device: torch.device, seed: int = 3) -> dict:
    from tests.tiny import rl_batch

    batch = rl_batch(vocab, batch=8, prompt=10, response=6, seed=seed)
    return {k: v.to(device) for k, v in batch.items()}


def parity(platform, tmp: str) -> None:
    """Log-probs/entropy vs transformers, placement and export for every architecture."""
    from megatron.core import parallel_state

    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine
    from tests.tiny import hf_log_probs, tiny_config, tiny_hf_model

    device = platform.device()
    for name, (model_type, overrides) in ARCHS.items():
        hf = tiny_hf_model(tiny_config(model_type, **overrides))
        path = os.path.join(tmp, name)
        hf.save_pretrained(path)
        initialize_parallel_state(ParallelLayout())
        args = model_args_from_hf(path)
        engine = ModelEngine(args, ParallelLayout(), "actor", platform, hf_weights=path)
        batch = rl_inputs(args.vocab_size, device)
        t0 = time.perf_counter()
        out = Actor(engine, ActorConfig(micro_batch_size=4)).compute_log_prob(batch, with_entropy=True)
        took = time.perf_counter() - t0
        ref_lp, ref_ent = hf_log_probs(hf.to(device), batch)
        d_lp = (out["log_probs"] - ref_lp).abs().max().item()
        d_ent = (out["entropy"] - ref_ent).abs().max().item()
        report(f"parity[{name}]", d_lp <= 1e-4 and d_ent <= 1e-4 and out["log_probs"].device.type == device.type,
               f"max|dlogp|={d_lp:.2e} max|dent|={d_ent:.2e} on {out['log_probs'].device} ({took * 1e3:.0f} ms)")
        wrong = on_device(engine, device)
        report(f"placement[{name}]", not wrong, f"{len(wrong)} tensors off {device.type} {wrong[:3]}")
        exported, source = export_hf(engine.model, args, "actor"), SafetensorsReader(path)
        bad = [k for k in source if k in exported and not torch.equal(exported[k].cpu(), source[k])]
        missing = sorted(set(source) ^ set(exported))
        report(f"export[{name}]", not bad and not missing, f"{len(exported)} tensors, mismatched {bad[:3]}, "
               f"one-sided {missing[:3]}")
        del engine
        parallel_state.destroy_model_parallel()


def train_engine(platform, path: str, dtype: torch.dtype, init: bool = True):
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    if init:
        initialize_parallel_state(ParallelLayout(), seed=1234)
    args = model_args_from_hf(path)
    engine = ModelEngine(args, ParallelLayout(), "actor", platform, BuildOptions(params_dtype=dtype),
                         optim=OptimConfig(lr=1e-3, clip_grad=1.0), hf_weights=path)
    return engine, Actor(engine, ActorConfig(micro_batch_size=4, ppo_mini_batch_size=8))


def update(actor, batch: dict, seed: int) -> dict:
    """One PPO update on ``batch`` with advantages from ``seed``; returns its metrics."""
    g = torch.Generator().manual_seed(seed)
    b = dict(batch)
    b["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    b["advantages"] = torch.randn(b["responses"].shape, generator=g).to(b["responses"].device)
    return actor.update_policy(b)


def training(platform, tmp: str) -> dict:
    """Two updates (fp32, bf16), then checkpoints: sync and async save, load into fresh engines."""
    from megatron.core import parallel_state

    path, results = os.path.join(tmp, "qwen3_moe"), {}
    device = platform.device()
    for dtype in (torch.float32, torch.bfloat16):
        engine, actor = train_engine(platform, path, dtype)
        batch = rl_inputs(engine.args.vocab_size, device)
        before = actor.compute_log_prob(batch)["log_probs"]
        metrics = [update(actor, batch, seed) for seed in (1, 2)]
        after = actor.compute_log_prob(batch)["log_probs"]
        finite = all(torch.isfinite(torch.tensor(v)).all() for m in metrics for v in m.values())
        moved = (after - before).abs().max().item()
        tag = str(dtype).split(".")[-1]
        report(f"update[{tag}]", finite and moved > 1e-4, f"metrics finite={finite}, max|dlogp| after 2 "
               f"steps {moved:.3e}, pg_loss {metrics[-1].get('actor/pg_loss', float('nan')):.4f}")
        results[tag] = {"before": before.float().cpu(), "after": after.float().cpu()}
        if dtype is torch.float32:
            results.update(checkpoints(platform, tmp, path, engine, actor, batch))
        del engine, actor
        parallel_state.destroy_model_parallel()
    return results


def checkpoints(platform, tmp, path, engine, actor, batch) -> dict:
    """Saves the trained engine (sync, then async), loads each into a fresh engine, compares."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    out = {}
    for mode in ("sync", "async", "model_space"):
        root = os.path.join(tmp, f"ckpt_{mode}")
        sharding = "model_space" if mode == "model_space" else "dp_reshardable"
        manager = CheckpointManager(CheckpointConfig(root=root, async_save=mode == "async",
                                                     optimizer_sharding=sharding))
        t0 = time.perf_counter()
        manager.save(2, {"actor": engine}, {"step": 2})
        manager.wait()
        took = time.perf_counter() - t0
        manager.close()
        expected = actor.compute_log_prob(batch)["log_probs"]
        fresh, fresh_actor = train_engine(platform, path, torch.float32, init=False)
        state = CheckpointManager(CheckpointConfig(root=root, optimizer_sharding=sharding)).resume({"actor": fresh})
        got = fresh_actor.compute_log_prob(batch)["log_probs"]
        same = torch.equal(got, expected)
        m_live, m_fresh = update(actor, batch, 7), update(fresh_actor, batch, 7)
        after_live = actor.compute_log_prob(batch)["log_probs"]
        after_fresh = fresh_actor.compute_log_prob(batch)["log_probs"]
        d = (after_live - after_fresh).abs().max().item()
        report(f"checkpoint[{mode}]", same and state == {"step": 2} and d <= 1e-6,
               f"save {took:.2f} s; resumed log-probs equal={same}; trainer state {state}; "
               f"next update max|dlogp| live vs resumed {d:.2e} (loss {m_live.get('actor/pg_loss')} vs "
               f"{m_fresh.get('actor/pg_loss')})")
        out[f"resumed_{mode}"] = after_fresh.cpu()
        del fresh, fresh_actor
    return out


def compare(a_path: str, b_path: str) -> None:
    """fp32 results of two runs (e.g. cuda vs cpu) agree within 1e-4; bf16 differences are printed
    only (kernels round bf16 differently per device and Adam amplifies that: no bound is claimed)."""
    a, b = (torch.load(p, weights_only=True) for p in (a_path, b_path))
    for key in sorted(set(a) & set(b)):
        for sub in (a[key] if isinstance(a[key], dict) else {"": a[key]}):
            x = a[key][sub] if sub else a[key]
            y = b[key][sub] if sub else b[key]
            d = (x - y).abs().max().item()
            name = f"{os.path.basename(a_path)} vs {os.path.basename(b_path)} [{key}{'.' + sub if sub else ''}]"
            if key == "bfloat16":
                print(f"INFO {name}: max|d|={d:.2e}", flush=True)
            else:
                report(name, d <= 1e-4, f"max|d|={d:.2e} (tol 1e-4)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return 1 if FAILED else 0
    from mcore_rl.platform import init_distributed, setup_platform

    platform = setup_platform(args.device)
    init_distributed(platform)
    import megatron.core

    print(f"device {platform.device()} ({torch.cuda.get_device_name() if not platform.on_cpu else 'cpu'}), "
          f"backend {torch.distributed.get_backend()}, torch {torch.__version__}, megatron-core "
          f"{megatron.core.__version__}, transformer_engine {platform.transformer_engine}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        parity(platform, tmp)
        results = training(platform, tmp)
        print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"{platform.device_type}.pt"))
    torch.distributed.destroy_process_group()
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all passed", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
