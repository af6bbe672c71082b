"""Weight mapping of multi-token-prediction (MTP) layers (rows: ``MappingTable.mtp``).

Canonical megatron names: ``mtp.layers.{i}.<own>`` (enorm, hnorm, eh_proj, final_layernorm) and
``mtp.layers.{i}.transformer_layer.<layer-relative canonical name>``; MTP layer i's decoder layer
maps as decoder layer ``num_layers + i``, its HF names moved under the table's
``mtp_layer_prefix`` (DeepSeek-V3: HF layer ``num_layers + i`` itself; Qwen: ``mtp.layers.{i}``).
In a hybrid model it is a full-attention layer (no Gated DeltaNet rows). The HF copies of the
word embedding and LM head each MTP layer holds are extra HF names of the shared megatron
parameter (``Copies``): imported only when equal to the main tensor, exported as copies of it.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.tables import Row
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.mapping.mtp_names import DEFAULT_PREFIX, is_mtp_key, mtp_layer_prefix

Tensor = torch.Tensor
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_IN_LAYER = "transformer_layer."


class MtpMappingError(McoreRLError, ValueError):
    """MTP tensors of a checkpoint that the megatron model cannot hold as they are."""


class Copies(Transform):
    """A shared parameter (``base`` layout) whose HF form is a main tensor plus equal copies:
    ``hf_names[0]`` the main one, the rest the MTP layers' copies."""

    def __init__(self, base: Transform, hf_names: tuple[str, ...]) -> None:
        super().__init__(f"{base.name}+copies", base.split_dim, base.expert)
        self.base, self.hf_names = base, hf_names

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        main = hf[0]
        for name, copy in zip(self.hf_names[1:], hf[1:]):
            if copy.shape != main.shape or copy.dtype != main.dtype or not torch.equal(copy, main):
                raise MtpMappingError(
                    f"{name} differs from {self.hf_names[0]}: megatron-core's MTP layers share the main model's "
                    "word embedding and output head, so a checkpoint whose MTP copy differs cannot be held; "
                    "build without the MTP layers (mtp.enable=false) or write the main tensor into the copy.")
        return self.base.to_mcore([main], dims)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        (main,) = self.base.to_hf(full, dims)
        return [main] + [main.clone() for _ in self.hf_names[1:]]

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        return self.base.shard(full, rank, size)

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        return self.base.unshard(locals_)


def with_copies(rows: dict[str, Row], mtp_rows: dict[str, Row], num_layers: int, count: int,
                tied: bool) -> dict[str, Row]:
    """``rows`` whose shared parameters (embedding, output head) also name the HF copies of
    ``count`` MTP layers; ``tied``: the output head is the embedding, so its copies join it."""
    rows = dict(rows)
    copies: dict[str, list[str]] = {}
    for template, (hf_templates, _) in mtp_rows.items():
        if template.startswith("mtp."):
            continue
        target = "embedding.word_embeddings.weight" if tied else template
        copies.setdefault(target, []).extend(t.format(layer=num_layers + i) for i in range(count) for t in hf_templates)
    for template, names in copies.items():
        if template in rows:
            hf, transform = rows[template]
            rows[template] = ((*hf, *names), Copies(transform, (*hf, *names)))
    return rows


def _hf_names(names: list[str], layer: int, depth: int, prefix: str) -> list[str]:
    """Decoder-layer HF ``names`` of layer ``layer`` (``<any prefix>layers.{layer}.<rest>``: a
    wrapper may spell the text model under its own prefix) moved under MTP layer ``depth``'s
    ``prefix``."""
    if prefix == DEFAULT_PREFIX:
        return names
    mark, new = f"layers.{layer}.", mtp_layer_prefix(prefix, layer - depth, depth) + "."
    out = []
    for n in names:
        at = n.find(mark)
        out.append(new + n[at + len(mark):] if at >= 0 else n)
    return out


def mtp_rule(canonical: str, num_layers: int, mtp_rows: dict[str, Row],
             decoder_rule: Callable[[str], tuple[list[str], Transform]],
             prefix: str = DEFAULT_PREFIX) -> tuple[list[str], Transform] | None:
    """HF names and transform of an MTP parameter (None: not an MTP name); its decoder layer's
    through ``decoder_rule`` of ``decoder.layers.{num_layers + i}.<rest>``, under ``prefix``."""
    m = MTP_LAYER.match(canonical)
    if m is None:
        return None
    depth, rest = int(m[1]), m[2]
    layer = num_layers + depth
    if rest.startswith(_IN_LAYER):
        names, transform = decoder_rule(f"decoder.layers.{layer}.{rest[len(_IN_LAYER):]}")
        return _hf_names(names, layer, depth, prefix), transform
    template = f"mtp.layers.{{mtp}}.{rest}"
    if template not in mtp_rows:
        raise MtpMappingError(f"megatron parameter {canonical!r} has no MTP row (MappingTable.mtp in "
                              "mcore_rl/mapping/tables.py); add one.")
    hf_templates, transform = mtp_rows[template]
    return [t.format(layer=layer) for t in hf_templates], transform


def _layer_rows(rows: dict[str, Row], moe: bool, moe_only: frozenset[str], dense_only: frozenset[str],
                linear_only: frozenset[str]) -> Iterator[tuple[str, Row]]:
    """The decoder-layer rows of an MTP layer: its MLP kind's, never a Gated DeltaNet's."""
    for template, row in rows.items():
        if "{layer}" in template and template not in (dense_only if moe else moe_only) and template not in linear_only:
            yield template, row


def mtp_hf_keys(rows: dict[str, Row], mtp_rows: dict[str, Row], num_layers: int, count: int, moe: bool,
                moe_only: frozenset[str], dense_only: frozenset[str], num_experts: int,
                linear_only: frozenset[str] = frozenset(), prefix: str = DEFAULT_PREFIX) -> set[str]:
    """Every HF tensor name of ``count`` MTP layers whose decoder layer is MoE (``moe``) or dense
    (the copies of shared tensors come with the shared rows)."""
    return {n for _, names, _ in mtp_rules(rows, mtp_rows, num_layers, count, moe, moe_only, dense_only,
                                           num_experts, linear_only, prefix) for n in names}


def mtp_canonical_params(model: torch.nn.Module, layer_name: Callable[[torch.nn.Module, str], str],
                         adapters: bool = False) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) of ``model``'s MTP block (none without one); ``layer_name``
    spells a decoder layer's layer-relative name as the checkpoint does."""
    mtp = getattr(model, "mtp", None)
    if mtp is None or adapters:
        return
    for depth, layer in enumerate(mtp.layers):
        for name, param in layer.named_parameters():
            if name.startswith(_IN_LAYER):
                name = _IN_LAYER + layer_name(layer.transformer_layer, name[len(_IN_LAYER):])
            yield f"mtp.layers.{depth}.{name}", param
        for name, buf in layer.transformer_layer.named_buffers():
            if name.endswith("mlp.router.expert_bias"):
                yield f"mtp.layers.{depth}.{_IN_LAYER}{name}", buf


_MTP_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")


def mtp_dist_key(canonical: str) -> tuple[str, tuple[int, ...]] | None:
    """Dist-checkpoint key and leading index of an MTP parameter (None: not one): megatron
    keys MTP layers by their own index, routed experts stacked under ``mlp.experts.experts``."""
    if not canonical.startswith("mtp."):
        return None
    e = _MTP_EXPERT.match(canonical)
    if e is None:
        return canonical, ()
    return f"{e[1]}experts.{e[3]}", (int(e[2]),)


def mtp_rules(rows: dict[str, Row], mtp_rows: dict[str, Row], num_layers: int, count: int, moe: bool,
              moe_only: frozenset[str], dense_only: frozenset[str], num_experts: int,
              linear_only: frozenset[str] = frozenset(),
              prefix: str = DEFAULT_PREFIX) -> Iterator[tuple[str, list[str], Transform]]:
    """(canonical name, HF names, transform) of every tensor group of ``count`` MTP layers, in
    file order (a merge's plan); the copies of shared tensors come with the shared rows;
    ``linear_only``: Gated DeltaNet rows (an MTP layer has full attention); ``prefix``: the
    table's ``mtp_layer_prefix``."""
    head = "decoder.layers.{layer}."
    for depth in range(count):
        layer = num_layers + depth
        for template, (hf_templates, transform) in _layer_rows(rows, moe, moe_only, dense_only, linear_only):
            for e in range(num_experts) if "{expert}" in template else [None]:
                rest = template[len(head):].format(expert=e)
                names = [t.format(layer=layer, expert=e) for t in hf_templates]
                yield f"mtp.layers.{depth}.{_IN_LAYER}{rest}", _hf_names(names, layer, depth, prefix), transform
        for template, (hf_templates, transform) in mtp_rows.items():
            if template.startswith("mtp."):
                yield template.format(mtp=depth), [t.format(layer=layer) for t in hf_templates], transform


def missing_mtp_hint(missing: list[str], num_layers: int, built: bool, prefix: str = DEFAULT_PREFIX) -> str:
    """The fix for a checkpoint lacking the MTP layers the model was built with ('' otherwise)."""
    if not built or not any(is_mtp_key(k, num_layers, 1 << 30, prefix) for k in missing):
        return ""
    return (" The missing tensors are multi-token-prediction layers the config declares: build without them "
            "(mtp.enable=false, ModelArgs.with_mtp(False)) or, with args from a config object, "
            "ModelArgs.for_weights(<the tensor names>).")
