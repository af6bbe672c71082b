"""A GPTModel whose multi-token-prediction block runs only on request.

megatron-core 0.16.1's GPTModel runs its MTP block in every forward and needs ``labels`` for
it; mcore_rl hands the model no labels (the RL losses read the logits). ``MtpGPTModel`` keeps
megatron's block, its placement (last pipeline stage, with a copy of the word embedding there)
and its loss rule, but runs the block only while ``mtp_train`` asks for it: otherwise the
forward is the plain GPTModel's output layer, so log-probs and losses are those of a model
built without MTP layers.

With MTP training on, per depth k = 1..D: the hidden state of token i (the trunk's for k=1, depth
k-1's after) and the embedding of token i+k go through the MTP layer (megatron's:
enorm / hnorm, eh_proj of the concatenation, a transformer layer, the final norm), the shared
output head gives logits for token i+k+1, and the cross-entropy is averaged over the positions
where token i and token i+k+1 are real tokens of one sequence. megatron's
``MTPLossAutoScaler`` adds ``mtp_loss_scaling_factor / D`` times each depth's mean to the
gradient (scaled like the main loss by the pipeline schedule); its value is logged, not added to
the reported policy loss (``mtp_losses``).
"""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from mcore_rl.models.mtp import MtpConfig, MtpConfigError

Tensor = torch.Tensor


def segments(padding: Tensor | None, ids: Tensor) -> Tensor:
    """[b, s] sequence id of each position of a padded batch: its row, -1 for padding
    (``padding`` [b, 1, 1, s] True = padding; None: none)."""
    b, s = ids.shape
    rows = torch.arange(b, device=ids.device)[:, None].expand(b, s)
    if padding is None:
        return rows.clone()
    return rows.masked_fill(padding.reshape(b, s), -1)


def mtp_targets(ids: Tensor, seg: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Labels [b, s] (token i+k+1) and float mask [b, s] of the positions whose token i and
    token i+k+1 are real tokens of one sequence, for MTP depth ``k`` (1-based)."""
    shift = k + 1
    labels, mask = torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    if shift < ids.shape[1]:
        labels[:, :-shift] = ids[:, shift:]
        mask[:, :-shift] = ((seg[:, :-shift] >= 0) & (seg[:, :-shift] == seg[:, shift:])).float()
    return labels.masked_fill(mask == 0, 0), mask


class _DetachedEmbedding:
    """The word embedding with its output detached (verl's detach_encoder)."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        self.embedding = embedding

    def __call__(self, **kwargs) -> Tensor:
        return self.embedding(**kwargs).detach()


class MtpGPTModel(GPTModel):
    """GPTModel with an MTP block (``mtp_block_spec``) that runs only when ``mtp_train`` (an
    ``MtpConfig`` with ``enable_train``) is set; ``mtp_losses`` collects each training forward's
    per-depth MTP losses (detached, [D]) for metrics: the caller reads and clears it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mtp_train: MtpConfig | None = None
        self.mtp_losses: list[Tensor] = []
        self.real_vocab_size: int | None = None  # the rows past it are TP padding: out of the softmax

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                     decoder_input=None, attention_mask=None, inference_params=None,
                     packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None,
                     extra_block_kwargs=None, inference_context=None):
        """[b, s, vocab/tp] logits of the main head; the MTP loss joins the gradient on request."""
        if labels is not None or inference_context is not None or inference_params is not None:
            raise MtpConfigError("a model with MTP layers is run without labels or inference contexts by mcore_rl "
                                 "(the RL losses read the logits); pass labels=None.")
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if mtp_in_postprocess and self.mtp_train is not None and self.mtp_train.enable_train:
            hidden_states = self._with_mtp_loss(hidden_states, input_ids, position_ids, attention_mask,
                                                (rotary_pos_emb, rotary_pos_cos, rotary_pos_sin),
                                                packed_seq_params, sequence_len_offset, weight, extra_block_kwargs)
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()

    def _with_mtp_loss(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor,
                       attention_mask: Tensor | None, rotary: tuple, packed_seq_params, sequence_len_offset,
                       weight: Tensor | None, extra_block_kwargs: dict | None) -> Tensor:
        """``hidden_states`` [s, b, h] with each depth's scaled MTP loss attached to its gradient."""
        if packed_seq_params is not None:  # the stream's filler and per-row rounding look like tokens
            raise MtpConfigError("MTP training on packed micro-batches (use_remove_padding=true) is not supported: "
                                 "the MTP loss needs each row's real tokens, which the packed stream does not mark; "
                                 "set use_remove_padding=false while mtp.enable_train=true.")
        if self.config.context_parallel_size > 1:
            raise MtpConfigError(f"MTP training with context parallelism (cp={self.config.context_parallel_size}) "
                                 "is not supported; set cp=1 or mtp.enable_train=false.")
        cfg, depth = self.mtp_train, len(self.mtp.layers)
        trunk = hidden_states.detach() if cfg.detach_encoder else hidden_states
        embedding = _DetachedEmbedding(self.embedding) if cfg.detach_encoder else self.embedding
        stacked = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=trunk,
                           attention_mask=attention_mask, rotary_pos_emb=rotary[0], rotary_pos_cos=rotary[1],
                           rotary_pos_sin=rotary[2], packed_seq_params=packed_seq_params,
                           sequence_len_offset=sequence_len_offset, embedding=embedding,
                           extra_block_kwargs=extra_block_kwargs)
        seg = segments(attention_mask, input_ids)
        losses = []
        for k, h in enumerate(torch.chunk(stacked, 1 + depth, dim=0)[1:], start=1):
            logits, _ = self.output_layer(h, weight=weight)
            logits = self._without_padded_vocab(logits)
            labels, mask = mtp_targets(input_ids, seg, k)
            per_token = self.compute_language_model_loss(labels, logits).float()
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
            losses.append(loss.detach())
            scaled = (cfg.mtp_loss_scaling_factor / depth) * loss
            hidden_states = MTPLossAutoScaler.apply(hidden_states, scaled.to(hidden_states.dtype))
        self.mtp_losses.append(torch.stack(losses))
        return hidden_states

    def _without_padded_vocab(self, logits: Tensor) -> Tensor:
        """[s, b, V/tp] logits with the TP-padding rows of the vocabulary at -inf (HF's softmax
        has only the real vocabulary)."""
        if self.real_vocab_size is None:
            return logits
        from megatron.core import parallel_state

        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        padded = torch.arange(start, start + local, device=logits.device) >= self.real_vocab_size
        return logits.masked_fill(padded, float("-inf")) if bool(padded.any()) else logits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's, with the data-parallel group its MTP stage's embedding copy needs when the
        caller passes no metadata (mcore_rl's checkpoint code and the converter)."""
        if not self.pre_process and (metadata is None or "dp_cp_group" not in metadata):
            from megatron.core import parallel_state

            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            metadata = {**(metadata or {}), "dp_cp_group": group}
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


def mtp_chunks(chunks: list[torch.nn.Module]) -> list[MtpGPTModel]:
    """The chunks (DDP-wrapped or not) that hold an MTP block: the last stage's last one."""
    out = []
    for chunk in chunks:
        while not isinstance(chunk, GPTModel) and hasattr(chunk, "module"):
            chunk = chunk.module
        if isinstance(chunk, MtpGPTModel):
            out.append(chunk)
    return out


class mtp_training:  # noqa: N801  (a context manager, used as ``with mtp_training(...)``)
    """Within the block, the MTP layers of ``chunks`` run with ``config`` (when it trains them):
    every training forward adds the MTP loss; afterwards they are off again."""

    def __init__(self, chunks: list[torch.nn.Module], config: MtpConfig) -> None:
        self.models = mtp_chunks(chunks) if config.enable_train else []
        self.config = config

    def __enter__(self) -> mtp_training:
        for m in self.models:
            m.mtp_train, m.mtp_losses = self.config, []
        return self

    def __exit__(self, *exc) -> None:
        for m in self.models:
            m.mtp_train, m.mtp_losses = None, []

    def pop_loss(self) -> Tensor | None:
        """The last forward's MTP loss (sum over depths of each depth's mean, unscaled; None
        where this rank holds no MTP block or nothing was recorded)."""
        for m in self.models:
            if m.mtp_losses:
                return m.mtp_losses.pop().sum()
        return None
