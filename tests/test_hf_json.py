"""model_args_from_hf(directory) reads config.json without transformers; its ModelArgs must equal
those of transformers' config object for the same file, for every architecture, with every field
present, each field left out in turn (transformers' class default applies), and rope variants."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from mcore_rl.errors import McoreRLError
from mcore_rl.models.hf_config import ConfigError, model_args_from_hf
from mcore_rl.models.hf_json import CLASS_DEFAULTS
from mcore_rl.models.registry import ARCHITECTURES
from tests.tiny import tiny_config

ARCHS = sorted(ARCHITECTURES)


def _args(source) -> object:
    """ModelArgs, or mcore_rl's refusal as text."""
    try:
        return model_args_from_hf(source)
    except McoreRLError as e:
        return f"{type(e).__name__}: {e}"


def _both(directory) -> tuple[object, object]:
    """(ModelArgs or refusal) from the JSON reader and from transformers' config object; the
    second is None where transformers itself rejects the file (nothing to compare)."""
    try:
        hf_cfg = AutoConfig.from_pretrained(directory)
    except Exception:  # noqa: BLE001 - e.g. layer_types no longer matching num_hidden_layers
        return _args(directory), None
    return _args(directory), _args(hf_cfg)


def _write(directory, fields: dict) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))


def test_every_architecture_has_class_defaults_equal_to_transformers():
    assert set(CLASS_DEFAULTS) == set(ARCHITECTURES)
    for model_type, defaults in CLASS_DEFAULTS.items():
        cfg = AutoConfig.for_model(model_type)
        rope = cfg.rope_parameters
        for name, value in defaults.values.items():
            expected = rope.get(name) if name in ("rope_theta", "partial_rotary_factor") else getattr(cfg, name)
            assert value == expected and type(value) is type(expected), (model_type, name, value, expected)
        assert dict(defaults.aliases) == dict(getattr(cfg, "attribute_map", {})), model_type


@pytest.mark.parametrize("model_type", ARCHS)
def test_each_field_left_out_gives_transformers_args(tmp_path, model_type):
    full = json.loads(tiny_config(model_type).to_json_string(use_diff=False))
    _write(tmp_path / "full", full)
    json_args, hf_args = _both(tmp_path / "full")
    assert json_args == hf_args and not isinstance(json_args, str)
    differed = 0
    for key in sorted(set(full) - {"model_type"}):
        _write(tmp_path / "cut", {k: v for k, v in full.items() if k != key})
        json_args, hf_args = _both(tmp_path / "cut")
        assert json_args == hf_args or hf_args is None, (model_type, key)
        differed += json_args != model_args_from_hf(tmp_path / "full")
    assert differed >= 8, "leaving fields out changed too little for the comparison to mean anything"
    _write(tmp_path / "minimal", {"model_type": model_type})  # every field from the class defaults
    json_args, hf_args = _both(tmp_path / "minimal")
    assert json_args == hf_args


@pytest.mark.parametrize("model_type,fields", [
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 2,  # a Qwen2.5 file
               "rope_scaling": None, "rope_theta": 1e6}),
    ("mistral", {"sliding_window": 64}),
    ("glm4_moe", {"partial_rotary_factor": 0.75, "rope_theta": 1e6}),
    ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                     "rope_interleave": False, "q_lora_rank": None}),
    ("qwen3_moe", {"num_local_experts": 6, "mlp_only_layers": [1]}),
    ("mixtral", {"num_experts": 6}),
    # a legacy rope_scaling replaces the class's default YaRN rope_parameters (gpt-oss' published files)
    ("gpt_oss", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 32}, "rope_theta": 5e5}),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 7}),
])
def test_config_variants_give_transformers_args(tmp_path, model_type, fields):
    raw = json.loads(tiny_config(model_type).to_json_string())  # as save_pretrained writes it
    raw = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    _write(tmp_path, {**raw, **fields})
    json_args, hf_args = _both(tmp_path)
    assert json_args == hf_args, (json_args, hf_args)


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "not a valid JSON object .*list"),
    (b"{\"model_type\": \"llama\xff\"}", "not a valid JSON object"),
    ('{"model_type": ["llama"]}', "has no 'model_type' string"),
])
def test_bad_config_json_is_a_clear_error(tmp_path, text, match):
    (tmp_path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=match):
        model_args_from_hf(tmp_path)


def test_reading_a_directory_does_not_import_transformers(tmp_path):
    tiny_config("deepseek_v3").save_pretrained(tmp_path)
    code = ("import sys; from mcore_rl.models.hf_config import model_args_from_hf; "
            f"a = model_args_from_hf({str(tmp_path)!r}); print(a.num_layers, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["4", "False"]


@pytest.mark.parametrize("wrapper", ["qwen3_5", "qwen3_5_moe"])
def test_vision_language_wrappers_read_their_text_config_as_transformers(tmp_path, wrapper):
    """A published Qwen3.5 config (text_config + vision_config): the text model's ModelArgs, the
    wrapper's own tie_word_embeddings, each text field left out in turn, no text_config at all."""
    from mcore_rl.models.registry import WRAPPERS

    spec = WRAPPERS[wrapper]
    text = json.loads(tiny_config(spec.text_model_type).to_json_string(use_diff=False))
    full = {**json.loads(AutoConfig.for_model(wrapper).to_json_string()), "text_config": text}
    _write(tmp_path / "full", full)
    json_args, hf_args = _both(tmp_path / "full")
    assert json_args == hf_args and json_args.wrapper is spec and json_args.hidden_size == text["hidden_size"]
    assert json_args.arch.model_type == spec.text_model_type
    for tie in (True, False):  # the wrapper's field ties its head; text_config's says the opposite
        _write(tmp_path / "tie", {**full, "tie_word_embeddings": tie,
                                  "text_config": {**text, "tie_word_embeddings": not tie}})
        json_args, hf_args = _both(tmp_path / "tie")
        assert json_args == hf_args and json_args.tie_embeddings is tie
    for key in sorted(set(text) - {"model_type"}):
        _write(tmp_path / "cut", {**full, "text_config": {k: v for k, v in text.items() if k != key}})
        json_args, hf_args = _both(tmp_path / "cut")
        assert json_args == hf_args or hf_args is None, (wrapper, key)
    _write(tmp_path / "minimal", {"model_type": wrapper})
    json_args, hf_args = _both(tmp_path / "minimal")
    assert json_args == hf_args and json_args.num_layers == AutoConfig.for_model(wrapper).text_config.num_hidden_layers
    _write(tmp_path / "bad", {**full, "text_config": {**text, "model_type": "qwen3"}})
    with pytest.raises(ConfigError, match=r"text_config.model_type='qwen3' .*expected 'qwen3_5"):
        model_args_from_hf(tmp_path / "bad")
