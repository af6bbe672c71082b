"""Reads a HuggingFace config (a directory or a transformers config object) into ModelArgs.

ModelArgs holds every architecture fact the builder and the mapping tables need, checked once
here so that unsupported settings fail with a message that names the value and the fix.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable

from mcore_rl.mapping.transforms import Dims
from mcore_rl.models.hf_json import CLASS_DEFAULTS, JsonHFConfig, read_config_json
from mcore_rl.models.hybrid import HybridArgs, hybrid_args_from_hf
from mcore_rl.models.mla import MLAArgs, mla_args_from_hf, mla_rope_kwargs
from mcore_rl.models.moe import MoEArgs, moe_args_from_hf
from mcore_rl.models.mtp import check_buildable, resolve_mtp_layers
from mcore_rl.models.registry import WRAPPERS, ArchSpec, GluFields, WrapperSpec, lookup_arch
from mcore_rl.models.rope import MLA_ROPE_TYPES, RopeSpec, rope_spec_from_hf, yarn_config_attributes
from mcore_rl.models.windows import WindowConfigError, window_from_hf
from mcore_rl.errors import McoreRLError


class ConfigError(McoreRLError, ValueError):
    """A HF config mcore_rl cannot build a model from; the message names the value and the fix."""


@dataclass(frozen=True)
class GluArgs:
    """The gated MLP's activation (registry ``GluFields`` read from a config):
    ``activation(min(gate, clamp)) * (clamp(up, -clamp, clamp) + linear_offset)``."""

    activation: str = "silu"
    linear_offset: float = 0.0
    clamp: float | None = None


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a decoder-only HF model, normalised from its config."""

    arch: ArchSpec
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    tie_embeddings: bool
    rope: RopeSpec
    attention_dropout: float
    init_std: float
    value_head_bias: bool
    moe: MoEArgs | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    mla: MLAArgs | None = None  # multi-latent attention (head_dim is then its q/k head size)
    hybrid: HybridArgs | None = None  # Gated DeltaNet layers mixed with gated attention
    mtp_layers: int = 0  # multi-token-prediction layers the HF checkpoint holds (models/mtp.py)
    mtp_build: bool = True  # build, load and export them (False: left out, their tensors skipped)
    # the word embedding's padding row (transformers' padding_idx, in [0, vocab_size)): its
    # lookup sends no gradient to that row (models/padding_idx.py); None: no padding row
    pad_token_id: int | None = None
    # a vision-language wrapper (Qwen3_5ForConditionalGeneration): the text model is under its
    # prefix, its vision tower is carried through (actor only); None: a text checkpoint
    wrapper: WrapperSpec | None = None
    # every linear has a bias (megatron's add_bias_linear: q/k/v, o_proj, router, experts)
    linear_bias: bool = False
    glu: GluArgs = GluArgs()
    # sliding-window attention (models/windows.py): W tokens a query sees, itself included, on the
    # layers marked True; None: no window anywhere
    window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    attention_sinks: bool = False  # gpt-oss: a learnable sink logit per attention head

    def hf_rows(self, role: str) -> dict:
        """The mapping rows of this model as ``role``, HF names as its checkpoint spells them
        (a wrapper's text model under ``wrapper.hf_prefix``). A wrapper has no critic."""
        if self.wrapper is None:
            return self.arch.table.rows(role, self.features)
        check_wrapper_role(self, role)
        return self.arch.table.rows(role, self.features, hf_prefix=self.wrapper.hf_prefix)

    def with_pad_token_id(self, pad_token_id: Any, source: str = "pad_token_id") -> ModelArgs:
        """These args with the padding row of a config whose pad id was set elsewhere (verl sets
        ``pad_token_id`` from the tokenizer); ``source`` names that value in errors. An
        architecture whose embedding has no padding_idx keeps None."""
        if self.arch.pad_row_field is None:
            return self
        return replace(self, pad_token_id=_pad_row(pad_token_id, self.vocab_size, source))

    @property
    def mtp_built(self) -> int:
        """The MTP layers an actor is built with (0: none); more than one sharing one fc/norm set
        (Qwen's layout) is refused here, so a model built without them still loads."""
        if not self.mtp_build:
            return 0
        check_buildable(self.mtp_layers, self.arch.table.mtp_shared, self.arch.model_type, self.arch.mtp_layers_field)
        return self.mtp_layers

    def with_mtp(self, build: bool) -> ModelArgs:
        """These args with the checkpoint's MTP layers built (True) or left out (False)."""
        return replace(self, mtp_build=build)

    def for_weights(self, names: Iterable[str], where: str = "the weights") -> ModelArgs:
        """These args with the MTP layer count checked against the HF tensor ``names`` the model
        will load (args read from a config object: a transformers model in memory holds none)."""
        field = self.arch.mtp_layers_field
        if not field or self.wrapper is not None:  # a wrapper's mtp.* are carried, not built
            return self
        table = self.arch.table
        return replace(self, mtp_layers=resolve_mtp_layers(self.mtp_layers, set(names), self.num_layers, field, where,
                                                           table.mtp_layer_prefix))

    @property
    def features(self) -> frozenset[str]:
        """Optional row groups of the mapping table this model has (``MappingTable.variants``)."""
        on = {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}
        if self.mla is not None:
            on["q_lora" if self.mla.q_lora_rank else "q_full"] = True
        return frozenset(n for n, v in on.items() if v)

    def mapping_dims(self, padded_vocab_size: int) -> Dims:
        """The sizes the mapping transforms read, the vocab padded to ``padded_vocab_size``."""
        mla = self.mla
        return Dims(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            padded_vocab_size=padded_vocab_size,
            qk_rope_head_dim=mla.qk_rope_head_dim if mla else 0,
            kv_lora_rank=mla.kv_lora_rank if mla else 0,
            rope_rows_split=bool(mla and not mla.rope_interleave),
            **({} if self.hybrid is None else dict(
                linear_key_heads=self.hybrid.key_heads,
                linear_value_heads=self.hybrid.value_heads,
                linear_key_head_dim=self.hybrid.key_head_dim,
                linear_value_head_dim=self.hybrid.value_head_dim,
            )),
        )


def check_wrapper_role(args: ModelArgs, role: str) -> None:
    """A vision-language wrapper is an actor's checkpoint: a critic of one is refused."""
    if args.wrapper is not None and role != "actor":
        raise ConfigError(
            f"model_type {args.wrapper.model_type!r} ({args.wrapper.hf_class}) is a vision-language checkpoint: "
            f"mcore_rl builds it as an actor only, not as a {role}. Start the {role} from a text model: "
            f"AutoModelForCausalLM.from_pretrained loads the checkpoint as {args.arch.hf_causal_lm} (model_type "
            f"{args.arch.model_type!r}); save that with save_pretrained and start the {role} from it.")


def _wrapped_text(cfg: Any, where: str) -> tuple[Any, WrapperSpec | None]:
    """The text model's config of a vision-language wrapper (``text_config``) and the wrapper;
    any other config as it is (and None). ``cfg``: a config.json dict or a transformers config."""
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else getattr(cfg, "model_type", None)
    wrapper = WRAPPERS.get(model_type)
    if wrapper is None:
        return cfg, None
    text = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    if text is None and isinstance(cfg, dict):
        text = {}  # transformers builds a default text config: so do its class defaults
    if not isinstance(text, dict) and not hasattr(text, "model_type"):
        raise ConfigError(f"{where}: text_config={text!r} of model_type {model_type!r} is not an object; "
                          "fix config.json (the text model's config).")
    kind = text.get("model_type", wrapper.text_model_type) if isinstance(text, dict) else text.model_type
    if kind != wrapper.text_model_type:
        raise ConfigError(f"{where}: text_config.model_type={kind!r} in a {model_type!r} config; expected "
                          f"{wrapper.text_model_type!r}: fix config.json.")
    return ({**text, "model_type": kind} if isinstance(text, dict) else text), wrapper


def _wrapper_tie(cfg: Any) -> bool:
    """Whether a wrapper's LM head is its embedding: the top-level ``tie_word_embeddings``
    (transformers ties by the wrapper's config; default false)."""
    tie = cfg.get("tie_word_embeddings", False) if isinstance(cfg, dict) else getattr(cfg, "tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json: tie_word_embeddings={tie!r} must be true or false; fix the value.")
    return tie


def _config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """config.json of a HF model directory, checked: an object with a known ``model_type``."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"no config.json in {os.fspath(directory)!r}; pass a HF model directory "
            "(as written by save_pretrained) or a transformers config object."
        )
    try:
        raw = read_config_json(directory)
    except ValueError as e:  # JSON syntax, bytes that are not UTF-8, or not an object
        raise ConfigError(f"{path} is not a valid JSON object ({e}); fix or re-export the file.") from e
    if not isinstance(raw.get("model_type"), str):
        raise ConfigError(f"{path} has no 'model_type' string; it is not a HF model config.")
    lookup_arch(raw["model_type"])  # a clear error before transformers' own
    return raw


def load_hf_config(source: Any):
    """A transformers config from a directory holding config.json, or the object itself."""
    if isinstance(source, (str, os.PathLike)):
        _config_json(source)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.fspath(source))
    if not hasattr(source, "model_type"):
        raise ConfigError(
            f"expected a HF model directory or a transformers config, got {type(source).__name__}."
        )
    return source


def _args_source(source: Any) -> tuple[Any, WrapperSpec | None, bool | None]:
    """What ``model_args_from_hf`` reads: a directory's config.json without transformers (the
    converters' start-up), or the config object given; of a vision-language wrapper its text
    config, the wrapper and its LM head tying (else None, None)."""
    if isinstance(source, (str, os.PathLike)):
        raw = _config_json(source)
        text, wrapper = _wrapped_text(raw, os.path.join(os.fspath(source), "config.json"))
        cfg = JsonHFConfig(text, CLASS_DEFAULTS[lookup_arch(text["model_type"]).model_type])  # kimi_k2: deepseek_v3
        return cfg, wrapper, _wrapper_tie(raw) if wrapper else None
    outer = load_hf_config(source)
    text, wrapper = _wrapped_text(outer, f"config (model_type {outer.model_type!r})")
    return text, wrapper, _wrapper_tie(outer) if wrapper else None


def _require(cfg: Any, name: str) -> Any:
    value = getattr(cfg, name, None)
    if value is None:
        raise ConfigError(
            f"config of model_type {cfg.model_type!r} is missing {name!r}; add it to config.json."
        )
    return value


# every size, scale and switch ModelArgs takes from the config: (name, kind); kind "count" is an
# integer >= 1, "size" an integer >= 0, "positive" a finite number > 0, "fraction" a number in [0, 1), "scale" >= 0,
# "flag" true/false (a string "no" would read as True), "table" an object (null: absent)
_CHECKED_FIELDS = (
    ("vocab_size", "count"), ("hidden_size", "count"), ("intermediate_size", "count"),
    ("num_hidden_layers", "count"), ("num_attention_heads", "count"), ("num_key_value_heads", "count"),
    ("head_dim", "count"), ("max_position_embeddings", "count"), ("rms_norm_eps", "positive"),
    ("attention_dropout", "fraction"), ("initializer_range", "scale"), ("rope_theta", "positive"),
    ("sliding_window", "size"), ("tie_word_embeddings", "flag"), ("attention_bias", "flag"),
    ("mlp_bias", "flag"), ("use_sliding_window", "flag"), ("token_classification_bias", "flag"),
    ("rope_parameters", "table"), ("rope_scaling", "table"),
)
_KIND_TEXT = {"count": "an integer >= 1", "size": "an integer >= 0", "positive": "a finite number > 0",
              "fraction": "a number in [0, 1)", "scale": "a finite number >= 0", "flag": "true or false",
              "table": "a JSON object or null"}


def _fits(value: Any, kind: str) -> bool:
    """Whether a config value is of ``kind`` (JSON types: a bool or a string is never a number)."""
    if kind in ("flag", "table"):
        return isinstance(value, bool if kind == "flag" else dict)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind in ("count", "size"):
        return isinstance(value, int) and value >= (1 if kind == "count" else 0)
    if not math.isfinite(value):
        return False
    return {"positive": value > 0, "fraction": 0 <= value < 1, "scale": value >= 0}[kind]


def check_config_values(cfg: Any, mla: bool = False) -> None:
    """Refuses a config whose sizes and scales are of the wrong type or range (``hidden_size:
    "64"``, ``num_hidden_layers: 0``, a negative eps), naming the key, the value and what it must
    be, before anything is built from them; and query heads that key/value heads do not divide.
    The message is the same for a directory and for its transformers config object."""
    where = f"config.json (model_type {cfg.model_type!r})"
    for name, kind in _CHECKED_FIELDS:
        value = getattr(cfg, name, None)
        if value is None:  # optional, or missing: _require names it
            continue
        if not _fits(value, kind):
            raise ConfigError(f"{where}: {name}={value!r} ({type(value).__name__}) must be {_KIND_TEXT[kind]}; "
                              "fix the value in config.json.")
        theta = value.get("rope_theta") if kind == "table" else None
        if theta is not None and not _fits(theta, "positive"):
            raise ConfigError(f"{where}: {name}.rope_theta={theta!r} ({type(theta).__name__}) must be "
                              f"{_KIND_TEXT['positive']}; fix the value in config.json.")
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is not None and not mla and heads % kv:  # MLA's key/value heads are its query heads
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
                          "fix the values in config.json.")


def _check_unsupported(cfg: Any, arch: ArchSpec) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported; {arch.model_type} needs 'silu'.")
    bias_read = arch.qkv_bias_field == "attention_bias" or arch.attention == "mla" or arch.linear_bias  # MLA: its own error
    if getattr(cfg, "attention_bias", False) and not arch.qkv_bias and not bias_read:
        raise ConfigError(
            f"attention_bias=True ({arch.model_type}) puts a bias on o_proj, which megatron-core's "
            "GPT layers lack; only checkpoints with attention_bias=False are supported."
        )
    if getattr(cfg, "mlp_bias", False):
        raise ConfigError("mlp_bias=True is not supported; set mlp_bias=False.")


def model_args_from_hf(source: Any, max_seq_len: int | None = None) -> ModelArgs:
    """Builds ModelArgs from a HF directory or config; ``max_seq_len`` defaults to the config's."""
    cfg, wrapper, wrapper_tie = _args_source(source)
    arch = lookup_arch(cfg.model_type)
    check_config_values(cfg, mla=arch.attention == "mla")
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")
    max_pos = _require(cfg, "max_position_embeddings")
    max_seq_len = max_seq_len or max_pos
    _check_unsupported(cfg, arch)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    num_layers = _require(cfg, "num_hidden_layers")
    mla = mla_args_from_hf(cfg) if arch.attention == "mla" else None
    if mla is not None:  # HF's head_dim is the rope part; megatron's query/key heads are whole
        rope = rope_spec_from_hf(cfg, mla.qk_rope_head_dim, MLA_ROPE_TYPES)
        mla_rope_kwargs(rope, max_pos)  # refuses YaRN settings megatron cannot express, now
        head_dim = mla.qk_head_dim
    else:
        rope = rope_spec_from_hf(cfg, head_dim, arch.rope_types)
        if rope.rope_type == "yarn":
            yarn_config_attributes(rope)  # refuses an attention factor megatron cannot apply, now
    vocab = _require(cfg, "vocab_size")
    try:
        window, window_layers = window_from_hf(cfg, arch.window_rule, num_layers, max_seq_len)
    except WindowConfigError as e:
        raise ConfigError(str(e)) from None
    moe = moe_args_from_hf(cfg, arch.moe, num_layers) if arch.moe else None
    return ModelArgs(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=_dense_ffn(cfg, moe),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads if mla else getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        norm_eps=_require(cfg, "rms_norm_eps"),
        max_position_embeddings=max_pos,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)) if wrapper is None else wrapper_tie,
        rope=rope,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=float(getattr(cfg, "initializer_range", 0.02)),
        value_head_bias=bool(getattr(cfg, "token_classification_bias", True)),
        moe=moe,
        hybrid=hybrid_args_from_hf(cfg, num_layers) if arch.hybrid else None,
        qkv_bias=_switch(cfg, arch.qkv_bias, arch.qkv_bias_field),
        qk_norm=_switch(cfg, arch.qk_norm, arch.qk_norm_field),
        mla=mla,
        # a vision-language wrapper carries its mtp.* tensors through untouched (not built)
        mtp_layers=_mtp_layers(source, cfg, arch, num_layers) if wrapper is None else 0,
        pad_token_id=(_pad_row(getattr(cfg, arch.pad_row_field, None), vocab, arch.pad_row_field)
                      if arch.pad_row_field else None),
        wrapper=wrapper,
        linear_bias=_linear_bias(cfg, arch),
        glu=_glu_args(cfg, arch.glu),
        window=window,
        window_layers=window_layers,
        attention_sinks=arch.attention_sinks,
    )


def _linear_bias(cfg: Any, arch: ArchSpec) -> bool:
    """An architecture with a bias on every linear; its config flag must agree (megatron's one
    ``add_bias_linear`` cannot drop the attention biases and keep the experts' and router's)."""
    if not arch.linear_bias:
        return False
    flag = getattr(cfg, arch.linear_bias_field, True) if arch.linear_bias_field else True
    if flag is not True:
        raise ConfigError(
            f"{arch.model_type}: {arch.linear_bias_field}={flag!r} is not supported: megatron-core has one switch "
            "(add_bias_linear) for the attention, router and expert biases, and this architecture's experts and "
            f"router always have biases; use a checkpoint with {arch.linear_bias_field}=true.")
    return True


# megatron's quick_gelu is x * sigmoid(1.702 * x), the constant written into its code
QUICK_GELU_ALPHA = 1.702


def _glu_args(cfg: Any, fields: GluFields) -> GluArgs:
    """The gated MLP's activation of ``cfg``; a sigmoid gain megatron cannot apply is refused."""
    if fields.alpha_field is not None:
        alpha = getattr(cfg, fields.alpha_field, QUICK_GELU_ALPHA)
        if alpha != QUICK_GELU_ALPHA:
            raise ConfigError(
                f"{cfg.model_type}: {fields.alpha_field}={alpha!r} is not supported: megatron-core's quick_gelu "
                f"hard-codes the sigmoid gain {QUICK_GELU_ALPHA}; use a checkpoint with {fields.alpha_field}="
                f"{QUICK_GELU_ALPHA}.")
    clamp = getattr(cfg, fields.clamp_field, None) if fields.clamp_field else None
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float))
                              or not math.isfinite(clamp) or clamp <= 0):
        raise ConfigError(f"{cfg.model_type}: {fields.clamp_field}={clamp!r} must be a finite number > 0 (or null); "
                          "fix the value in config.json.")
    return GluArgs(fields.activation, fields.linear_offset, None if clamp is None else float(clamp))


def _dense_ffn(cfg: Any, moe: MoEArgs | None) -> int:
    """The dense MLP width; a model whose every layer is sparse may leave it out (Qwen3.5-MoE)."""
    if moe is not None and all(moe.moe_layers) and getattr(cfg, "intermediate_size", None) is None:
        return moe.ffn_hidden_size
    return _require(cfg, "intermediate_size")


def _mtp_layers(source: Any, cfg: Any, arch: ArchSpec, num_layers: int) -> int:
    """The checkpoint's MTP layer count: the config's field, checked against (or, when the
    config is silent, taken from) a directory's tensor names."""
    if not arch.mtp_layers_field:
        return 0
    keys = None
    if isinstance(source, (str, os.PathLike)):
        from mcore_rl.mapping.hf_io import SafetensorsReader

        try:
            keys = set(SafetensorsReader(source)) or None  # no weights (a config copy): the config alone
        except (OSError, ValueError):  # unreadable weights: their reader names the problem later
            keys = None
    where = f"{os.fspath(source)}/config.json" if keys is not None else f"config (model_type {cfg.model_type!r})"
    return resolve_mtp_layers(getattr(cfg, arch.mtp_layers_field, None), keys, num_layers, arch.mtp_layers_field,
                              where, arch.table.mtp_layer_prefix)


def _pad_row(value: Any, vocab_size: int, source: str) -> int | None:
    """The embedding row transformers' ``nn.Embedding(..., padding_idx=value)`` holds: None, or
    an id in [-vocab_size, vocab_size) (a negative one counts from the end, as torch does)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}={value!r} is not a token id; set it to an integer below "
                          f"vocab_size({vocab_size}) or to null.")
    if not -vocab_size <= value < vocab_size:
        raise ConfigError(
            f"{source}={value} is outside the vocabulary (vocab_size={vocab_size}): transformers "
            f"refuses it as the embedding's padding_idx too; set it to a token id below {vocab_size} "
            "(or null), or resize the model's vocabulary.")
    return value % vocab_size


def _switch(cfg: Any, fixed: bool, field: str | None) -> bool:
    """An architecture's fixed feature, or the value of the config field that switches it."""
    return bool(getattr(cfg, field, False)) if field else fixed
