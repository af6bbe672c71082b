"""Gated DeltaNet layers that honour the padding mask and packed sequences.

megatron-core 0.16.1's ``GatedDeltaNet`` ignores ``attention_mask`` (a left-padded row's padding
leaks into its real tokens through the convolution) and refuses packed sequences. This subclass
keeps its parameters, sharding and checkpoint keys and replaces the forward: padded positions are
zeroed at the input projection (transformers does the same to the layer input), and in a packed
stream the causal convolution and the recurrent state restart at every sequence boundary
(``cu_seqlens``), so a packed batch gives the padded batch's per-token outputs and gradients.

The kernels are read from megatron's module when the layer runs: flash-linear-attention and
causal-conv1d where installed, else the torch versions the platform installs there
(``mcore_rl/platform/gdn_kernels.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as kernels
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, _split_tensor_factory

Tensor = torch.Tensor


def sequence_index(cu_seqlens: Tensor) -> Tensor:
    """[1, T] int32: the index of the packed sequence each stream token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, lengths)[None]


class PackedGatedDeltaNet(GatedDeltaNet):
    """megatron's GDN layer with padding masks and packed sequences (``forward`` below);
    hidden_states [s(/tp with SP), b, h] -> (output [s(/tp), b, h], bias)."""

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        key_value_states: Optional[Tensor] = None,
        inference_context: Any = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``attention_mask``: None or bool [b, 1, 1, s] (True = padding); ``packed_seq_params``:
        a THD stream [T, 1, h] with ``cu_seqlens_q`` (then the mask is None)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("Gated DeltaNet layers have no inference cache in mcore_rl; "
                                      "generate with a rollout engine.")
        mixed, _ = self.in_proj(hidden_states)  # [s, b, in_proj/tp]: with SP the whole sequence
        cu_seqlens = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
        if cu_seqlens is None and attention_mask is not None:
            # no bias in in_proj: zeroing its output is zeroing the layer's input, as transformers does
            keep = ~attention_mask.reshape(attention_mask.shape[0], -1).transpose(0, 1)
            mixed = mixed * keep[..., None].to(mixed.dtype)
        core, gate = self._mix(mixed.transpose(0, 1), cu_seqlens)
        out = self._gated_norm(core, gate)  # [b, s, v_heads/tp, v_dim]
        out = out.reshape(out.shape[0], out.shape[1], -1).transpose(0, 1).contiguous()
        return self.out_proj(out)

    def _mix(self, mixed: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """[b, s, in_proj/tp] -> the gated delta rule's output and the output gate, each
        [b, s, v_heads/tp, v_dim]."""
        b, s, _ = mixed.shape
        tp, nv = self.tp_size, self.num_value_heads
        qkv, gate, beta, alpha = torch.split(
            mixed, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, nv // tp, nv // tp], dim=-1)
        seq_idx = None if cu_seqlens is None else sequence_index(cu_seqlens)
        qkv = kernels.causal_conv1d_fn(
            x=qkv.transpose(1, 2).contiguous(), weight=self.conv1d.weight.squeeze(1),
            bias=self.conv1d.bias, seq_idx=seq_idx, activation=self.activation,
        ).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = kernels.l2norm(query.reshape(b, s, -1, self.key_head_dim).contiguous())
        key = kernels.l2norm(key.reshape(b, s, -1, self.key_head_dim).contiguous())
        value = value.reshape(b, s, -1, self.value_head_dim).contiguous()
        if nv // self.num_key_heads > 1:  # each key head serves consecutive value heads
            query = query.repeat_interleave(nv // self.num_key_heads, dim=2)
            key = key.repeat_interleave(nv // self.num_key_heads, dim=2)
        # the decay in fp32 (A_log too: its exp in bf16 drifts from transformers)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        core, _ = kernels.chunk_gated_delta_rule(
            query, key, value, g=g, beta=beta.sigmoid(), initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
        )
        return core, gate.reshape(b, s, -1, self.value_head_dim)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """megatron's, plus a LoRA adapter's B on in_proj (rows laid out as the weight's: this
        rank's part of each piece) split into the weight's pieces, so it reshards over TP."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata, tp_group)
        key = f"{prefix}in_proj.lora.B"
        if key in sd:
            tp = self.tp_size
            sizes = [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp, self.v_dim // tp,
                     self.num_value_heads // tp, self.num_value_heads // tp]
            sd[key] = _split_tensor_factory(sd[key], sizes, ["query", "key", "value", "z", "beta", "alpha"], 0)
        return sd

    def _gated_norm(self, x: Tensor, gate: Tensor) -> Tensor:
        """out_norm(x) * silu(gate) in fp32, rounded to x's dtype (transformers' gated norm)."""
        return (self.out_norm(x) * self.act_fn(gate.float())).to(x.dtype)
