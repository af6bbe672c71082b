"""Hostile PEFT adapter directories: every case is refused with one McoreRLError naming the
directory, or imported exactly (log-probs equal peft's for what peft loads). The API part
imports every case into one model built once; the CLI part runs launch/train.py's main() on a
subset in one process (exit 2, one ``error:`` line, nothing written) and once through
launch/run.sh. Cases: shapes (mis-shaped factors broadcast before), names (lm_head, embeddings,
layers the model lacks, other prefixes: dropped before), config values and types, NaN/inf,
dtypes, missing/extra/damaged files, bad JSON."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist import run_ranks
from tests.lora_bodies import import_sweep
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 3e-5  # fp32: the fused (rank-expanded) qkv/fc1 adapters sum in another order than peft's pieces
ACTOR = dict(temperature=1.0, micro_batch_size=2, ppo_mini_batch_size=4)
P = "base_model.model.model.layers"
R = 4  # the adapters' rank
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEYS = {  # tensor -> its module's (out, in) in the tiny llama (hidden 64, kv 2 x 16, ffn 128)
    f"{P}.0.self_attn.q_proj.lora_A.weight": "A", f"{P}.1.self_attn.v_proj.lora_B.weight": "B",
    f"{P}.0.mlp.up_proj.lora_A.weight": "A", f"{P}.1.mlp.down_proj.lora_B.weight": "B",
    f"{P}.1.self_attn.o_proj.lora_A.weight": "A",
}
NAN = float("nan")


def _config_cases() -> dict:
    """name -> (adapter_config.json changes, accepted)."""
    bad = {
        "r0": {"r": 0}, "r_neg": {"r": -1}, "r_str": {"r": "4"}, "r_float": {"r": 4.0}, "r_bool": {"r": True},
        "r_none": {"r": None}, "r_other": {"r": 3},
        "alpha_str": {"lora_alpha": "8"}, "alpha_nan": {"lora_alpha": NAN}, "alpha_inf": {"lora_alpha": math.inf},
        "alpha_zero": {"lora_alpha": 0}, "alpha_list": {"lora_alpha": [8]}, "alpha_none": {"lora_alpha": None},
        "rslora_str": {"use_rslora": "yes"}, "rslora_r_neg": {"use_rslora": True, "r": -4},
        "rank_pattern_regex": {"rank_pattern": {"[": 2}},
        "rank_pattern_flags": {"rank_pattern": {"(?i)q_proj": 4}},  # valid alone, not inside peft's pattern
        "rank_pattern_zero": {"rank_pattern": {"q_proj": 0}}, "rank_pattern_str": {"rank_pattern": {"q_proj": "4"}},
        "rank_pattern_list": {"rank_pattern": [4]}, "rank_pattern_wrong": {"rank_pattern": {"o_proj": 3}},
        "alpha_pattern_regex": {"alpha_pattern": {"(": 2}}, "alpha_pattern_nan": {"alpha_pattern": {"q_proj": NAN}},
        "alpha_pattern_str": {"alpha_pattern": {"q_proj": "x"}},
        "target_unknown": {"target_modules": [*TARGETS, "query_key_value"]},
        "target_only_unknown": {"target_modules": ["query_key_value"]},
        "target_lm_head": {"target_modules": [*TARGETS, "lm_head"]},
        "target_empty": {"target_modules": []}, "target_none": {"target_modules": None},
        "target_int": {"target_modules": 5}, "target_list_int": {"target_modules": [1]},
        "target_bad_regex": {"target_modules": "("}, "target_str_nomatch": {"target_modules": "q_proj"},
        "target_subset": {"target_modules": ["q_proj"]}, "exclude_q": {"exclude_modules": ["q_proj"]},
        "experts_on_dense": {"target_parameters": ["mlp.experts.gate_up_proj"]},
        "peft_type": {"peft_type": "LOHA"}, "dora": {"use_dora": True}, "bias": {"bias": "all"},
        "fan_in_fan_out": {"fan_in_fan_out": True}, "modules_to_save": {"modules_to_save": ["lm_head"]},
        "layers_to_transform": {"layers_to_transform": [0]}, "lora_bias": {"lora_bias": True},
        "qalora": {"use_qalora": True}, "trainable_tokens": {"trainable_token_indices": [1, 2]},
    }
    good = {
        "plain": {}, "alpha_neg": {"lora_alpha": -8}, "alpha_float": {"lora_alpha": 12.5},
        "rslora": {"use_rslora": True},
        "alpha_pattern": {"alpha_pattern": {"v_proj": 3, "down_proj": 5}},
        "target_regex": {"target_modules": r".*\.(q|k|v|o|gate|up|down)_proj"},
        "all_linear": {"target_modules": "all-linear"},
        "extra_keys": {"runtime_config": {"ephemeral_gpu_offload": False}, "revision": None},
    }
    return {**{k: (v, False) for k, v in bad.items()}, **{k: (v, True) for k, v in good.items()}}


def _tensor_mutations() -> dict:
    """name -> (function(tensor dict, key), accepted); each applied to every KEYS entry."""
    def reshape(shape_of):
        def change(t, k):
            t[k] = torch.randn(*shape_of(t[k].shape))
        return change

    def values(fill):
        def change(t, k):
            t[k] = t[k].clone()
            t[k].view(-1)[3] = fill
        return change

    def dtype(dt):
        def change(t, k):
            t[k] = t[k].to(dt) if dt.is_floating_point else (t[k] * 10).to(dt)
        return change

    return {
        "narrow": (reshape(lambda s: (s[0], 1)), False), "flat": (reshape(lambda s: (1, s[1])), False),
        "transposed": (reshape(lambda s: (s[1], s[0])), False),
        "rank_up": (reshape(lambda s: (R + 1, s[1]) if s[0] == R else (s[0], R + 1)), False),
        "wide": (reshape(lambda s: (s[0], s[1] * 2)), False), "one_d": (reshape(lambda s: (s[0] * s[1],)), False),
        "three_d": (reshape(lambda s: (1, s[0], s[1])), False), "empty": (reshape(lambda s: (0, s[1])), False),
        "nan": (values(NAN), False), "inf": (values(math.inf), False), "ninf": (values(-math.inf), False),
        "int64": (dtype(torch.int64), False), "bool": (dtype(torch.bool), False),
        "missing": (lambda t, k: t.pop(k), False),
        "fp16": (dtype(torch.float16), True), "bf16": (dtype(torch.bfloat16), True),
        "fp64": (dtype(torch.float64), True),
    }


EXTRA_NAMES = {
    "lm_head": "base_model.model.lm_head.lora_A.weight",
    "embedding": "base_model.model.model.embed_tokens.lora_embedding_A",
    "layer_missing": f"{P}.7.self_attn.q_proj.lora_A.weight",
    "other_prefix": "model.layers.0.self_attn.q_proj.lora_A.weight",
    "default_name": f"{P}.0.self_attn.q_proj.lora_A.default.weight",
    "magnitude": f"{P}.0.self_attn.q_proj.lora_magnitude_vector",
    "random": "foo",
}


def _write_cases(root, plain: str) -> dict:
    """name -> (directory, accepted): at least 100 variations of the peft-written ``plain``."""
    tensors = load_file(os.path.join(plain, "adapter_model.safetensors"))
    config = json.load(open(os.path.join(plain, "adapter_config.json")))
    cases = {}

    def write(name, cfg=None, ts=None, accepted=False, raw_config=None):
        d = os.path.join(root, name)
        os.makedirs(d)
        if ts is not None:
            save_file(ts, os.path.join(d, "adapter_model.safetensors"))
        if raw_config is not None:
            open(os.path.join(d, "adapter_config.json"), "wb").write(raw_config)
        elif cfg is not None:
            json.dump(cfg, open(os.path.join(d, "adapter_config.json"), "w"))
        cases[name] = (d, accepted)

    for name, (change, accepted) in _config_cases().items():
        write(f"config_{name}", {**config, **change}, tensors, accepted)
    for name, (change, accepted) in _tensor_mutations().items():
        for i, key in enumerate(KEYS):
            ts = dict(tensors)
            change(ts, key)
            write(f"tensor_{name}_{i}", config, ts, accepted)
    for name, key in EXTRA_NAMES.items():
        write(f"extra_{name}", config, {**tensors, key: torch.randn(4, 64)})
    write("file_no_tensors", config)
    write("file_no_config", None, tensors)
    for name, raw in {"json_truncated": b"{", "json_empty": b"", "json_bytes": b"\xff\xfe", "json_list": b"[]",
                      "json_string": b'"LORA"', "json_nested": b"[" * 100000 + b"]" * 100000}.items():
        write(f"file_{name}", None, tensors, raw_config=raw)
    write("file_garbage", config)
    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"  # a header length longer than the file
    open(os.path.join(cases["file_garbage"][0], "adapter_model.safetensors"), "wb").write(garbage)
    write("file_truncated", config)
    data = open(os.path.join(plain, "adapter_model.safetensors"), "rb").read()
    open(os.path.join(cases["file_truncated"][0], "adapter_model.safetensors"), "wb").write(data[: len(data) // 2])
    write("file_bin_only", config)
    torch.save(tensors, os.path.join(cases["file_bin_only"][0], "adapter_model.bin"))
    write("file_second_safetensors", config, tensors)
    second = os.path.join(cases["file_second_safetensors"][0], "x.safetensors")
    save_file({"foo.lora_A.weight": torch.zeros(4, 64)}, second)
    write("file_extra_harmless", config, tensors, True)
    open(os.path.join(cases["file_extra_harmless"][0], "README.md"), "w").write("# adapter\n")
    cases["file_missing_dir"] = (os.path.join(root, "does_not_exist"), False)
    return cases


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("sweep")
    hf = tiny_hf_model(tiny_config("llama", vocab_size=16, num_hidden_layers=2))
    hf.save_pretrained(root / "hf")
    model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=R, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                                                          init_lora_weights=False))
    with torch.no_grad():  # peft's random B is tiny: scale it so the adapters matter far above TOL
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(10)
    model.save_pretrained(root / "plain")
    cases = _write_cases(root / "cases", str(root / "plain"))
    batch = rl_batch(16, batch=4, prompt=6, response=4)
    got = run_ranks(1, import_sweep, str(root / "hf"), {k: d for k, (d, _) in cases.items()}, batch, ACTOR)[0]
    return root, hf, cases, batch, got


def test_every_case_is_refused_clearly_or_imported_exactly(sweep):
    from peft import PeftModel

    root, hf, cases, batch, got = sweep
    assert len(cases) >= 100
    base, _ = hf_log_probs(hf, batch)
    for name, (directory, accepted) in cases.items():
        result = got[name]
        assert result[0] != "crash", f"{name}: {result[1]}"
        if not accepted:
            assert result[0] == "refused", f"{name} was imported"
            assert directory in result[2] and "\n" not in result[2].strip(), f"{name}: {result[2]}"
            continue
        assert result[0] == "ok", f"{name}: {result}"
        want, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), directory), batch)
        assert (result[1] - want).abs().max() <= TOL, name
        assert (want - base).abs().max() > 1e-3, name  # the adapter matters


NAMED = {  # case -> what its refusal names (issue #37 items 1, 2 and 11)
    "tensor_narrow_0": "q_proj.lora_A.weight has shape [4, 1], the model and the config's rank need [4, 64]",
    "tensor_flat_1": "v_proj.lora_B.weight has shape [1, 4], the model and the config's rank need [32, 4]",
    "tensor_narrow_1": "v_proj.lora_B.weight has shape [32, 1]",
    "extra_lm_head": "['base_model.model.lm_head.lora_A.weight'] name no linear mcore_rl can adapt",
    "extra_embedding": "embed_tokens.lora_embedding_A'] name no linear",
    "extra_layer_missing": "layers.7.self_attn.q_proj.lora_A.weight'] name no linear",
    "extra_other_prefix": "['model.layers.0.self_attn.q_proj.lora_A.weight'] name no linear",
    "config_target_only_unknown": "target_modules entry 'query_key_value' matches no linear",
    "config_target_unknown": "supported targets: ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj'",
    "config_r0": "r=0 must be an integer > 0", "config_r_str": "r='4' must be an integer > 0",
    "config_alpha_str": "lora_alpha='8' must be a finite", "config_alpha_nan": "lora_alpha=nan must be a finite",
    "config_rank_pattern_regex": "rank_pattern entry '[' is not a valid regular expression",
    "config_rslora_r_neg": "r=-4 must be an integer > 0",
    "tensor_rank_up_1": "v_proj.lora_B.weight has shape [32, 5], the model and the config's rank need [32, 4]",
    "tensor_wide_0": "q_proj.lora_A.weight has shape [4, 128]",
    "tensor_nan_0": "q_proj.lora_A.weight holds NaN or infinite values",
    "file_json_string": "holds str 'LORA', not a JSON object", "file_bin_only": "holds no adapter_model.safetensors",
}


@pytest.mark.parametrize("name", NAMED)
def test_refusal_names_the_cause(sweep, name):
    result = sweep[-1][name]
    assert result[0] == "refused" and NAMED[name] in result[2], result


def test_zero_trainable_parameters_is_a_clear_error(sweep):
    result = sweep[-1]["no_trainable_parameter"]
    assert result[0] == "refused" and "no trainable parameter" in result[2], result


def test_peft_refuses_what_is_refused_for_shape(sweep):
    """peft itself refuses the mis-shaped factors (a truncated or hand-edited file)."""
    from peft import PeftModel

    root, hf, cases, _, _ = sweep
    for name in ("tensor_narrow_0", "tensor_flat_1", "tensor_rank_up_2"):
        with pytest.raises(RuntimeError, match="size mismatch"):
            PeftModel.from_pretrained(copy.deepcopy(hf), cases[name][0])


CLI_CASES = ["config_r0", "config_alpha_nan", "config_rank_pattern_regex", "config_target_only_unknown",
             "tensor_narrow_1", "tensor_nan_0", "extra_lm_head", "file_json_truncated", "file_no_tensors", "config_plain"]
DRIVER = r"""
import contextlib, io, json, sys, traceback
sys.path.insert(0, "launch")
import train
from megatron.core import parallel_state
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    sys.argv = ["train.py", *argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            train.main()
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            code = "crash"
            traceback.print_exc()
    parallel_state.destroy_model_parallel()
    out[name] = [code, err.getvalue()]
print("RESULT " + json.dumps(out))
"""


def _argv(root, directory: str, name: str) -> list[str]:
    return ["--config", os.path.join(ROOT, "configs", "grpo_demo.yaml"), "steps=0", "progress_bar=false",
            "layout.tp=1", f"output_dir={root / 'jobs' / name}", f"model.hf_dir={root / 'hf'}",
            "actor.lora.rank=1", f"actor.lora.adapter_path={directory}"]


def test_main_job_cli_refuses_in_one_line_and_writes_nothing(sweep):
    root, _, cases, _, _ = sweep
    argvs = {name: _argv(root, cases[name][0], name) for name in CLI_CASES}
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    for name, (code, err) in json.loads(line[0][len("RESULT "):]).items():
        if cases[name][1]:
            assert code in (0, None), f"{name}: {err}"
            continue
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"{name}: {code} {err}"
        assert not os.path.exists(root / "jobs" / name), name


def test_run_sh_refuses_a_damaged_adapter_in_one_line(sweep):
    root, _, cases, _, _ = sweep
    env = {**os.environ, "PYTHONPATH": ROOT, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    args = _argv(root, cases["tensor_flat_3"][0], "run_sh")
    done = subprocess.run(["bash", "launch/run.sh", "1", *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, f"exit {done.returncode}\n" + "\n".join(lines[-40:])
    assert lines[0].startswith("error: ") and "lora_B.weight" in lines[0] and "shape" in lines[0], lines
    assert not os.path.exists(root / "jobs" / "run_sh")
    shutil.rmtree(root / "jobs", ignore_errors=True)
