"""Typed config loading (OmegaConf structured configs): YAML + overrides fill nested dataclasses;
every mistake is a ConfigError naming the dotted path, the expected type and the value."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from mcore_rl.config_loader import ConfigError, dump_yaml, from_dict, load_config, to_dict
from mcore_rl.errors import McoreRLError


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"


@dataclass(frozen=True)
class Trainer:
    steps: int
    batch_size: int = 8
    grad_clip: Optional[float] = None
    optim: Optim = field(default_factory=Optim)
    save_every: int | None = None

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")


@dataclass
class Config:
    name: str
    trainer: Trainer
    seed: int = 0
    bf16: bool = True
    layers: list[int] = field(default_factory=lambda: [1, 2])
    tags: tuple[str, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)
    algo: Optional[Literal["ppo", "grpo"]] = None


BASE = """
name: run1
seed: 3
trainer:
  steps: 100
  grad_clip: 1
  optim:
    lr: 1e-4
    betas: [0.8, 0.95]
    schedule: linear
layers: [4, 5, 6]
tags: [a, b]
extra: {warmup: 2}
"""


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE)
    return path


def test_load_nested_with_defaults_and_coercion(cfg_file):
    cfg = load_config(Config, cfg_file)
    assert cfg.name == "run1" and cfg.seed == 3 and cfg.bf16 is True and cfg.algo is None
    assert cfg.trainer.steps == 100 and cfg.trainer.batch_size == 8
    assert cfg.trainer.grad_clip == 1.0 and isinstance(cfg.trainer.grad_clip, float)
    assert cfg.trainer.optim == Optim(lr=1e-4, betas=(0.8, 0.95), schedule="linear")
    assert cfg.layers == [4, 5, 6] and cfg.tags == ("a", "b")
    assert cfg.extra == {"warmup": 2.0} and isinstance(cfg.extra["warmup"], float)


def test_no_file_uses_defaults_and_overrides():
    cfg = load_config(Config, overrides=["name=x", "trainer.steps=5"])
    assert cfg == Config(name="x", trainer=Trainer(steps=5))


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(Config, path, ["name=x", "trainer.steps=1"]).seed == 0


def test_overrides(cfg_file):
    cfg = load_config(Config, str(cfg_file), [
        "trainer.optim.lr=3e-5",          # scientific notation without a dot is a float
        "trainer.steps=7",
        "trainer.save_every=null",
        "trainer.grad_clip=2",            # int -> float
        "layers=[1, 2]",                  # list value
        "tags=[x]",
        "bf16=false",
        "algo=grpo",
        "extra.kl=0.1",                   # creates a key in a dict section
        "name = spaced",
        "trainer.optim.lr=4e-5",          # later overrides win
    ])
    assert cfg.trainer.optim.lr == 4e-5 and cfg.trainer.steps == 7 and cfg.trainer.save_every is None
    assert cfg.trainer.grad_clip == 2.0 and cfg.layers == [1, 2] and cfg.tags == ("x",)
    assert cfg.bf16 is False and cfg.algo == "grpo" and cfg.extra == {"warmup": 2.0, "kl": 0.1}
    assert cfg.name == "spaced"


def test_override_creates_nested_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ntrainer: {steps: 1}\n")
    cfg = load_config(Config, path, ["trainer.optim.schedule=constant"])
    assert cfg.trainer.optim == Optim(schedule="constant")


def test_defaults_layer_and_interpolation(cfg_file):
    """A schema's own defaults layer may interpolate: seed follows trainer.steps unless set."""
    defaults = {"seed": "${trainer.steps}"}
    path = cfg_file.parent / "no_seed.yaml"
    path.write_text("name: n\ntrainer: {steps: 11}\n")
    assert load_config(Config, path, defaults=defaults).seed == 11
    assert load_config(Config, path, ["trainer.steps=5"], defaults=defaults).seed == 5
    assert load_config(Config, path, ["seed=2"], defaults=defaults).seed == 2
    with pytest.raises(ConfigError, match=re.escape("seed: cannot resolve '${nope}': Interpolation key 'nope' not found")):
        load_config(Config, path, ["seed=${nope}"])


def test_unknown_nested_key_names_path_and_known_keys(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_config(Config, cfg_file, ["trainer.optim.lrr=1"])
    assert str(e.value) == ("unknown key 'trainer.optim.lrr' (known keys of trainer.optim: "
                            "lr, betas, schedule); did you mean 'trainer.optim.lr'?")


def test_unknown_top_level_key():
    with pytest.raises(ConfigError) as e:
        from_dict(Config, {"name": "n", "trainer": {"steps": 1}, "zzz": 1})
    assert str(e.value) == ("unknown key 'zzz' (known keys at the top level: "
                            "name, trainer, seed, bf16, layers, tags, extra, algo)")


def test_unknown_key_in_file_names_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ntrainer: {steps: 1, batch_sise: 2}\n")
    with pytest.raises(ConfigError, match=re.escape(
            "unknown key 'trainer.batch_sise' (known keys of trainer: steps, batch_size, grad_clip, "
            "optim, save_every); did you mean 'trainer.batch_size'?")):
        load_config(Config, path)


@pytest.mark.parametrize("override, message", [
    ("trainer.steps=1.5", "trainer.steps: expected int, got 1.5 (float) (override 'trainer.steps=1.5': "),
    ("trainer.steps=true", "trainer.steps: expected int, got True (bool)"),
    ("bf16=yess", "bf16: expected bool, got 'yess' (str)"),
    ("trainer.optim.lr=fast", "trainer.optim.lr: expected float, got 'fast' (str)"),
    ("trainer.grad_clip=big", "trainer.grad_clip: expected Optional[float], got 'big' (str)"),
    ("layers=[1, x]", "layers[1]: expected int, got 'x' (str)"),
    ("layers=3", "layers: expected list[int], got 3 (int); write a YAML list like [1, 2]"),
    ("trainer.optim.betas=[0.9]", "trainer.optim.betas: expected tuple[float, float], "
                                  "got [0.9] (list); write a YAML list of 2 items"),
    ("extra.kl=no", "extra.kl: expected float, got False (bool)"),
    ("trainer=5", "trainer: expected Trainer, got 5 (int); write a mapping of keys for section Trainer"),
    ("seed.x=1", "seed: expected int, got {'x': 1} (dict)"),
])
def test_wrong_type_names_path_value_and_type(cfg_file, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Config, cfg_file, [override])


def test_wrong_type_in_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ntrainer: {steps: many}\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"trainer.steps: expected int, got 'many' (str) (file '{path}': ")):
        load_config(Config, path)


def test_bad_literal_lists_choices(cfg_file):
    with pytest.raises(ConfigError, match=re.escape(
            "trainer.optim.schedule: expected one of 'cosine', 'linear', 'constant', got 'cosin' (str)")):
        load_config(Config, cfg_file, ["trainer.optim.schedule=cosin"])
    with pytest.raises(ConfigError, match=re.escape("algo: expected Optional[Literal['ppo', 'grpo']], got 'dpo' (str)")):
        load_config(Config, cfg_file, ["algo=dpo"])


def test_missing_required_names_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ntrainer:\n  batch_size: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(Config, path)
    assert str(e.value) == ("missing required key 'trainer.steps' (int): set it in the YAML file "
                            "or override it with trainer.steps=<value>")
    with pytest.raises(ConfigError, match="missing required key 'name' "):
        from_dict(Config, {})


@pytest.mark.parametrize("override", ["trainer.steps", "=3", " =3", "a..b=1", "a.=1"])
def test_malformed_override(override):
    with pytest.raises(ConfigError) as e:
        load_config(Config, overrides=[override])
    assert str(e.value) == (f"malformed override {override!r}: expected the form key.path=value, "
                            "e.g. trainer.lr=1e-4")


def test_override_with_invalid_yaml_value():
    with pytest.raises(ConfigError, match=re.escape("override 'tags=[a': the value is not valid YAML")):
        load_config(Config, overrides=["tags=[a"])


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: '{missing}'")):
        load_config(Config, missing)


def test_top_level_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"config file '{path}': the top level must be a mapping of key: value lines, got list")):
        load_config(Config, path)


def test_invalid_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' is not valid YAML")):
        load_config(Config, path)


def test_post_init_validation_names_its_section(cfg_file):
    with pytest.raises(ConfigError, match=re.escape(
            "trainer: invalid Trainer: batch_size must be positive, got 0")) as e:
        load_config(Config, cfg_file, ["trainer.batch_size=0"])
    assert isinstance(e.value, McoreRLError) and isinstance(e.value, ValueError)


def test_to_dict_and_round_trip(cfg_file, tmp_path):
    cfg = load_config(Config, cfg_file, ["trainer.optim.lr=1e-10", "algo=ppo", "trainer.save_every=50"])
    plain = to_dict(cfg)
    assert plain["tags"] == ["a", "b"] and plain["trainer"]["optim"]["betas"] == [0.8, 0.95]
    text = dump_yaml(cfg)
    assert text.startswith("name: run1\n")
    out = tmp_path / "resolved.yaml"
    out.write_text(text)
    assert load_config(Config, out) == cfg


@pytest.mark.parametrize("override, message", [
    ("layers.0=5", "layers: expected list[int], got {'0': 5} (dict); write a YAML list like [1, 2] "
                   "(an override replaces the whole list: layers=[...])"),
    ("trainer.optim.betas.1=0.5", "trainer.optim.betas: expected tuple[float, float], got {'1': 0.5} (dict)"),
    ("trainer.optim.betas={a: 1}", "trainer.optim.betas: expected tuple[float, float], got {'a': 1} (dict)"),
    ("extra=[1]", "extra: expected dict[str, float], got [1] (list); write a mapping like {key: value}"),
])
def test_list_for_mapping_and_back_names_the_path(cfg_file, override, message):
    # OmegaConf raises a bare TypeError ("Cannot merge incompatible container types") here
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Config, cfg_file, [override])


@pytest.mark.parametrize("override, message", [
    ("layers=[[1]]", "layers[0]: expected int, got [1] (list)"),
    ("tags=[a, [b]]", "tags[1]: expected str, got ['b'] (list)"),
    ("trainer.optim.betas=[[0.9], 0.99]", "trainer.optim.betas[0]: expected float, got [0.9] (list)"),
    ("extra.w.x=1", "extra.w: expected float, got {'x': 1} (dict)"),
    ("extra={k: [1]}", "extra.k: expected float, got [1] (list)"),
])
def test_nested_container_in_a_scalar_slot_is_refused(cfg_file, override, message):
    # OmegaConf checks only the outer container's kind: these loaded before as nested lists/dicts
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Config, cfg_file, [override])
