"""A rollout engine on transformers' ``generate`` (KV cache): the stand-in for vLLM/SGLang here,
with the same weight-sync contract (an iterable of HF-named full tensors)."""
from __future__ import annotations

from typing import Iterable

import torch

from mcore_rl.mapping.casts import cast_checked
from mcore_rl.models.registry import WRAPPERS
from mcore_rl.rollout.engine import Rollout, RolloutError, left_pad

Tensor = torch.Tensor


def _wrapper_type(source) -> str | None:
    """The model_type of ``source`` (a HF directory or a transformers config)."""
    if isinstance(source, str):
        from mcore_rl.models.hf_json import read_config_json

        return read_config_json(source).get("model_type")
    return getattr(source, "model_type", None)


def attention_for(config) -> str:
    """The attention kernel for a transformers ``config``'s causal LM: ``sdpa`` where transformers
    has it for the architecture, else ``eager`` (gpt-oss: its attention sinks exist only in the
    eager path, ``_supports_sdpa=False``); an architecture outside ``AutoModelForCausalLM``'s
    table gets ``sdpa`` (transformers names the problem if it has none)."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


class TransformersRollout:
    """``AutoModelForCausalLM`` from ``source`` (a HF directory, or a transformers config: random
    weights until the first ``update_weights``) in ``dtype`` on ``device``; ``eos_id``/``pad_id``
    override the generation config's (e.g. the tokenizer's end-of-turn token); the attention kernel is
    ``attn_implementation`` whatever the source's config names (e.g. verl's flash-attention
    default), by default ``attention_for(config)`` (sdpa, or eager for gpt-oss). Sampling is plain
    softmax(logits / T): top-k, top-p, min-p and repetition penalties are switched off, and
    the rollout log-probs are computed from the raw logits at T (not the processed scores).
    A LoRA trainer's sync hands it merged weights (``engine.sync_weights``): plain HF tensors."""

    collective = False  # one engine per model replica, on the replica's first rank

    def __init__(self, source, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 eos_id: int | None = None, pad_id: int | None = None, attn_implementation: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        if attn_implementation is None:
            attn_implementation = attention_for(AutoConfig.from_pretrained(source) if isinstance(source, str)
                                                else source)
        if isinstance(source, str):
            self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
        else:
            self.model = AutoModelForCausalLM.from_config(source, dtype=dtype, attn_implementation=attn_implementation)
        self.model = self.model.to(device).eval()
        gen = self.model.generation_config or GenerationConfig()
        self.eos_id = eos_id if eos_id is not None else gen.eos_token_id
        if self.eos_id is None:
            self.eos_id = self.model.config.eos_token_id
        if isinstance(self.eos_id, list):
            self.eos_id = self.eos_id[0]
        self.pad_id = pad_id if pad_id is not None else gen.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_id
        if self.eos_id is None:
            raise RolloutError(f"{source if isinstance(source, str) else 'the config'}: no eos_token_id in "
                               "generation_config.json or config.json; add one.")
        # tied embeddings: both names reach the same parameter; a vision-language checkpoint's text
        # model (AutoModelForCausalLM loads Qwen3_5ForConditionalGeneration's as Qwen3_5ForCausalLM)
        # takes the wrapper's names (model.language_model.*) too
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        if _wrapper_type(source) in WRAPPERS:
            self.params.update({"model.language_model." + k[len("model."):]: p for k, p in list(self.params.items())
                                if k.startswith("model.")})
        self.device = torch.device(device)

    def checked_weight(self, name: str, tensor: Tensor, dtype_fix: str | None = None) -> Tensor:
        """``tensor`` in the dtype of the model's parameter ``name``; an unknown name, another
        shape, or a value that dtype cannot hold (fp32 -> fp16 beyond +-65504:
        ``casts.cast_checked``; ``dtype_fix`` names the setting to change) is an error naming it."""
        param = self.params.get(name)
        if param is None:
            raise RolloutError(f"weight {name!r} is no parameter of the rollout model; the trainer's "
                               "architecture differs from the rollout model's.")
        if param.shape != tensor.shape:
            raise RolloutError(f"weight {name!r}: trainer sends {tuple(tensor.shape)}, the rollout model "
                               f"has {tuple(param.shape)}.")
        fix = f"the rollout model's {str(param.dtype).removeprefix('torch.')} cannot hold it: " + \
            (dtype_fix or "run the rollout engine in a wider dtype (bf16 or fp32)")
        return cast_checked(tensor, param.dtype, f"weight {name!r} of the sync", fix)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copies each (HF name, full tensor) into the model, checked by ``checked_weight``.
        Returns the number of tensors copied."""
        taken = 0
        for name, tensor in named_tensors:
            checked = self.checked_weight(name, tensor)  # names an unknown weight
            self.params[name].copy_(checked)
            taken += 1
        return taken

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Rollout:
        """One response per prompt, sampled at ``temperature`` (0: greedy, no log-probs); the
        caller's torch RNG is left as it was."""
        if not temperature >= 0:
            raise RolloutError(f"temperature={temperature} must be >= 0 (0: greedy); use 1.0 for the raw policy.")
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None) if temperature > 0 \
            else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, **sampling, repetition_penalty=1.0,
                max_new_tokens=max_new_tokens, output_logits=temperature > 0, return_dict_in_generate=True,
                pad_token_id=self.pad_id, eos_token_id=self.eos_id)
        responses = out.sequences[:, ids.shape[1]:]
        is_eos = (responses == self.eos_id).long()
        live = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first end-of-sequence token
        log_probs = None
        if temperature > 0:
            logits = torch.stack(out.logits, dim=1).float()  # raw logits [B, R', V]
            log_probs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
            log_probs = log_probs * live
        extra = max_new_tokens - responses.shape[1]  # generate stops early once every row ended
        if extra:
            responses = torch.nn.functional.pad(responses, (0, extra), value=self.pad_id)
            live = torch.nn.functional.pad(live, (0, extra), value=False)
            log_probs = None if log_probs is None else torch.nn.functional.pad(log_probs, (0, extra))
        responses = responses.masked_fill(~live, self.pad_id)
        return Rollout(torch.cat([ids, responses], 1), torch.cat([mask, live.long()], 1), responses, log_probs)
