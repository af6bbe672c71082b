"""How a HF checkpoint lays out what the mapping table reads, beyond the table's own names.

* Vision-language wrappers (``registry.WRAPPERS``, e.g. ``Qwen3_5ForConditionalGeneration``):
  the text model's tensors are the table's under the wrapper's prefix; the vision tower and
  other tensors mcore_rl does not train (``WrapperSpec.carried``) are carried: ``load_hf``
  ignores them by name (said once), the converter copies them as stored into
  ``huggingface/CARRIED_FILE`` of the model directory, and the merge writes them back.
* Fused experts (published Qwen3.5-MoE): ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (each
  expert's gate rows, then its up rows) and ``<layer>.mlp.experts.down_proj`` [E, H, I] in place
  of transformers' per-expert ``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H] and
  ``down_proj`` [H, I] (transformers 5.24 reads both: its qwen2_moe conversion stacks the
  per-expert tensors over experts and concatenates gate and up). ``FusedExperts`` shows a source
  with fused experts as per-expert tensors (shapes checked first); the carried file's metadata
  records the layout, and ``fuse_stream`` turns the merge's per-expert output back into it.
  gpt-oss stores its experts only fused (transposed, gate/up interleaved, with biases:
  ``models.expert_layouts``): its merges and exports always fuse them.

No megatron import (the merge runs without it).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.models.expert_layouts import LAYOUTS, ExpertLayout
from mcore_rl.models.registry import WrapperSpec

Tensor = torch.Tensor
CARRIED_FILE = "mcore_rl_carried.safetensors"  # in a model directory's huggingface/ (fileio.files.HF_FILES)
EXPERTS_KEY = "experts"  # the carried file's metadata: "fused" or "per_expert"
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(.+)$")


class HFLayoutError(McoreRLError, ValueError):
    """A fused expert tensor that does not fit the config, or a checkpoint holding an expert twice."""


def carried_names(keys: Iterable[str], wrapper: WrapperSpec | None) -> list[str]:
    """The tensors of ``keys`` a wrapper carries (vision tower, ``mtp.*``), sorted; none without one."""
    if wrapper is None:
        return []
    return sorted(k for k in keys if k.startswith(wrapper.carried))


def log_ignored(names: list[str], wrapper: WrapperSpec, where: str) -> None:
    """Says which carried tensors a load leaves out (the vision tower is not trained)."""
    if names:
        vision = sum(n.startswith(wrapper.vision) for n in names)
        logging.getLogger("mcore_rl").info(
            "%s: ignoring %d tensors of %s that mcore_rl does not train (%d of the vision tower %s*, %d others: %s)",
            where, len(names), wrapper.hf_class, vision, wrapper.vision, len(names) - vision,
            sorted({n.split(".")[0] for n in names if not n.startswith(wrapper.vision)}))


def _shape(source: Mapping[str, Tensor], key: str) -> tuple[int, ...]:
    shapes = getattr(source, "shapes", None)  # a SafetensorsReader: from the header, no data read
    return tuple(shapes[key]) if shapes is not None and key in shapes else tuple(source[key].shape)


class FusedExperts(Mapping[str, Tensor]):
    """``source`` with each fused expert tensor shown as its per-expert tensors (names as
    transformers' per-expert checkpoints; each read slices one expert). ``layout``: how the
    checkpoint fuses them (``models.expert_layouts``); ``num_experts``, ``ffn`` (the expert's
    intermediate size I) and ``hidden`` (H) check the fused shapes."""

    def __init__(self, source: Mapping[str, Tensor], num_experts: int, ffn: int, hidden: int, where: str,
                 layout: ExpertLayout = LAYOUTS["qwen"]) -> None:
        self.source, self.ffn, self.layout = source, ffn, layout
        self.fused: dict[str, tuple[str, int, str, int]] = {}  # per-expert name -> (fused name, expert, kind, part)
        pattern, hidden_keys = layout.fused_pattern, set()
        for key in source:
            m = pattern.match(key)
            if m is None:
                continue
            kind = layout.kinds[m[2]]
            want, got = kind.shape(num_experts, ffn, hidden), _shape(source, key)
            if got != want:
                raise HFLayoutError(
                    f"{where}: fused expert tensor {key!r} has shape {list(got)}; the config (num_experts="
                    f"{num_experts}, expert intermediate size={ffn}, hidden_size={hidden}) needs {list(want)} "
                    f"({kind.what}): the checkpoint does not match its config.json.")
            for e in range(num_experts):
                for i, part in enumerate(kind.parts):
                    self.fused[f"{m[1]}.{e}.{part}"] = (key, e, m[2], i)
            hidden_keys.add(key)
        twice = sorted(set(self.fused) & set(source))
        if twice:
            raise HFLayoutError(f"{where}: experts stored both fused and per expert, e.g. {twice[0]!r} and "
                                f"{self.fused[twice[0]][0]!r}; keep one layout (re-export the checkpoint).")
        self._keys = [k for k in source if k not in hidden_keys] + list(self.fused)

    def __getitem__(self, key: str) -> Tensor:
        if key not in self.fused:
            if self.layout.fused_pattern.match(key):
                raise KeyError(key)
            return self.source[key]
        name, e, kind, i = self.fused[key]
        read = getattr(self.source, "read_part", None)
        expert = read(name, e) if read is not None else self.source[name][e]
        return self.layout.kinds[kind].split(expert, self.ffn)[i]

    def origin(self, key: str) -> str:
        """The stored tensor ``key`` is read from (a fused one with the expert and part)."""
        if key not in self.fused:
            return key
        name, e, kind, i = self.fused[key]
        labels = self.layout.kinds[kind].labels
        return f"{name}[{e}]" + (f" ({labels[i]})" if labels else "")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def expert_layout(args: Any) -> ExpertLayout:
    """How ``args``' architecture fuses experts: its registry entry's layout, else Qwen's."""
    return LAYOUTS[args.arch.fused_experts or "qwen"]


def always_fused(args: Any) -> bool:
    """Whether the architecture's HF checkpoints store experts fused only (gpt-oss): exports fuse."""
    return args.moe is not None and args.arch.fused_experts is not None


def has_fused_experts(keys: Iterable[str], layout: ExpertLayout = LAYOUTS["qwen"]) -> bool:
    pattern = layout.fused_pattern
    return any(pattern.match(k) for k in keys)


def hf_view(source: Mapping[str, Tensor], args: Any, where: str) -> Mapping[str, Tensor]:
    """``source`` as the mapping table reads it: fused experts of an MoE model shown per expert."""
    layout = expert_layout(args) if args.moe is not None else None
    if layout is None or not has_fused_experts(source, layout):
        return source
    return FusedExperts(source, args.moe.num_experts, args.moe.ffn_hidden_size, args.hidden_size, where, layout)


def read_carried(hf_dir: str) -> tuple[list[str], dict[str, str]]:
    """The names and metadata of ``hf_dir/CARRIED_FILE`` (([], {}) when it is absent)."""
    from safetensors import safe_open

    path = os.path.join(hf_dir, CARRIED_FILE)
    if not os.path.isfile(path):
        return [], {}
    with safe_open(path, framework="pt") as f:
        return list(f.keys()), dict(f.metadata() or {})


def carried_tensors(hf_dir: str) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of ``hf_dir/CARRIED_FILE``, in its order, one at a time."""
    from safetensors import safe_open

    with safe_open(os.path.join(hf_dir, CARRIED_FILE), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def write_carried(hf_dir: str, source: Mapping[str, Tensor], names: list[str], fused: bool) -> None:
    """Writes the carried tensors ``names`` of ``source`` as stored, and the experts' layout."""
    from safetensors.torch import save_file

    tensors = {n: source[n].contiguous() for n in names}
    save_file(tensors, os.path.join(hf_dir, CARRIED_FILE),
              metadata={EXPERTS_KEY: "fused" if fused else "per_expert"})


def carry_from_hf(source: str, hf_dir: str) -> None:
    """Gives ``hf_dir`` (a checkpoint's ``huggingface/``) the carried tensors of the HF directory
    ``source`` when it is a vision-language wrapper's, so that the step merges into a complete
    checkpoint (a model directory's ``huggingface/`` has its ``CARRIED_FILE`` already)."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.models.hf_json import read_config_json
    from mcore_rl.models.registry import WRAPPERS

    if os.path.isfile(os.path.join(source, CARRIED_FILE)) or not os.path.isfile(os.path.join(source, "config.json")):
        return
    wrapper = WRAPPERS.get(read_config_json(source).get("model_type"))
    if wrapper is None:
        return
    reader = SafetensorsReader(source)
    write_carried(hf_dir, reader, carried_names(reader, wrapper), has_fused_experts(reader))


def carried_bucket(source: Any) -> list[tuple[str, Tensor]]:
    """The carried tensors of a checkpoint's HF source (a model directory's ``huggingface/`` with
    ``CARRIED_FILE``, or a wrapper's HF directory) as one bucket; [] for anything else. What a
    step's ``hf_model`` content adds to the language model's tensors to be a complete checkpoint."""
    if not isinstance(source, (str, os.PathLike)):
        return []
    source = os.fspath(source)
    if os.path.isfile(os.path.join(source, CARRIED_FILE)):
        return list(carried_tensors(source))
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.models.hf_json import read_config_json
    from mcore_rl.models.registry import WRAPPERS

    wrapper = WRAPPERS.get(read_config_json(source).get("model_type")) \
        if os.path.isfile(os.path.join(source, "config.json")) else None
    if wrapper is None:
        return []
    reader = SafetensorsReader(source)
    return [(n, reader[n]) for n in carried_names(reader, wrapper)]


def fuse_stream(items: Iterable[tuple[str, Any]], num_experts: int,
                combine: Callable[[str, list[Any]], Any],
                layout: ExpertLayout = LAYOUTS["qwen"]) -> Iterator[tuple[str, Any]]:
    """Per-expert (name, item) pairs -> fused ones, in the order the last expert's arrive; other
    pairs pass as they are. ``combine(kind, parts)`` gets a fused kind of ``layout`` and its
    per-expert items, expert by expert, each expert's in ``FusedKind.parts`` order (tensors:
    ``layout.stack``; specs: the stacked spec)."""
    pending: dict[tuple[str, str], dict[tuple[int, str], Any]] = {}
    for name, item in items:
        m = _PER_EXPERT.match(name)
        kind = layout.kind_of_part(m[3]) if m is not None else None
        if kind is None:
            yield name, item
            continue
        parts = layout.kinds[kind].parts
        group = pending.setdefault((m[1], kind), {})
        group[(int(m[2]), m[3])] = item
        if len(group) == num_experts * len(parts):
            yield f"{m[1]}.{kind}", combine(kind, [group[(e, p)] for e in range(num_experts) for p in parts])
            del pending[(m[1], kind)]
    if pending:
        raise HFLayoutError(f"experts missing to fuse {sorted(pending)[:2]} (report this).")


def fused_buckets(buckets: Iterable[list[tuple[str, Tensor]]], num_experts: int, layout: ExpertLayout,
                  bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """HF buckets with per-expert tensors fused as ``layout`` stores them (a layer's experts are
    held until its last arrives), re-cut at ``bucket_bytes`` (a larger tensor alone)."""
    stream = ((n, t) for bucket in buckets for n, t in bucket)
    bucket: list[tuple[str, Tensor]] = []
    filled = 0
    for name, tensor in fuse_stream(stream, num_experts, layout.stack, layout):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and filled + nbytes > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += nbytes
    if bucket:
        yield bucket
