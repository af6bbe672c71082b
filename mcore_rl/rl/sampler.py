"""A demo sampler that generates with the actor's megatron model (not a serving engine).

Each new token is drawn by the Gumbel-max trick on vocab-parallel logits: every TP rank adds
Gumbel noise to its own shard, takes its shard's best token, and the TP group keeps the global
best, so no rank gathers full-vocab logits (temperature 0: no noise, the argmax). The sampled
token's log-prob comes from the same logits (vocab-parallel log-softmax at the temperature).
Without a KV cache every step re-runs the whole sequence; it is for tiny models and tests. The
sampling temperature is an explicit argument (the trainer's rollout temperature); the noise is
drawn on the logits' device.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state

from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.routing import ROUTED_EXPERTS
from mcore_rl.rl.actor import Actor
from mcore_rl.rl.cp_view import all_reduce_cp, local_column
from mcore_rl.rl.minibatch import local_rows, micro_batch_plan
from mcore_rl.rl.engine import gather_dp
from mcore_rl.errors import McoreRLError
from mcore_rl.platform import active_platform
from mcore_rl.rl.logprob import log_probs_and_entropy, masked_scaled_logits

Tensor = torch.Tensor


class SamplerError(McoreRLError, ValueError):
    """A sampling argument that cannot work; the message names the value and the fix."""


def sample_vocab_parallel(logits: Tensor, vocab_size: int, temperature: float, generator: torch.Generator) -> Tensor:
    """Token ids [...] drawn from softmax(logits / T) over the real vocab (T = 0: the argmax);
    logits [..., V/tp]. ``generator`` must live on the logits' device (the noise is drawn there).
    """
    scaled = masked_scaled_logits(logits, vocab_size, temperature or 1.0)
    noisy = scaled.double()
    if temperature > 0:
        uniform = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=scaled.device)
        noisy = noisy - torch.log(-torch.log(uniform.clamp_(1e-12, 1.0)))
    best, index = noisy.max(dim=-1)
    index = index + parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return index
    global_best = best.clone()
    torch.distributed.all_reduce(global_best, op=torch.distributed.ReduceOp.MAX, group=group)
    # the rank holding the winner contributes its id, the others 0 (ties: the largest id)
    mine = torch.where(best == global_best, index, torch.zeros_like(index))
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX, group=group)
    return mine


def _prompt_batch(prompts: Tensor, attention_mask: Tensor | None, response_length: int) -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, P + R]: the (left-padded) prompts, then R empty columns."""
    if attention_mask is None:
        attention_mask = torch.ones_like(prompts)
    if attention_mask.shape != prompts.shape or not bool(attention_mask[:, -1].all()):
        raise SamplerError(f"attention_mask {tuple(attention_mask.shape)} must match prompts "
                           f"{tuple(prompts.shape)} and end every row with a token (left padding only).")
    b = prompts.shape[0]
    ids = torch.cat([prompts, prompts.new_zeros(b, response_length)], dim=1)
    mask = torch.cat([attention_mask.to(prompts.dtype), prompts.new_zeros(b, response_length)], dim=1)
    return ids, mask


@torch.no_grad()
def generate(actor: Actor, prompts: Tensor, response_length: int, temperature: float, seed: int,
             attention_mask: Tensor | None = None, eos_id: int | None = None, pad_id: int = 0,
             record_routing: bool = False) -> dict:
    """Samples up to ``response_length`` tokens at ``temperature`` (0: greedy) after prompts
    [B, P], left-padded where ``attention_mask`` [B, P] has zeros.

    Returns a trainer batch on the platform's device: input_ids and attention_mask [B, P + R],
    responses [B, R], and (temperature > 0) rollout_log_probs [B, R], the sampled tokens'
    log-probs at ``temperature``. A response ends with its first ``eos_id``; later positions
    hold ``pad_id`` with mask 0 and log-prob 0. Every rank passes the same arguments and gets the
    same batch. Compute the batch's log-probs at the same temperature.
    ``record_routing`` (MoE): also ``routed_experts`` [B, P + R, MoE layers, top_k], recorded in
    one forward over the finished rows; without a KV cache every sampling step recomputed the same
    causal prefix, so this is the routing each token had when the sampler read it.
    """
    if not temperature >= 0:
        raise SamplerError(f"temperature={temperature} must be >= 0 (0: greedy); use 1.0 to sample the raw policy.")
    device = active_platform().device()
    ids, mask = _prompt_batch(prompts.to(device), None if attention_mask is None else attention_mask.to(device),
                              response_length)
    p = prompts.shape[1]
    log_probs = torch.zeros(ids.shape[0], response_length, device=device)
    # distinct noise per TP shard and per DP slice of rows, reproducible from ``seed``
    generator = torch.Generator(device=device).manual_seed(
        seed * 1_000_003 + 1009 * parallel_state.get_data_parallel_rank()
        + parallel_state.get_tensor_model_parallel_rank())
    for step in range(response_length):
        tokens, lp = _next_tokens(actor, ids, mask, p, step, temperature, generator)
        ids[:, p + step], mask[:, p + step], log_probs[:, step] = tokens, 1, lp
        if eos_id is not None and bool((ids[:, p:p + step + 1] == eos_id).any(1).all()):
            break  # every row ended (all ranks hold the same tokens, so all stop here)
    responses = ids[:, p:].clone()
    if eos_id is not None:
        is_eos = (responses == eos_id).long()
        live = ((is_eos.cumsum(1) - is_eos) == 0) & (mask[:, p:] > 0)  # up to the first end-of-sequence
        responses.masked_fill_(~live, pad_id)
        ids[:, p:], mask[:, p:] = responses, live.to(mask.dtype)
        log_probs *= live
    out = {"input_ids": ids, "attention_mask": mask, "responses": responses}
    if temperature > 0:
        out["rollout_log_probs"] = log_probs
    if record_routing:
        config = replace(actor.config, dispatch="global", router_replay="R2")  # R2 records
        out[ROUTED_EXPERTS] = Actor(actor.engine, config).compute_log_prob(out)[ROUTED_EXPERTS]
    return out


def _next_tokens(actor: Actor, ids: Tensor, mask: Tensor, p: int, step: int, temperature: float,
                 generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The tokens [B] sampled for column ``p + step`` of ``ids`` and their log-probs [B] (0 when greedy)."""
    engine, vocab = actor.engine, actor.engine.args.vocab_size
    engine.train(False)
    # fixed micro-batches: dynamic ones would trim the empty response columns sampled next
    config = replace(actor.config, max_tokens_per_micro_batch=None, use_remove_padding=False)
    # counted from the end: the micro-batcher may left-pad columns (sequence parallel)
    from_end = p + step - 1 - ids.shape[1]  # these logits predict the next token

    def loss_fn(mb: MicroBatch, output: Tensor):
        # under CP one rank holds the column; the others draw on zeros to keep their noise in
        # step and contribute 0 to the CP sum below
        at = local_column(mb["input_ids"].shape[1], mb["input_ids"].shape[1] + from_end)
        logits = output[:, at] if at is not None else torch.zeros_like(output[:, 0])
        token = sample_vocab_parallel(logits, vocab, temperature, generator)
        lp = torch.zeros(token.shape, device=token.device)
        if temperature > 0:
            lp = log_probs_and_entropy(logits, token, vocab, temperature)[0]
        owned = at is not None
        return output.sum() * 0.0, {"token": (token * owned).unsqueeze(1), "log_prob": (lp * owned).unsqueeze(1)}

    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:]}
    plan = micro_batch_plan(local_rows(batch), config, engine)
    pieces = engine.run(plan.batches, loss_fn, True)
    tokens = gather_dp(all_reduce_cp(plan.restore([piece["token"] for piece in pieces]))[:, 0])
    log_probs = gather_dp(all_reduce_cp(plan.restore([piece["log_prob"] for piece in pieces]))[:, 0])
    return tokens, log_probs
