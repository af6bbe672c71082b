"""Converter and merge on a synthetic bf16 HF model of >= 1 GB: peak memory above the
interpreter-and-libraries baseline and throughput against a plain read+write+fsync copy.

    python benchmarks/convert_merge.py [--size_gb 1.08] [--workdir DIR] [--keep] [--fp8]

A Qwen2-shaped model (hidden 2048, intermediate 5632, 16 heads, 4 KV heads, vocab 32000, untied
head; layers added until the size is reached) is written tensor by tensor as HF safetensors
shards of 400 MB with an index. ``hf_to_mcore.py`` (default dtype: the input's bf16) and
``mcore_to_hf.py merge`` run as subprocesses; a thread samples RssAnon of the process and all its
descendants every ~10 ms (peak of the sum). Each tool's baseline is the RssAnon of a fresh interpreter that imports what
the tool imports. The plain copy reads each shard and writes it with fsync (page cache warm for
every contender: all sources are read once before anything is timed). With ``--repeat N`` the
copy, the converter and the merge run N times alternating and every figure is the median (the disk
here is noisy: one copy of 1 GiB took 0.7 to 2.5 s within a minute). The merged model must
equal the synthetic one tensor for tensor (names, dtype, bits), or the run fails. The converter's
own start-up (process start to its first tensor, from its summary line) is printed too. Goals:
peak above the baseline <= 0.3x the size; throughput >= 0.5x the copy at 1 GiB, >= 0.8x from 3 GiB.
The mbridge figures printed last are quoted from an earlier measurement, not measured by this run.
``--fp8`` (``fp8_main``): the same model as block FP8 (linear weights e4m3 with 128 x 128 F32
scales, --size_gb its bf16 size), converted to bf16 only; peak relative to output and input.
``--mxfp4`` (``convert_mxfp4.py``): a gpt-oss-shaped model with MXFP4 experts (--size_gb its MXFP4
size) converted to bf16, against a copy of the output bytes and extrapolated to gpt-oss-20b;
``--mxfp4_export`` also merges it back with ``--dtype mxfp4`` and checks the bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script

import torch  # noqa: E402

from mcore_rl.fileio.safetensors_write import ShardedSafetensorsWriter, TensorSpec  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=32000)
# mbridge on a 1.07 GiB bf16 Qwen2 (peak / model size, throughput / copy): quoted, not measured here
MBRIDGE = (1.72, 0.14)
# peak memory above the baseline / size <= 0.3; throughput / copy >= 0.5 at 1 GiB, >= 0.8 from 3 GiB
MEMORY_GOAL = 0.3


def throughput_goal(size_gib: float) -> float:
    return 0.8 if size_gib >= 3.0 else 0.5


# what each tool imports before its work, as it imports it (config.json is read without transformers)
CONVERT_IMPORTS = ("from mcore_rl.platform.fixes import megatron_import_fixes\n"
                   "with megatron_import_fixes(on_cpu=True):\n    import mcore_rl.conversion.convert\n"
                   "import mcore_rl.platform, converters.hf_to_mcore")
MERGE_IMPORTS = "import mcore_rl.conversion.merge, converters.mcore_to_hf"


def layer_specs(i: int, h: int, f: int, q: int, kv: int) -> list[TensorSpec]:
    """HF names and shapes of one Qwen2 decoder layer (bf16)."""
    p, bf = f"model.layers.{i}.", torch.bfloat16
    shapes = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
              "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return [TensorSpec(p + k, v, bf) for k, v in shapes.items()]


def model_specs(size_bytes: int) -> tuple[list[TensorSpec], int]:
    """Every tensor of the smallest layer count whose bf16 weights reach ``size_bytes``."""
    h, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    d = h // SHAPE["num_attention_heads"]
    q, kv = h, SHAPE["num_key_value_heads"] * d
    outer = [TensorSpec("model.embed_tokens.weight", (v, h), torch.bfloat16)]
    tail = [TensorSpec("model.norm.weight", (h,), torch.bfloat16), TensorSpec("lm_head.weight", (v, h), torch.bfloat16)]
    layers: list[TensorSpec] = []
    while sum(s.nbytes for s in outer + layers + tail) < size_bytes:
        layers += layer_specs(len(layers) // 12, h, f, q, kv)
    return outer + layers + tail, len(layers) // 12


def write_model(path: str, size_bytes: int) -> tuple[int, int]:
    """Writes config.json and random bf16 shards (400 MB, indexed); returns (bytes, layers)."""
    specs, layers = model_specs(size_bytes)
    os.makedirs(path)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers,
              "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", **SHAPE}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    writer = ShardedSafetensorsWriter(path, specs, "400MB")
    g = torch.Generator().manual_seed(0)
    for s in specs:
        writer.write(s.name, (torch.randn(s.shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    return sum(s.nbytes for s in specs), layers


def rss_anon_kb(pid: int) -> int:
    """RssAnon of ``pid`` plus all its descendants (0 for processes that are gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_sampled(cmd: list[str]) -> tuple[float, float, str]:
    """Runs ``cmd``; returns (wall seconds, peak summed RssAnon in bytes, its output). Fails on a
    non-zero exit."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], rss_anon_kb(proc.pid))
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out = proc.communicate()[0]
    seconds = time.perf_counter() - start
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[1]} failed ({proc.returncode}):\n{out[-3000:]}")
    return seconds, peak[0] * 1024.0, out


def baseline(imports: str) -> tuple[float, float]:
    """(RssAnon bytes, wall seconds) of a fresh interpreter that does ``imports`` and exits: what
    the tool costs before any work (best of 2 for the time)."""
    code = f"{imports}\nfor l in open('/proc/self/status'):\n    l.startswith('RssAnon:') and print(l.split()[1])"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.append((int(out.stdout.split()[-1]) * 1024.0, time.perf_counter() - start))
    return max(r[0] for r in runs), min(r[1] for r in runs)


def copy_file(src: str, dst: str) -> None:
    """Reads file ``src`` and writes it to ``dst`` in 8 MiB blocks, then fsyncs it."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(8 << 20):
            fout.write(block)
        fout.flush()
        os.fsync(fout.fileno())


def plain_copy(src: str, dst: str) -> float:
    """Seconds to read every file of ``src`` and write it into ``dst`` with fsync (8 MiB blocks)."""
    os.makedirs(dst)
    start = time.perf_counter()
    for name in sorted(os.listdir(src)):
        copy_file(os.path.join(src, name), os.path.join(dst, name))
    return time.perf_counter() - start


def warm(path: str) -> None:
    for dirpath, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def same_tensors(a: str, b: str) -> int:
    """Number of tensors; raises unless ``b`` holds exactly ``a``'s names and bit-equal values."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if set(ra) != set(rb):
        raise SystemExit(f"merged names differ: {sorted(set(ra) ^ set(rb))[:8]}")
    for name in ra:
        if ra[name].dtype != rb[name].dtype or not torch.equal(ra[name], rb[name]):
            raise SystemExit(f"merged tensor {name} differs from the synthetic model")
    return len(ra)


def report(what: str, seconds: float, peak: float, base: tuple[float, float], size: float, copy_s: float) -> str:
    """Memory above the import baseline / size; throughput / copy end to end and net of the
    interpreter start + imports (the same fixed cost whatever the model size)."""
    mem, speed, net = (peak - base[0]) / size, copy_s / seconds, copy_s / (seconds - base[1])
    goal = throughput_goal(size / 2**30)
    ok = lambda x, goal, le: "PASS" if (x <= goal if le else x >= goal) else "MISS"  # noqa: E731
    return (f"{what:8s} {seconds:5.1f} s (start + imports {base[1]:.1f} s)  peak RssAnon {peak / 2**20:5.0f} MiB "
            f"(baseline {base[0] / 2**20:4.0f})\n"
            f"         above baseline / size = {mem:.3f} [{ok(mem, MEMORY_GOAL, True)} <= {MEMORY_GOAL}]   "
            f"throughput / copy = {speed:.2f} end to end [{ok(speed, goal, False)}], {net:.2f} net of "
            f"start + imports [{ok(net, goal, False)}] (goal >= {goal})")


FP8_BLOCK = 128
FP8_LINEAR = ("_proj.weight",)  # the decoder layers' linear weights; embeddings, head, norms stay bf16


def write_fp8_model(path: str, size_bytes: int) -> tuple[int, int, int]:
    """The synthetic Qwen2 as block FP8 (DeepSeek's layout: e4m3 linear weights, an F32
    ``weight_scale_inv`` per 128 x 128 block, the rest bf16) whose bf16 equivalent is
    ``size_bytes``; returns (FP8 input bytes, bf16 output bytes, layers)."""
    specs, layers = model_specs(size_bytes)
    out_specs = []
    for s in specs:
        if s.name.endswith(FP8_LINEAR):
            blocks = tuple(-(-d // FP8_BLOCK) for d in s.shape)
            out_specs += [TensorSpec(s.name, s.shape, torch.float8_e4m3fn),
                          TensorSpec(s.name.removesuffix("weight") + "weight_scale_inv", blocks, torch.float32)]
        else:
            out_specs.append(s)
    os.makedirs(path)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers,
              "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", **SHAPE,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    writer = ShardedSafetensorsWriter(path, out_specs, "400MB")
    g = torch.Generator().manual_seed(0)
    for s in out_specs:
        if s.dtype == torch.float8_e4m3fn:
            t = (torch.randn(s.shape, generator=g) * 64).clamp(-448, 448).to(s.dtype)
        elif s.name.endswith("weight_scale_inv"):
            t = torch.rand(s.shape, generator=g) * 1e-3 + 1e-4
        else:
            t = (torch.randn(s.shape, generator=g) * 0.02).to(s.dtype)
        writer.write(s.name, t)
    writer.close()
    return sum(s.nbytes for s in out_specs), sum(s.nbytes for s in specs), layers


def fp8_main(a: argparse.Namespace) -> None:
    """``--fp8``: the converter on a block-FP8 synthetic model (default dtype: bf16): peak memory
    above the baseline relative to the bf16 output and to the FP8 input, throughput vs a plain
    copy of the FP8 input."""
    work = a.workdir or tempfile.mkdtemp(prefix="convert_fp8_")
    syn, out, copy = (os.path.join(work, n) for n in ("hf_fp8", "mcore", "copy"))
    try:
        size_in, size_out, layers = write_fp8_model(syn, int(a.size_gb * 2**30))
        print(f"synthetic block-FP8 Qwen2: {layers} layers, {size_in / 2**30:.3f} GiB FP8 + scales in, "
              f"{size_out / 2**30:.3f} GiB bf16 out", flush=True)
        base = baseline(CONVERT_IMPORTS)
        copies, convs = [], []
        for _ in range(max(1, a.repeat)):
            warm(syn)
            copies.append(plain_copy(syn, copy))
            shutil.rmtree(copy)
            shutil.rmtree(out, ignore_errors=True)
            *conv, said = run_sampled([sys.executable, os.path.join(ROOT, "converters", "hf_to_mcore.py"),
                                       "--hf_model_path", syn, "--output_path", out])
            convs.append(conv)
        copy_s = statistics.median(copies)
        seconds, peak = (statistics.median(c[i] for c in convs) for i in range(2))
        above = peak - base[0]
        print(f"plain copy of the FP8 input {copy_s:6.2f} s; convert {seconds:6.2f} s (start + imports "
              f"{base[1]:.1f} s): throughput / copy {copy_s / seconds:.2f} end to end, "
              f"{copy_s / (seconds - base[1]):.2f} net of start + imports")
        print(f"peak RssAnon {peak / 2**20:.0f} MiB, baseline {base[0] / 2**20:.0f} MiB: above baseline "
              f"{above / 2**20:.0f} MiB = {above / size_out:.3f} x the bf16 output, {above / size_in:.3f} x the "
              f"FP8 input [{'PASS' if above / size_out <= MEMORY_GOAL else 'MISS'} <= {MEMORY_GOAL} x output]")
        print(said.strip().splitlines()[-1])
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size_gb", type=float, default=1.08, help="model size in GiB (default 1.08)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir, deleted)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs of each contender; medians (default 1)")
    ap.add_argument("--fp8", action="store_true", help="convert a block-FP8 model instead (fp8_main); "
                    "--size_gb is its bf16 size")
    ap.add_argument("--mxfp4", action="store_true", help="convert an MXFP4 gpt-oss-shaped model instead "
                    "(convert_mxfp4.py); --size_gb is its MXFP4 size")
    ap.add_argument("--mxfp4_export", action="store_true", help="with --mxfp4: also merge it back as MXFP4")
    a = ap.parse_args()
    if a.fp8:
        return fp8_main(a)
    if a.mxfp4:
        from benchmarks.convert_mxfp4 import mxfp4_main

        return mxfp4_main(a, sys.modules[__name__])
    work = a.workdir or tempfile.mkdtemp(prefix="convert_merge_")
    syn, out, merged, copy = (os.path.join(work, n) for n in ("hf", "mcore", "merged", "copy"))
    try:
        size, layers = write_model(syn, int(a.size_gb * 2**30))
        print(f"synthetic bf16 Qwen2: {layers} layers, {size / 2**30:.3f} GiB in "
              f"{len([n for n in os.listdir(syn) if n.endswith('.safetensors')])} shards", flush=True)
        bases = baseline(CONVERT_IMPORTS), baseline(MERGE_IMPORTS)
        copies, convs, merges, startups = [], [], [], []
        for _ in range(max(1, a.repeat)):
            warm(syn)
            copies.append(plain_copy(syn, copy))
            shutil.rmtree(copy)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(merged, ignore_errors=True)
            *conv, said = run_sampled([sys.executable, os.path.join(ROOT, "converters", "hf_to_mcore.py"),
                                       "--hf_model_path", syn, "--output_path", out])
            convs.append(conv)
            startup = re.search(r"start-up ([0-9.]+) s", said)
            startups.append(float(startup[1]) if startup else float("nan"))
            warm(out)
            *merge, _ = run_sampled([sys.executable, os.path.join(ROOT, "converters", "mcore_to_hf.py"), "merge",
                                     "--local_dir", out, "--target_dir", merged])
            merges.append(merge)
        copy_s = statistics.median(copies)
        print(f"plain copy {copy_s:6.1f} s  {size / copy_s / 2**20:6.0f} MiB/s (read + write + fsync, warm cache; "
              f"runs: {', '.join(f'{c:.2f}' for c in copies)})")
        med = lambda runs: tuple(statistics.median(r[i] for r in runs) for i in range(2))  # noqa: E731
        print(report("convert", *med(convs), bases[0], size, copy_s), flush=True)
        print(f"         runs: {', '.join(f'{c[0]:.2f}' for c in convs)} s; converter's own start-up (process "
              f"start to first tensor): median {statistics.median(startups):.1f} s", flush=True)
        print(report("merge", *med(merges), bases[1], size, copy_s), flush=True)
        print(f"merged == synthetic: {same_tensors(syn, merged)} tensors bit-identical")
        print(f"mbridge, quoted from an earlier measurement (1.07 GiB bf16 Qwen2), not measured in this run: "
              f"peak {MBRIDGE[0]}x model size, {MBRIDGE[1]}x copy throughput")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
