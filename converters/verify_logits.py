"""Loads a model directory at TP=1 (``load_model_dir``, into an fp32 engine) and compares its outputs
(actor logits, critic values) with transformers' model of the HF directory on sample inputs.

  python converters/verify_logits.py MODEL_DIR HF_DIR     # exit 1 when max |diff| > 1e-4 (fp32)
"""
from __future__ import annotations

import os
import sys
import tempfile

TOL = 1e-4  # fp32 compute on both sides (bf16 checkpoints: HF weights rounded to bf16 too)


def sample_batch(vocab_size: int, batch: int = 3, seq: int = 12, seed: int = 0) -> dict:
    """input_ids [b, s] and attention_mask [b, s] with left and right padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def compare(model_dir: str, hf_dir: str) -> tuple[float, float, float]:
    """(max abs diff, cosine, tolerance) between our outputs and transformers' on real tokens
    (a critic: the HF score head on the HF trunk's hidden states, per token; a reward model's
    bias-free head included)."""
    import torch
    import transformers

    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.checkpoint.storage import read_json
    from mcore_rl.errors import CheckpointError
    from mcore_rl.fileio.model_layout import layout_of
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.forward import chunk_forward
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    meta = read_json(os.path.join(model_dir, "mcore_rl.json"))
    role, dtype = meta.get("role"), getattr(torch, str(meta.get("params_dtype")).removeprefix("torch."), None)
    if role not in ("actor", "critic") or not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{model_dir}/mcore_rl.json: role {role!r}, params_dtype {meta.get('params_dtype')!r}; "
                              "expected role actor|critic and a torch dtype: not a model directory this "
                              "project wrote (pass global_step_<N>/actor or a hf_to_mcore.py output).")
    initialize_parallel_state(ParallelLayout())
    args = model_args_from_hf(layout_of(model_dir, meta).hf_dir(model_dir))
    # computed in fp32 either way: bf16 weights are checked against HF weights rounded to bf16
    engine = ModelEngine(args, ParallelLayout(), role, active_platform(), BuildOptions())
    load_model_dir(model_dir, engine)
    hf = _hf_model(transformers, role, hf_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype))
    batch = sample_batch(args.vocab_size)
    with torch.no_grad():
        if role == "actor":
            ref = hf(**batch).logits
        else:  # per token, also for a *ForSequenceClassification (which pools its logits)
            ref = hf.score(getattr(hf, hf.base_model_prefix)(**batch).last_hidden_state)
        ours = chunk_forward(engine.model[0], batch)[..., : ref.shape[-1]].float()
    real = batch["attention_mask"].bool()
    a, b = ours[real].double(), ref[real].double()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    return (a - b).abs().max().item(), cos, TOL


def _hf_model(transformers, role: str, hf_dir: str):
    """transformers' model of ``hf_dir`` in fp32: the causal LM, or the class its config names
    for a critic (token or sequence classification)."""
    import json

    import torch

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    auto = transformers.AutoModelForCausalLM
    if role == "critic":
        reward = any(a.endswith("ForSequenceClassification") for a in archs)
        auto = (transformers.AutoModelForSequenceClassification if reward
                else transformers.AutoModelForTokenClassification)
    if "quantization_config" in config:
        with tempfile.TemporaryDirectory(prefix="verify_dequantized_") as plain:
            _write_dequantized(hf_dir, config, plain)
            return auto.from_pretrained(plain, dtype=torch.float32, attn_implementation="eager").eval()
    return auto.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _write_dequantized(hf_dir: str, config: dict, out: str, shard_bytes: int = 1 << 30) -> None:
    """An FP8 or MXFP4 ``hf_dir`` (the quantizations the converter reads) written into ``out`` as
    the fp32 weights the converter's reader dequantizes (exact products) in shards of
    ~``shard_bytes``, with its config.json less ``quantization_config``: transformers' FP8 loading
    on CPU handles only shapes that are block multiples. The dequantization itself is checked
    independently (tests/test_fp8_import.py, tests/test_mxfp4_import.py); this compares the
    conversion's mapping and layout."""
    import json

    import torch
    from safetensors.torch import save_file

    from mcore_rl.mapping.hf_io import SafetensorsReader

    reader = SafetensorsReader(hf_dir, dequant_dtype=torch.float32)
    weight_map, shard, size = {}, {}, 0
    for name in list(reader) + [None]:
        if shard and (name is None or size >= shard_bytes):
            file = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            shard, size = {}, 0
        if name is not None:
            shard[name] = reader[name].float().contiguous()  # MXFP4 parameters come as transposed views
            size += shard[name].numel() * 4
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "quantization_config"}, f)


def main(argv: list[str]) -> int:
    """Exit code: 0 within tolerance, 1 above it, 2 bad input (one ``error:`` line)."""
    from mcore_rl.entry import error_line, os_error_line, quiet_third_party

    if len(argv) != 2 or any(a.startswith("-") for a in argv):
        print(f"error: verify_logits.py takes MODEL_DIR HF_DIR, got {argv!r} (see the usage in {__file__})",
              file=sys.stderr)
        return 2
    quiet_third_party(0)
    import torch

    from mcore_rl.errors import McoreRLError
    from mcore_rl.platform import init_distributed, setup_platform

    model_dir, hf_dir = argv
    platform = setup_platform("cpu")
    with tempfile.TemporaryDirectory(prefix="verify_store_", ignore_cleanup_errors=True) as store:
        init_distributed(platform, 0, 1, init_method=f"file://{store}/store")  # gloo may remove the file
        try:
            diff, cos, tol = compare(model_dir, hf_dir)
        except McoreRLError as e:  # a refused model directory: the message names the file and the fix
            print(error_line(e), file=sys.stderr)
            return 2
        except OSError as e:
            print(os_error_line(e, f"comparing {model_dir!r} with {hf_dir!r}"), file=sys.stderr)
            return 2
        finally:
            torch.distributed.destroy_process_group()
    ok = diff <= tol
    print(f"verify: max abs diff {diff:.3g} (tolerance {tol:g}), cosine {cos:.8f}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
