"""Hybrid models (Qwen3.5: Gated DeltaNet + gated full attention) on CPU: the per-token cost of a
GDN layer vs a full-attention layer by sequence length, and packed vs padded throughput.

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid.py      (~2 min on an idle core)

One process (world 1, gloo), one torch thread, fp32. One random Qwen3.5 model (``qwen3_5_text``)
of hidden 512 with layer_types [linear_attention, full_attention], built and loaded by mcore_rl
as for training (megatron-core modules, the platform's torch GDN kernels):
1. layer cost: the token mixer of layer 0 (``PackedGatedDeltaNet``: in_proj, causal conv, chunked
   gated delta rule, gated norm, out_proj) and of layer 1 (megatron's ``SelfAttention`` with the
   output gate: linear_qkv, q/k norms, RoPE, causal SDPA, gate, linear_proj), forward + backward on
   one sequence of L tokens (batch 1, the packed path RL trainers take); each module is called with
   the arguments it received in a model forward at that length, both on the same hidden states.
   The MLP (identical in both layer kinds) is timed beside them: a whole layer costs mixer + MLP
   (+ two RMSNorms).
2. throughput: forward + backward (gradient buffers as in training) of the whole model on an
   RL-like batch (16 rows, real lengths uniform in [32, 512]: a left-padded prompt and a
   right-padded response), one padded [16, 512] micro-batch vs one packed stream of the real
   tokens; the logits of both must agree.
Measured alternately in one run (each timing's kinds in turn), medians after a warm-up round, in
CPU time of this process (robust when other processes share the cores) and in wall time.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

HIDDEN, FFN, VOCAB = 512, 1536, 4096
SIZES = dict(
    hidden_size=HIDDEN, intermediate_size=FFN, vocab_size=VOCAB, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], max_position_embeddings=8192, initializer_range=0.02,
    num_attention_heads=4, num_key_value_heads=2, head_dim=128,  # 4 x 128 = the hidden width
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)
LENGTHS = {512: 5, 2048: 5, 8192: 3}  # sequence length -> timed repeats (after one warm-up)
ROWS, MIN_LEN, MAX_LEN, REPEATS = 16, 32, 512, 3


def start_single(store_dir: str) -> None:
    """CPU platform, a world-1 gloo group (file store) and megatron's parallel state; 1 thread."""
    from mcore_rl.platform import init_distributed, setup_platform

    platform = setup_platform("cpu")
    init_distributed(platform, 0, 1, init_method=f"file://{store_dir}/store")
    torch.set_num_threads(1)


def build(hf_dir: str) -> torch.nn.Module:
    """The model's one chunk (a GPTModel), loaded from ``hf_dir`` at world 1, in train mode."""
    from tests.steps import _build

    return _build(hf_dir, {}, "actor")[1][0]


def decoder_layers(chunk) -> list:
    """The chunk's TransformerLayers (through any wrapper's ``.module``)."""
    while not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return list(chunk.decoder.layers)


def stream_batch(ids: torch.Tensor, mask: torch.Tensor, budget: int):
    """The rows [b, s] as one packed micro-batch of ``budget`` stream tokens."""
    from mcore_rl.models.micro_batch import MicroBatch
    from mcore_rl.models.packing import pack

    return MicroBatch({"input_ids": ids, "attention_mask": mask}, packed=pack(ids, mask, budget))


def captured_calls(chunk, modules: dict, batch) -> dict:
    """name -> (args, kwargs) each module received in one no-grad forward of ``batch``."""
    from mcore_rl.models.forward import chunk_forward

    calls, hooks = {}, []
    for name, module in modules.items():
        def save(_module, args, kwargs, name=name):
            calls[name] = (args, dict(kwargs))
        hooks.append(module.register_forward_pre_hook(save, with_kwargs=True))
    try:
        with torch.no_grad():
            chunk_forward(chunk, batch)
    finally:
        for h in hooks:
            h.remove()
    return calls


def hidden_input(call) -> torch.Tensor:
    """The hidden states [s, b, h] of a captured call (first positional argument or keyword)."""
    args, kwargs = call
    return (args[0] if args else kwargs["hidden_states"]).detach()


def fwd_bwd(module, call, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """A closure running ``module`` forward on ``x`` [s, 1, h] (with the rest of its captured
    call) and backward from ``grad`` [s, 1, h]."""
    args, kwargs = call

    def step() -> None:
        module.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        if args:  # hidden states: the first positional argument, or by keyword
            out = module(inp, *args[1:], **kwargs)
        else:
            out = module(**{**kwargs, "hidden_states": inp})
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return step


def alternate(steps: dict, repeats: int) -> dict[str, dict[str, float]]:
    """{"cpu": {name: median CPU seconds of this process}, "wall": {name: median wall seconds}}
    of ``steps[name]()``, run in turns (one warm-up round first). CPU time counts only this
    process's work, so it moves little when other processes share the cores; wall time moves
    with their load."""
    times: dict[str, dict[str, list[float]]] = {"cpu": {n: [] for n in steps}, "wall": {n: [] for n in steps}}
    for i in range(repeats + 1):
        for name, step in steps.items():
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            if i:
                times["cpu"][name].append(time.process_time() - cpu)
                times["wall"][name].append(time.perf_counter() - wall)
    return {clock: {n: statistics.median(t) for n, t in by_name.items()} for clock, by_name in times.items()}


def layer_costs(chunk) -> list[tuple[int, dict]]:
    """Per length L: median seconds of forward + backward of the GDN mixer, the attention mixer
    (both on the GDN mixer's input) and the MLP, on one sequence of L tokens."""
    gdn, attn = decoder_layers(chunk)
    modules = {"gdn": gdn.self_attention, "attn": attn.self_attention, "mlp": gdn.mlp}
    g = torch.Generator().manual_seed(0)
    rows = []
    for length, repeats in LENGTHS.items():
        ids = torch.randint(1, VOCAB, (1, length), generator=g)
        calls = captured_calls(chunk, modules, stream_batch(ids, torch.ones_like(ids), length))
        inputs = {"gdn": hidden_input(calls["gdn"]), "mlp": hidden_input(calls["mlp"])}
        inputs["attn"] = inputs["gdn"]  # the same hidden states into both mixers
        grad = torch.randn(inputs["gdn"].shape, generator=g)
        steps = {n: fwd_bwd(m, calls[n], inputs[n], grad) for n, m in modules.items()}
        rows.append((length, alternate(steps, repeats)))
    return rows


def rl_rows(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [ROWS, MAX_LEN]: L ~ U[MIN_LEN, MAX_LEN] real tokens per row, a
    left-padded prompt of L/2 ending at the middle column and a right-padded response."""
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (ROWS,), generator=generator)
    mask = torch.zeros(ROWS, MAX_LEN, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        start = max(0, min(MAX_LEN // 2 - length // 2, MAX_LEN - length))
        mask[row, start : start + length] = 1
    ids = torch.randint(1, VOCAB, (ROWS, MAX_LEN), generator=generator) * mask
    return ids, mask


def throughput(chunk) -> tuple[dict, int, float]:
    """Median seconds of forward + backward of the whole model, padded vs packed; the real token
    count; max |logit diff| packed vs padded over the real tokens."""
    from mcore_rl.models.ddp import wrap_with_ddp
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.micro_batch import MicroBatch

    ids, mask = rl_rows(torch.Generator().manual_seed(1))
    real = mask.bool()
    tokens = int(mask.sum())
    batches = {"padded": MicroBatch({"input_ids": ids, "attention_mask": mask}),
               "packed": stream_batch(ids, mask, tokens)}
    logits = {}

    def loss_fn(name):
        def fn(mb, out: torch.Tensor):
            picked = out[real] if name == "padded" else out[0, mb.packed.index[real]]
            logits[name] = picked.detach()
            return picked.float().logsumexp(-1).mean(), {}
        return fn

    model = wrap_with_ddp([chunk], use_distributed_optimizer=False)  # gradient buffers, as in training

    def step(name: str) -> None:
        model[0].zero_grad_buffer()
        run_schedule(model, [batches[name]], loss_fn(name), forward_only=False)

    steps = {n: (lambda n=n: step(n)) for n in batches}
    med = alternate(steps, REPEATS)
    diff = float((logits["packed"] - logits["padded"]).abs().max())
    return med, tokens, diff


def main() -> None:
    from tests.tiny import tiny_config, tiny_hf_model

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        start_single(tmp)
        tiny_hf_model(tiny_config("qwen3_5_text", **SIZES)).save_pretrained(f"{tmp}/hf")
        chunk = build(f"{tmp}/hf")
        rows = layer_costs(chunk)
        med, tokens, diff = throughput(chunk)
        torch.distributed.destroy_process_group()
    report(rows, med, tokens, diff, time.perf_counter() - t0, (load0, os.getloadavg()[0]))


def crossover(rows: list[tuple[int, dict]]) -> str:
    """Where the GDN mixer becomes cheaper per token than attention: the first measured length
    where it is, with the crossing estimated by linear interpolation of both per-token costs
    (attention's grows linearly with L, GDN's is flat) between that length and the one before."""
    rows = [(length, m["cpu"]) for length, m in rows]
    ratios = [(length, m["gdn"] / m["attn"]) for length, m in rows]
    if ratios[0][1] < 1:
        return f"the GDN mixer is cheaper per token already at L = {ratios[0][0]} (the shortest measured)"
    for (l0, r0), (l1, r1) in zip(ratios, ratios[1:]):
        if r1 < 1:
            per_tok = {length: {k: m[k] / length for k in ("gdn", "attn")} for length, m in rows}
            d0 = per_tok[l0]["gdn"] - per_tok[l0]["attn"]
            d1 = per_tok[l1]["gdn"] - per_tok[l1]["attn"]
            at = l0 + (l1 - l0) * d0 / (d0 - d1)
            return (f"between L = {l0} (GDN/attn {r0:.2f}) and L = {l1} ({r1:.2f}); "
                    f"about L = {at:,.0f} by linear interpolation of the per-token costs")
    return (f"none up to L = {ratios[-1][0]}: the GDN mixer costs more per token than attention at every "
            f"length measured (GDN/attn {ratios[-1][1]:.2f} at {ratios[-1][0]})")


def report(rows, med: dict, tokens: int, diff: float, seconds: float, load: tuple) -> None:
    """Prints the two tables (module docstring)."""
    s = SIZES
    print(f"Qwen3.5 layers at hidden {HIDDEN}, fp32, 1 torch thread, batch 1 (packed path), forward + backward:")
    print(f"  attention: {s['num_attention_heads']} query heads x {s['head_dim']} with output gate, "
          f"{s['num_key_value_heads']} KV heads, causal SDPA")
    print(f"  GDN: {s['linear_num_key_heads']} key heads x {s['linear_key_head_dim']}, "
          f"{s['linear_num_value_heads']} value heads x {s['linear_value_head_dim']}, conv {s['linear_conv_kernel_dim']}, "
          "torch chunked gated delta rule (chunks of 64)")
    print(f"  MLP: SwiGLU {HIDDEN} -> {FFN} (the same in both layer kinds)")
    print("  CPU ms per token          GDN mixer  attn mixer  GDN/attn      MLP  GDN/attn layer | wall GDN/attn")
    for length, both in rows:
        m, w = both["cpu"], both["wall"]
        ratio, whole = m["gdn"] / m["attn"], (m["gdn"] + m["mlp"]) / (m["attn"] + m["mlp"])
        print(f"  L = {length:5d} (median of {LENGTHS[length]})  {1e3 * m['gdn'] / length:9.4f}  "
              f"{1e3 * m['attn'] / length:10.4f}  {ratio:8.2f}  {1e3 * m['mlp'] / length:7.4f}  {whole:14.2f} | "
              f"{w['gdn'] / w['attn']:13.2f}")
    print("  (GDN/attn layer = (GDN mixer + MLP) / (attn mixer + MLP), the norms left out; CPU time of this")
    print("   process, wall time only as the last column: other processes share the cores)")
    print(f"  crossover: {crossover(rows)}")
    print(f"\nwhole model ({len(s['layer_types'])} layers: 1 GDN + 1 attention, vocab {VOCAB}), forward + backward, "
          f"{ROWS} rows with real lengths uniform in [{MIN_LEN}, {MAX_LEN}]:")
    print(f"  {tokens} real tokens of {ROWS * MAX_LEN} padded ({ROWS * MAX_LEN / tokens:.2f}x)")
    for name in ("padded", "packed"):
        print(f"  {name:7s} {tokens / med['cpu'][name]:8,.0f} real tok/s of CPU time, {tokens / med['wall'][name]:8,.0f} "
              f"of wall time  (medians of {REPEATS})")
    print(f"  packed / padded {med['cpu']['padded'] / med['cpu']['packed']:.2f}x in CPU time, "
          f"{med['wall']['padded'] / med['wall']['packed']:.2f}x in wall time  "
          f"(logits max |diff| packed vs padded {diff:.2g})")
    print(f"total {seconds:.0f} s; load average (1 min) {load[0]:.2f} at start, {load[1]:.2f} at end "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
