"""``convert_merge.py --mxfp4``: the converter on a synthetic MXFP4 gpt-oss-shaped checkpoint.

The widths are gpt-oss-20b's (hidden 2880, 32 experts of intermediate 2880, 64 query heads and 8
KV heads of 64, sinks, biases, alternating sliding/full layers); the vocabulary is cut to 32000
(gpt-oss's 201088 makes two bf16 tensors of 1.1 GiB that would outweigh the experts at this
size); layers are added until the MXFP4 files reach --size_gb. The experts' stacks are written
as published (``*_blocks`` uint8 [E, rows, cols / 32, 16] + ``*_scales`` uint8 [E, rows,
cols / 32]) by the codec (``mapping.mxfp4.quantize_mxfp4`` of random bf16 weights, expert by
expert), everything else bf16. ``hf_to_mcore.py`` converts it to bf16 (the experts dequantized);
measured: peak RssAnon above the interpreter-and-imports baseline / output size (goal <= 0.1x)
and throughput against a plain read+write+fsync copy of the output bytes, run in the same
process just before (goal >= 0.7x), and the output bytes/s extrapolated to gpt-oss-20b (13 GB
MXFP4 on disk, 42 GB bf16 out) against the 18 min 19 s a user reports for Megatron-Bridge's
import on CPU (Megatron-Bridge #5316; quoted, not measured here). ``--mxfp4_export`` also merges
the output back with ``merge --dtype mxfp4`` (timed, peak memory) and checks that every MXFP4
byte and every other tensor comes back as written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from mcore_rl.fileio.safetensors_write import ShardedSafetensorsWriter, TensorSpec

H, FF, E, TOPK, HEADS, KV, HEAD_DIM, VOCAB, WINDOW = 2880, 2880, 32, 4, 64, 8, 64, 32000, 128
GPT_OSS_20B = (13e9, 42e9)  # bytes: MXFP4 checkpoint on disk, bf16 out (quoted sizes)
BRIDGE_S = 18 * 60 + 19  # Megatron-Bridge #5316: gpt-oss-20b import on CPU (quoted)
MEMORY_GOAL, SPEED_GOAL = 0.1, 0.7


def config(layers: int) -> dict:
    """gpt-oss-20b's config.json with ``layers`` layers and the cut vocabulary."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
            "intermediate_size": FF, "num_local_experts": E, "num_experts_per_tok": TOPK,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
            "num_hidden_layers": layers, "sliding_window": WINDOW,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0, "hidden_act": "silu",
            "initializer_range": 0.02, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9,
            "output_router_logits": False, "use_cache": True, "torch_dtype": "bfloat16",
            "eos_token_id": 2, "pad_token_id": 0,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"],
                                    "quant_method": "mxfp4"}}


def layer_specs(i: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(as stored: MXFP4 blocks + scales and bf16, as converted: bf16) of layer ``i``."""
    p, bf, u8 = f"model.layers.{i}.", torch.bfloat16, torch.uint8
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    plain = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (q, H), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.weight": (kv, H),
             "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H), "self_attn.v_proj.bias": (kv,),
             "self_attn.o_proj.weight": (H, q), "self_attn.o_proj.bias": (H,), "self_attn.sinks": (HEADS,),
             "mlp.router.weight": (E, H), "mlp.router.bias": (E,), "mlp.experts.gate_up_proj_bias": (E, 2 * FF),
             "mlp.experts.down_proj_bias": (E, H)}
    stored = [TensorSpec(p + k, v, bf) for k, v in plain.items()]
    converted = list(stored)
    for name, (cols, rows) in (("gate_up_proj", (H, 2 * FF)), ("down_proj", (FF, H))):
        stored += [TensorSpec(f"{p}mlp.experts.{name}_blocks", (E, rows, cols // 32, 16), u8),
                   TensorSpec(f"{p}mlp.experts.{name}_scales", (E, rows, cols // 32), u8)]
        converted.append(TensorSpec(f"{p}mlp.experts.{name}", (E, cols, rows), bf))
    return stored, converted


def model_specs(size_bytes: int) -> tuple[list[TensorSpec], int, int]:
    """The stored tensors of the fewest layers (at least one) whose MXFP4 files reach
    ``size_bytes``; the bf16 bytes they convert to; the layer count."""
    outer = [TensorSpec("model.embed_tokens.weight", (VOCAB, H), torch.bfloat16)]
    tail = [TensorSpec("model.norm.weight", (H,), torch.bfloat16), TensorSpec("lm_head.weight", (VOCAB, H), torch.bfloat16)]
    stored, converted, layers = [], [], 0
    while layers == 0 or sum(s.nbytes for s in outer + stored + tail) < size_bytes:
        more = layer_specs(layers)
        stored += more[0]
        converted += more[1]
        layers += 1
    return outer + stored + tail, sum(s.nbytes for s in outer + converted + tail), layers


def write_model(path: str, size_bytes: int) -> tuple[int, int, int]:
    """config.json and the shards (2 GB, indexed); returns (MXFP4 bytes, bf16 bytes, layers)."""
    from mcore_rl.mapping.mxfp4 import quantize_mxfp4

    specs, out_bytes, layers = model_specs(size_bytes)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(layers), f, indent=2)
    writer = ShardedSafetensorsWriter(path, specs, "2GB")
    g = torch.Generator().manual_seed(0)
    pending: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.name.endswith("_scales"):
            writer.write(s.name, pending.pop(s.name))
        elif s.name.endswith("_blocks"):
            blocks = torch.empty(s.shape, dtype=torch.uint8)
            scales = torch.empty(s.shape[:-1], dtype=torch.uint8)
            cols = s.shape[2] * 32
            for e in range(s.shape[0]):  # one expert's bf16 weight [cols, rows] at a time
                w = (torch.randn(cols, s.shape[1], generator=g) * 0.02).to(torch.bfloat16)
                blocks[e], scales[e] = quantize_mxfp4(w)
            writer.write(s.name, blocks)
            pending[s.name.removesuffix("_blocks") + "_scales"] = scales
        else:
            writer.write(s.name, (torch.randn(s.shape, generator=g) * 0.02).to(s.dtype))
    writer.close()
    return sum(s.nbytes for s in specs), out_bytes, layers


def plain_copy_tree(src: str, dst: str, copy_file) -> float:
    """Seconds to read every file under ``src`` and write it under ``dst`` with fsync
    (``copy_file``: convert_merge's): the converter's output bytes, copied."""
    import time

    start = time.perf_counter()
    for dirpath, _, names in os.walk(src):
        into = os.path.join(dst, os.path.relpath(dirpath, src))
        os.makedirs(into, exist_ok=True)
        for name in names:
            copy_file(os.path.join(dirpath, name), os.path.join(into, name))
    return time.perf_counter() - start


def same_as_source(src: str, merged: str) -> tuple[int, int, int]:
    """(tensors, MXFP4 blocks, blocks re-encoded); raises unless ``merged`` holds ``src``'s names
    and dtypes, every plain tensor's bytes, every MXFP4 stack's values, and the bytes of every
    block a value-reading exporter can reproduce (scale 0 or a code of magnitude 4 or 6:
    ``mapping/mxfp4.py``; the codec's own rule writes only such blocks)."""
    from safetensors import safe_open

    from mcore_rl.mapping.hf_io import read_header
    from mcore_rl.mapping.mxfp4 import dequantize_mxfp4

    def tensors(d: str) -> dict[str, str]:
        out = {}
        for name in os.listdir(d):
            if name.endswith(".safetensors"):
                out.update({k: os.path.join(d, name) for k in read_header(os.path.join(d, name))})
        return out

    def read(paths: dict[str, str], name: str) -> torch.Tensor:
        with safe_open(paths[name], "pt") as f:
            return f.get_tensor(name)

    a, b = tensors(src), tensors(merged)
    if set(a) != set(b):
        raise SystemExit(f"merged names differ: {sorted(set(a) ^ set(b))[:8]}")
    blocks = moved = 0
    for name in a:
        x, y = read(a, name), read(b, name)
        if x.dtype != y.dtype:
            raise SystemExit(f"merged tensor {name} is {y.dtype}, the source's {x.dtype}")
        if name.endswith("_scales"):
            continue
        if not name.endswith("_blocks"):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                raise SystemExit(f"merged tensor {name} differs from the source")
            continue
        stem = name.removesuffix("_blocks") + "_scales"
        xs, ys = read(a, stem), read(b, stem)
        if not torch.equal(dequantize_mxfp4(x, xs), dequantize_mxfp4(y, ys)):
            raise SystemExit(f"merged MXFP4 {name} holds other values than the source")
        same = (x == y).all(-1) & (xs == ys)
        top = torch.maximum(x & 7, (x >> 4) & 7).amax(-1)
        if bool((~same & ((xs == 0) | (top >= 6))).any()):
            raise SystemExit(f"merged MXFP4 {name} changed the bytes of a block the exporter writes back as it is")
        blocks, moved = blocks + same.numel(), moved + int((~same).sum())
    return len(a), blocks, moved


def mxfp4_main(a: argparse.Namespace, tools) -> None:
    """``--mxfp4``: convert (and with ``--mxfp4_export`` merge back) the synthetic model. ``tools``:
    convert_merge's module (baseline, run_sampled, plain_copy, warm, the import lists)."""
    import sys

    work = a.workdir or tempfile.mkdtemp(prefix="convert_mxfp4_")
    syn, out, merged, copy = (os.path.join(work, n) for n in ("hf_mxfp4", "mcore", "merged", "copy"))
    try:
        size_in, size_out, layers = write_model(syn, int(a.size_gb * 2**30))
        print(f"synthetic MXFP4 gpt-oss ({layers} layers of gpt-oss-20b widths, vocab {VOCAB}): "
              f"{size_in / 2**30:.3f} GiB in, {size_out / 2**30:.3f} GiB bf16 out; load average "
              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
        base = tools.baseline(tools.CONVERT_IMPORTS)
        tools.warm(syn)
        seconds, peak, said = tools.run_sampled([sys.executable, os.path.join(tools.ROOT, "converters", "hf_to_mcore.py"),
                                                 "--hf_model_path", syn, "--output_path", out])
        written = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
        tools.warm(out)
        copy_s = plain_copy_tree(out, copy, tools.copy_file)  # the output's bytes, read + write + fsync
        shutil.rmtree(copy)
        above = peak - base[0]
        mem, speed, net = above / written, copy_s / seconds, copy_s / (seconds - base[1])
        rate = written / (seconds - base[1])
        print(f"convert {seconds:6.1f} s (start + imports {base[1]:.1f} s), output {written / 2**30:.3f} GiB; plain copy "
              f"of the output {copy_s:.1f} s: throughput / copy {speed:.2f} end to end, {net:.2f} net of start + "
              f"imports [{'PASS' if net >= SPEED_GOAL else 'MISS'} >= {SPEED_GOAL}]")
        print(f"peak RssAnon {peak / 2**20:.0f} MiB, baseline {base[0] / 2**20:.0f} MiB: above baseline / output = "
              f"{mem:.3f} [{'PASS' if mem <= MEMORY_GOAL else 'MISS'} <= {MEMORY_GOAL}], / MXFP4 input "
              f"{above / size_in:.3f}")
        print(f"gpt-oss-20b extrapolated at {rate / 2**20:.0f} MiB/s of output: {GPT_OSS_20B[1] / rate / 60:.1f} min "
              f"+ {base[1]:.0f} s start-up, vs {BRIDGE_S / 60:.1f} min reported for Megatron-Bridge (#5316, quoted)")
        print(said.strip().splitlines()[-1])
        if a.mxfp4_export:
            mbase = tools.baseline(tools.MERGE_IMPORTS)
            m_s, m_peak, _ = tools.run_sampled([sys.executable, os.path.join(tools.ROOT, "converters", "mcore_to_hf.py"),
                                                "merge", "--local_dir", out, "--target_dir", merged, "--dtype", "mxfp4"])
            print(f"merge --dtype mxfp4 {m_s:6.1f} s (start + imports {mbase[1]:.1f} s): {size_in / (m_s - mbase[1]) / 2**20:.0f} "
                  f"MiB/s of MXFP4 written, {written / (m_s - mbase[1]) / 2**20:.0f} MiB/s of bf16 read; peak above "
                  f"baseline {(m_peak - mbase[0]) / 2**20:.0f} MiB = {(m_peak - mbase[0]) / written:.3f} x the bf16 input")
            n, blocks, moved = same_as_source(syn, merged)
            print(f"merged == source: {n} tensors, the plain ones byte-identical, the MXFP4 stacks value-identical; "
                  f"{moved} of {blocks} blocks re-encoded ({moved / blocks:.1%}; the source was written by the codec's "
                  "rule, which is idempotent), every other block byte-identical")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
