"""A demo sampler that generates with the actor's megatron model (not a serving engine).

Each new token is drawn by the Gumbel-max trick on vocab-parallel logits: every TP rank adds
Gumbel noise to its own shard, takes its shard's best token, and the TP group keeps the global
best, so no rank gathers full-vocab logits. Without a KV cache every step re-runs the whole
sequence; it is for tiny models and tests. The sampling temperature is an explicit argument
(the trainer's rollout temperature); the noise is drawn on the logits' device.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state

from mcore_rl.rl.actor import Actor
from mcore_rl.rl.cp_view import all_reduce_cp, local_column
from mcore_rl.rl.minibatch import local_rows, micro_batch_plan
from mcore_rl.rl.engine import gather_dp
from mcore_rl.errors import McoreRLError
from mcore_rl.platform import active_platform
from mcore_rl.rl.logprob import masked_scaled_logits

Tensor = torch.Tensor


class SamplerError(McoreRLError, ValueError):
    """A sampling argument that cannot work; the message names the value and the fix."""


def sample_vocab_parallel(logits: Tensor, vocab_size: int, temperature: float, generator: torch.Generator) -> Tensor:
    """Token ids [...] drawn from softmax(logits / T) over the real vocab; logits [..., V/tp].

    ``generator`` must live on the logits' device (the noise is drawn there).
    """
    scaled = masked_scaled_logits(logits, vocab_size, temperature)
    uniform = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=scaled.device)
    uniform = uniform.clamp_(1e-12, 1.0)
    noisy = scaled.double() - torch.log(-torch.log(uniform))
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


@torch.no_grad()
def generate(actor: Actor, prompts: Tensor, response_length: int, temperature: float, seed: int) -> dict:
    """Samples ``response_length`` tokens at ``temperature`` after equal-length prompts [B, P]
    (no padding).

    Returns a trainer batch on the platform's device: input_ids [B, P + R], attention_mask,
    responses [B, R]. Every rank passes the same prompts, temperature and seed and gets the same
    batch. Compute the batch's log-probs at the same temperature (``ActorConfig.temperature``).
    """
    if not temperature > 0:
        raise SamplerError(f"temperature={temperature} must be > 0; use 1.0 to sample the raw policy.")
    device = active_platform().device()
    prompts = prompts.to(device)
    b, p = prompts.shape
    ids = torch.cat([prompts, prompts.new_zeros(b, response_length)], dim=1)
    mask = torch.cat([torch.ones_like(prompts), prompts.new_zeros(b, response_length)], dim=1)
    engine, vocab = actor.engine, actor.engine.args.vocab_size
    # distinct noise per TP shard and per DP slice of rows, reproducible from ``seed``
    generator = torch.Generator(device=device).manual_seed(
        seed * 1_000_003 + 1009 * parallel_state.get_data_parallel_rank()
        + parallel_state.get_tensor_model_parallel_rank()
    )
    engine.train(False)
    # fixed micro-batches: dynamic ones would trim the empty response columns sampled next
    config = replace(actor.config, max_tokens_per_micro_batch=None, use_remove_padding=False)
    for step in range(response_length):
        # counted from the end: the micro-batcher may left-pad columns (sequence parallel)
        from_end = p + step - 1 - ids.shape[1]  # these logits predict the next token

        def loss_fn(mb: dict, output: Tensor):
            # under CP one rank holds the column; the others draw on zeros to keep their noise in
            # step and contribute 0 to the CP sum below
            at = local_column(mb["input_ids"].shape[1], mb["input_ids"].shape[1] + from_end)
            logits = output[:, at] if at is not None else torch.zeros_like(output[:, 0])
            token = sample_vocab_parallel(logits, vocab, temperature, generator) * (at is not None)
            return output.sum() * 0.0, {"token": token.unsqueeze(1)}

        batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:]}
        plan = micro_batch_plan(local_rows(batch), config, engine)
        pieces = engine.run(plan.batches, loss_fn, True)
        tokens = gather_dp(all_reduce_cp(plan.restore([piece["token"] for piece in pieces]))[:, 0])
        ids[:, p + step] = tokens
        mask[:, p + step] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:].clone()}
