"""Per-request sampling with a transformers causal LM and its KV cache: each request carries its
own temperature, top-k / top-p, token budget, stop ids and seed, so a request's sample does not
depend on which other requests share its batch (up to the floating-point effect of padding).

Log-probs are those of the sampled token under the full-vocabulary distribution at the request's
temperature, ``log_softmax(logits / T)`` from the raw logits (top-k / top-p only restrict what can
be drawn, as vLLM's ``processed_logprobs`` of the temperature step); temperature 0 is greedy, its
log-probs are ``log_softmax(logits)``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from mcore_rl.rollout.engine import RolloutError, left_pad

Tensor = torch.Tensor


@dataclass(frozen=True)
class SampleRequest:
    """One generation: ``prompt_ids`` (no padding), at most ``max_new_tokens`` new tokens,
    ``temperature`` (0: greedy), ``top_k`` (<= 0: off), ``top_p`` (1: off), the ``seed`` of this
    request's own generator, and the token ids that end it (included in the result)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    seed: int
    top_k: int = -1
    top_p: float = 1.0
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RolloutError("a generation request needs at least one prompt token; got an empty prompt.")
        if self.max_new_tokens < 1:
            raise RolloutError(f"max_new_tokens={self.max_new_tokens}: a request must allow at least 1 new token.")
        if not self.temperature >= 0:
            raise RolloutError(f"temperature={self.temperature} must be >= 0 (0: greedy).")
        if not 0 < self.top_p <= 1:
            raise RolloutError(f"top_p={self.top_p} must be in (0, 1] (1: off).")


@dataclass
class SampleResult:
    """The new tokens (the stop token included when one ended it), their log-probs and why it
    ended: ``stop`` (a stop id), ``length`` (the budget) or ``aborted`` (``should_abort``)."""

    token_ids: list[int]
    log_probs: list[float]
    finish: str


def _cache_name(model: torch.nn.Module) -> str:
    """The forward argument and output field of the KV cache: ``cache`` from transformers 5.11,
    ``past_key_values`` before (the verl environment pins transformers < 5.11)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pick(logits: Tensor, request: SampleRequest, generator: torch.Generator) -> tuple[int, float]:
    """(token, log-prob) for one row's raw logits [V] (float32)."""
    if request.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    scaled = logits / request.temperature
    log_probs = torch.log_softmax(scaled, -1)
    allowed = scaled
    if 0 < request.top_k < allowed.numel():
        kth = torch.topk(allowed, request.top_k).values[-1]
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if request.top_p < 1:
        order = torch.argsort(allowed, descending=True)
        probs = torch.softmax(allowed[order], -1)
        drop = (probs.cumsum(-1) - probs) >= request.top_p  # keep the smallest prefix reaching top_p
        allowed = allowed.clone()
        allowed[order[drop]] = float("-inf")
    token = int(torch.multinomial(torch.softmax(allowed, -1), 1, generator=generator))
    return token, float(log_probs[token])


@torch.no_grad()
def sample_requests(model: torch.nn.Module, requests: list[SampleRequest], pad_id: int,
                    should_abort: Callable[[], bool] | None = None) -> list[SampleResult]:
    """Generates every request in one left-padded batch with the model's KV cache (logits of the
    last position only: a prompt's logits would be [B, P, vocab]).

    ``model``: a transformers causal LM (``model(input_ids, attention_mask, position_ids,
    past_key_values, use_cache)``); ``should_abort`` is polled after every decoding step: when
    it returns True the unfinished requests end as ``aborted`` with what they have."""
    if not requests:
        return []
    device = next(model.parameters()).device
    ids, mask = left_pad([list(r.prompt_ids) for r in requests], pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(r.seed) for r in requests]  # host: sampling runs on host logits
    results = [SampleResult([], [], "") for _ in requests]
    name = _cache_name(model)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **last_only)
    cache, last = getattr(out, name), positions[:, -1:]
    live = list(range(len(requests)))
    for _ in range(max(r.max_new_tokens for r in requests)):
        logits = out.logits[:, -1].float().cpu()
        step = torch.full((len(requests), 1), pad_id, dtype=torch.long)  # host: built row by row
        for i in live:
            token, log_prob = _pick(logits[i], requests[i], generators[i])
            results[i].token_ids.append(token)
            results[i].log_probs.append(log_prob)
            step[i, 0] = token
            if token in requests[i].stop_ids:
                results[i].finish = "stop"
            elif len(results[i].token_ids) >= requests[i].max_new_tokens:
                results[i].finish = "length"
        live = [i for i in live if not results[i].finish]
        if not live:
            break
        if should_abort is not None and should_abort():
            for i in live:
                results[i].finish = "aborted"
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        last = last + 1
        out = model(input_ids=step.to(device), attention_mask=mask, position_ids=last, use_cache=True,
                    **{name: cache}, **last_only)
        cache = getattr(out, name)
    return results
