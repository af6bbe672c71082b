"""Modules mcore_rl plugs into megatron-core's layer specs where its local modules fall short.

- ``TorchCoreAttention``: core attention for the CPU spec (causal + key padding, GQA, context
  parallelism, packed sequences attended one by one, sliding windows, gpt-oss's sink logits)
  through torch SDPA (``attention_ops``); megatron's local DotProductAttention has no CP, and on
  windowed layers its window mask replaces the padding mask.
- ``RMSNorm``: HF-exact RMSNorm that supports sequence parallel (megatron's WrappedTorchNorm
  refuses it); its weight is marked so ``finalize_model_grads`` sums its grads over TP.
- ``ValueHead``: the critic's hidden -> 1 projection, replicated over TP.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group, is_layer_window_attention, make_sharded_tensors_for_checkpoint,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from mcore_rl.models.attention_ops import attend, causal_window
from mcore_rl.models.context_parallel import cp_attention_mask, gather_cp
from mcore_rl.models.packing import packed_attention, packed_attention_cp
from mcore_rl.parallel.layout import LayoutError

Tensor = torch.Tensor


class TorchCoreAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v with a causal mask and an optional key-padding mask.

    forward: query [s, b, heads_local, d], key/value [s, b, groups_local, d],
    attention_mask None or bool [b, 1, 1, s] (True = padding key) -> [s, b, heads_local * d].
    Multi-latent attention's values are narrower than its keys (``v_channels`` < ``k_channels``):
    they are zero-padded to the key width and the padding columns dropped from the output.
    A padding query attends to itself only, so no row is fully masked (no NaN reaches later
    layers through padded positions).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        super().__init__(config=config)
        self.cp = config.context_parallel_size
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.left = _window_left(config.window_size) if windowed else None
        self.softmax_offset = _sink_parameter(config)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise LayoutError("attention bias is not supported by TorchCoreAttention; pass attention_bias=None.")
        d, dv = query.shape[-1], value.shape[-1]
        if dv == d:
            return self._attend(query, key, value, attention_mask, packed_seq_params)
        out = self._attend(query, key, F.pad(value, (0, d - dv)), attention_mask, packed_seq_params)
        return out.unflatten(-1, (query.shape[-2], d))[..., :dv].flatten(-2)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                packed_seq_params: Any) -> Tensor:
        dropout = self.dropout_p if self.training else 0.0
        sink = self.softmax_offset
        if packed_seq_params is not None:  # THD: [t, heads, d], attention within each sequence
            cu = packed_seq_params.cu_seqlens_q
            with self._dropout_rng(dropout):
                if self.cp > 1:
                    return packed_attention_cp(query, key, value, cu, self.scale, dropout, gather_cp, self.left, sink)
                return packed_attention(query, key, value, cu, self.scale, dropout, self.left, sink)
        s_q, b, heads, d = query.shape
        if self.cp > 1:  # keys and values of the whole sequence, masked by global position
            key, value = gather_cp(key), gather_cp(value)
            allowed = cp_attention_mask(s_q, attention_mask, query.device, self.left)
        else:
            allowed = self._mask(s_q, key.shape[0], attention_mask, query.device, self.left)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        with self._dropout_rng(dropout):
            out = attend(q, k, v, allowed, self.scale, dropout, sink)
        return out.permute(2, 0, 1, 3).reshape(s_q, b, heads * d)

    @staticmethod
    def _mask(s_q: int, s_k: int, padding: Optional[Tensor], device, left: Optional[int] = None) -> Tensor:
        """bool [s_q, s_k] or [b, 1, s_q, s_k]: causal (within ``left`` positions back when
        windowed), padding keys masked, a query sees itself."""
        allowed = causal_window(s_q, s_k, left, device)
        if padding is None:
            return allowed
        keys_ok = ~padding.reshape(padding.shape[0], 1, 1, s_k)
        return (allowed & keys_ok) | torch.eye(s_q, s_k, dtype=torch.bool, device=device)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """The sink logits split over TP on axis 0, as megatron's and TE's core attention save them."""
        state = self.state_dict(prefix="", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])

    def _dropout_rng(self, dropout: float):
        # heads are TP-split: each TP rank needs its own dropout stream, as in megatron's module
        if dropout > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def _window_left(window_size: tuple[int, int]) -> int:
    """The left extent of megatron's ``window_size`` (left, right); this attention is causal."""
    left, right = window_size
    if right != 0 or left < 0:
        raise LayoutError(f"window_size={tuple(window_size)}: TorchCoreAttention implements causal windows "
                          "(W - 1, 0) with W >= 1; set window_size=(W - 1, 0).")
    return left


def _sink_parameter(config: TransformerConfig) -> Optional[torch.nn.Parameter]:
    """gpt-oss's learnable sink logit per attention head of this TP rank (``softmax_type=
    'learnable'``), marked tensor-parallel on axis 0; None for vanilla softmax."""
    if config.softmax_type == "vanilla":
        return None
    if config.softmax_type != "learnable":
        raise LayoutError(f"softmax_type={config.softmax_type!r} is not implemented by TorchCoreAttention; "
                          "use 'vanilla' or 'learnable'.")
    heads = config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
    offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=_init_device(config)))
    if config.perform_initialization:
        config.init_method(offset)
    tensor_parallel.set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
    return offset


def _init_device(config: TransformerConfig) -> torch.device:
    """Where megatron creates parameters: the CPU with use_cpu_initialization, else the GPU."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), computed in fp32 as HF does. x: [..., hidden].

    With ``config.layernorm_zero_centered_gamma`` (Qwen3-Next / Qwen3.5) the weight is centred on
    0: y = (x / rms(x)) * (1 + weight), all in fp32 and rounded once, as those HF norms do."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.zero_centered = self._zero_centered(config)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        # with sequence parallel each TP rank sees part of the sequence: grads must be summed
        self.weight.sequence_parallel = config.sequence_parallel

    @staticmethod
    def _zero_centered(config: TransformerConfig) -> bool:
        return bool(config.layernorm_zero_centered_gamma)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class PlainRMSNorm(RMSNorm):
    """RMSNorm with its weight as is, whatever the config says: the Gated DeltaNet output norm,
    the one Qwen norm that is not zero-centred (megatron's zero-centred TE norm would store w - 1)."""

    @staticmethod
    def _zero_centered(config: TransformerConfig) -> bool:
        return False


class ValueHead(MegatronModule):
    """Critic head replacing GPTModel.output_layer: hidden [s(/tp), b, h] -> values [s, b, 1].

    Called as ``output_layer(hidden, weight=None, runtime_gather_output=None)`` and returns
    ``(values, None)`` like megatron's ColumnParallelLinear. Replicated over TP; with sequence
    parallel each rank projects its sequence chunk and the chunks are gathered.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, bias: bool) -> None:
        super().__init__(config=config)
        device = _init_device(config)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype, device=device))
        config.init_method(self.weight)
        self.bias = (
            torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device)) if bias else None
        )
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel
        self.sequence_parallel = config.sequence_parallel

    def forward(
        self, hidden: Tensor, weight: Optional[Tensor] = None, runtime_gather_output: Any = None
    ) -> tuple[Tensor, None]:
        values = F.linear(hidden, self.weight, self.bias)
        if self.sequence_parallel:
            # the loss is computed identically on every TP rank, so backward just splits
            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False
            )
        return values, None
