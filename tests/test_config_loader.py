"""Typed config loading: YAML + overrides fill nested dataclasses; every mistake is a clear error."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from mcore_rl.config_loader import (
    ConfigError,
    apply_override,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
)


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
        "trainer.optim.lr=3e-5",          # scientific notation (YAML 1.1 reads it as a string)
        "trainer.steps=7",
        "trainer.save_every=null",
        "trainer.grad_clip=2",            # int -> float
        "layers=[1, 2]",                  # list value
        "tags=[x]",
        "bf16=false",
        "algo=grpo",
        "extra.kl=0.1",                   # creates a key in a dict section
        "name = spaced",
    ])
    assert cfg.trainer.optim.lr == 3e-5 and cfg.trainer.steps == 7 and cfg.trainer.save_every is None
    assert cfg.trainer.grad_clip == 2.0 and cfg.layers == [1, 2] and cfg.tags == ("x",)
    assert cfg.bf16 is False and cfg.algo == "grpo" and cfg.extra == {"warmup": 2.0, "kl": 0.1}
    assert cfg.name == "spaced"


def test_apply_override_creates_intermediate_sections():
    data: dict = {"a": None}
    apply_override(data, "x.y.z=1e-4")
    apply_override(data, "a.b=[1, 2]")
    apply_override(data, "s=foo")
    apply_override(data, "t=true")
    assert data == {"a": {"b": [1, 2]}, "x": {"y": {"z": "1e-4"}}, "s": "foo", "t": True}


def test_override_creates_nested_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ntrainer: {steps: 1}\n")
    cfg = load_config(Config, path, ["trainer.optim.schedule=constant"])
    assert cfg.trainer.optim == Optim(schedule="constant")


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


@pytest.mark.parametrize("override, message", [
    ("trainer.steps=1.5", "trainer.steps: expected int, got 1.5 (float); ints only"),
    ("trainer.steps=2.0", "trainer.steps: expected int, got 2.0 (float)"),
    ("trainer.steps=true", "trainer.steps: expected int, got True (bool)"),
    ("bf16=1", "bf16: expected bool, got 1 (int); write true or false"),
    ("bf16=yess", "bf16: expected bool, got 'yess' (str)"),
    ("name=2024", "name: expected str, got 2024 (int); quote it in YAML: '2024'"),
    ("trainer.optim.lr=fast", "trainer.optim.lr: expected float, got 'fast' (str)"),
    ("trainer.grad_clip=big", "trainer.grad_clip: expected float, got 'big' (str)"),
    ("layers=[1, x]", "layers[1]: expected int, got 'x' (str)"),
    ("layers=3", "layers: expected list[int], got 3 (int); write a YAML list"),
    ("trainer.optim.betas=[0.9]", "trainer.optim.betas: expected tuple[float, float], "
                                  "got [0.9] (list); needs exactly 2 items"),
    ("extra.kl=no", "extra.kl: expected float, got False (bool)"),
    ("trainer=5", "trainer: expected a mapping of keys for section Trainer, got 5 (int)"),
])
def test_wrong_type_names_path_value_and_type(cfg_file, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Config, cfg_file, [override])


def test_bad_literal_lists_choices(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_config(Config, cfg_file, ["trainer.optim.schedule=cosin"])
    assert str(e.value) == ("trainer.optim.schedule: 'cosin' (str) is not one of the choices "
                            "'cosine', 'linear', 'constant'")
    with pytest.raises(ConfigError, match=re.escape("algo: 'dpo' (str) is not one of the choices 'ppo', 'grpo'")):
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
        apply_override({}, override)
    assert str(e.value) == (f"malformed override {override!r}: expected the form key.path=value, "
                            "e.g. trainer.lr=1e-4")


def test_override_through_a_scalar():
    with pytest.raises(ConfigError, match=re.escape(
            "override 'seed.x=1': 'seed' is 3 (int), not a section, so it has no key 'x'")):
        apply_override({"seed": 3}, "seed.x=1")


def test_override_with_invalid_yaml_value():
    with pytest.raises(ConfigError, match=re.escape("override 'tags=[a': the value is not valid YAML")):
        apply_override({}, "tags=[a")


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


def test_post_init_validation_becomes_config_error():
    @dataclass
    class Positive:
        n: int = 1

        def __post_init__(self):
            if self.n <= 0:
                raise ValueError(f"n must be positive, got {self.n}")

    with pytest.raises(ConfigError, match=re.escape("<top level>: invalid Positive: n must be positive, got 0")):
        from_dict(Positive, {"n": 0})


def test_to_dict_and_round_trip(cfg_file, tmp_path):
    cfg = load_config(Config, cfg_file, ["trainer.optim.lr=1e-10", "algo=ppo", "trainer.save_every=50"])
    plain = to_dict(cfg)
    assert plain["tags"] == ["a", "b"] and plain["trainer"]["optim"]["betas"] == [0.8, 0.95]
    text = dump_yaml(cfg)
    assert text.startswith("name: run1\n")
    out = tmp_path / "resolved.yaml"
    out.write_text(text)
    assert load_config(Config, out) == cfg
