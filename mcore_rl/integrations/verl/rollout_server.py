"""The CPU rollout server behind verl's rollout interface: one Ray actor per replica, serving
verl's token-in-token-out ``generate`` with a transformers model (``mcore_rl.rollout``).

Requests queue up and are generated in batches (``rollout.max_num_seqs`` at most) on a worker
thread, so the actor keeps accepting requests, aborts and weight updates meanwhile; a weight
update waits for the batch in flight. Each request samples with its own generator, seeded from
``rollout.seed``, the weights' step (``update_weights(global_steps=...)``), the request id and the
prompt, and a counter over identical (request id, prompt) pairs since the last update (verl sends
one request id for every sample under ``full_determinism``). With ``rollout.full_determinism``
requests run one at a time, so a sample never depends on which others share its batch.

A weight sync holds the server from ``begin_weight_update`` to ``finish_weight_update``. A sync
whose sender died in between never finishes: the next ``begin_weight_update`` takes over from
it, and a sync that receives nothing for ``sync_timeout_s`` is abandoned. Either way, when it had
replaced weights already the server refuses to generate (a clear error) until a whole sync
succeeds; an abandoned adapter-only sync, or one that wrote nothing, leaves the last complete
weights served.

A version from mcore_rl's checkpoint engine (``receive_weights``: the server joins the sync's
process group itself) is staged beside the served weights while generation goes on, checked
whole (every tensor once, checksums, names and shapes of the rollout model) and swapped in under
the generation lock only once every receiver accepted it: a sender that dies part-way leaves the
previous version served, never a mix. A delta version replaces the tensors it sends and keeps the
rest, which the version it is based on must be (the checksums held say so).

A prompt holding an id outside the model's vocabulary is refused alone, when it arrives (the
requests batched with it are served).

``sleep`` / ``wake_up`` / ``*_kv_cache`` keep the weights in host memory (the model is small next
to host memory, and the trainer's state does not move on CPU): they are bookkeeping here.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.integrations.verl import weight_wire as wire
from mcore_rl.integrations.verl.rollout_lora import ServedAdapters, is_adapter_name
from mcore_rl.rollout.hf_generate import TransformersRollout
from mcore_rl.rollout.sampling import SampleRequest, SampleResult, sample_requests

log = logging.getLogger("mcore_rl.integrations.verl")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# sampling_params keys verl sends and what they must be here (None: any value)
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "n": 1}
SYNC_TIMEOUT_S = 600.0  # a weight sync silent this long (its sender died) is abandoned
_TAKEN = ("temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "ignore_eos", "seed",
          "skip_special_tokens", "spaces_between_special_tokens", "detokenize")


class RolloutServerError(McoreRLError, ValueError):
    """A request or setting the CPU rollout server cannot serve; names the value and the fix."""


_STALE = ("the last weight sync into this rollout server failed part-way or was abandoned (its sender failed or "
          "went silent); its weights are a mix of two steps. Fix the sync error (see the trainer's log) and sync "
          "again.")


@dataclass
class _Request:
    request: SampleRequest
    want_log_probs: bool
    done: asyncio.Future = field(repr=False)


def request_seed(base: int, step: int | None, request_id: str, prompt_ids: list[int], occurrence: int) -> int:
    """A request's sampling seed (63 bits) from the rollout seed, the weights' step, the request
    id, the prompt and the occurrence count of that (id, prompt) pair since the last update."""
    text = f"{base}|{step}|{request_id}|{occurrence}|{','.join(map(str, prompt_ids))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def stop_ids(model_config: Any) -> frozenset[int]:
    """End-of-sequence ids as vLLM stops on them: the generation config's (one or a list), the
    model config's and the tokenizer's."""
    found: set[int] = set()
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "hf_config", None),
                   getattr(model_config, "tokenizer", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        found.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return frozenset(found)


class RolloutServer:
    """One replica's server (a Ray actor). ``config``: verl's RolloutConfig; ``model_config``:
    verl's HFModelConfig (or its DictConfig), the model built from ``local_path`` (or from its
    config with random weights when ``rollout.load_format`` is ``dummy``, verl's default: the first
    weight sync fills them)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, num_threads: int | None = None,
                 sync_timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """``sync_timeout_s``: a weight sync that receives no call for this long is abandoned
        (see the module doc)."""
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank = replica_rank
        if num_threads:
            torch.set_num_threads(num_threads)
        dtype = DTYPES.get(str(self.config.dtype))
        if dtype is None:
            raise RolloutServerError(f"rollout.dtype={self.config.dtype!r}; the mcore_rl rollout runs {sorted(DTYPES)}.")
        source = self.model_config.hf_config if self.config.load_format == "dummy" else self.model_config.local_path
        tokenizer = self.model_config.tokenizer
        self.stop = frozenset() if self.config.ignore_eos else stop_ids(self.model_config)
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else None
        self.engine = TransformersRollout(source, dtype=dtype, eos_id=min(self.stop) if self.stop else None, pad_id=pad)
        self.global_steps: int | None = None
        self.max_batch = 1 if self.config.full_determinism else max(1, int(self.config.max_num_seqs))
        self._seen: Counter = Counter()
        self._pending: list[_Request] = []
        self._has_work: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._abort, self._admitting, self._reject = False, True, False
        self._resumed: asyncio.Event | None = None  # set while requests are admitted
        self._updated: set[int] = set()
        self._stale = False  # a weight sync failed part-way: the weights are a mix
        self.adapters = ServedAdapters(self.engine.model)  # LoRA served unmerged (rollout_lora)
        self._adapter_sync = False
        self.vocab_size = int(self.engine.model.get_input_embeddings().num_embeddings)
        self.sync_timeout_s = float(sync_timeout_s)
        self._sync: int | None = None  # the weight sync in progress (it holds the lock)
        self._syncs = 0
        self._sync_seen = 0.0  # time.monotonic() of its last call
        self._sync_wrote = False  # it copied weights into the model already
        self._watchdog: asyncio.Task | None = None
        self.known: tuple[int, dict[str, str]] | None = None  # (token, checksums) of the version served
        self._factors: dict[str, torch.Tensor] = {}  # its LoRA factors by PEFT name (a delta keeps them)
        self._receiving = False

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       **_kwargs: Any):
        """verl's token-in-token-out call: one response for ``prompt_ids``; returns verl's
        ``TokenOutput`` (token ids, log-probs when ``sampling_params['logprobs']``, stop reason,
        ``extra_fields['global_steps']``: the step of the weights that generated it)."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or audio_data is not None:
            raise RolloutServerError("the mcore_rl rollout serves text only; image/video/audio inputs need vLLM or "
                                     "SGLang (actor_rollout_ref.rollout.name).")
        self._ensure_loop_state()
        if self._stale:
            raise RolloutServerError(_STALE)
        prompt = [int(t) for t in prompt_ids]
        while not self._admitting:
            if self._reject:
                return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
            await self._resumed.wait()
        request, want_log_probs = self._sample_request(prompt, dict(sampling_params), str(request_id))
        item = _Request(request, want_log_probs, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._has_work.set()
        result: SampleResult = await item.done
        return TokenOutput(token_ids=result.token_ids, log_probs=result.log_probs if want_log_probs else None,
                           stop_reason="aborted" if result.finish == "aborted" else "completed",
                           extra_fields={"global_steps": self.global_steps})

    def _sample_request(self, prompt: list[int], params: dict[str, Any], request_id: str) -> tuple[SampleRequest, bool]:
        for key, neutral in _NEUTRAL.items():
            value = params.pop(key, neutral)
            if value is not None and float(value) != float(neutral):
                raise RolloutServerError(f"sampling_params[{key!r}]={value!r}: the mcore_rl rollout samples from "
                                         f"softmax(logits / T) only; set it to {neutral}.")
        unknown = sorted(set(params) - set(_TAKEN))
        if unknown:
            raise RolloutServerError(f"sampling_params keys {unknown} are not supported by the mcore_rl rollout "
                                     f"(it takes {list(_TAKEN) + list(_NEUTRAL)}).")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RolloutServerError(f"prompt token id {bad} (request {request_id!r}) is outside the model's vocabulary "
                                     f"of {self.vocab_size} ids (0..{self.vocab_size - 1}); check the tokenizer and the "
                                     "model the rollout serves.")
        c = self.config
        room = (c.max_model_len or c.prompt_length + c.response_length) - len(prompt)
        if room < 1:
            raise RolloutServerError(f"prompt of {len(prompt)} tokens leaves no room to generate within "
                                     f"{room + len(prompt)} tokens; raise rollout.max_model_len or shorten the prompt.")
        limit = params.get("max_tokens", params.get("max_new_tokens"))
        if limit is None:
            limit = min(c.response_length, c.prompt_length + c.response_length - len(prompt))
        key = (request_id, tuple(prompt))
        occurrence = self._seen[key]
        self._seen[key] += 1
        seed = request_seed(c.seed, self.global_steps, request_id, prompt, occurrence)
        top_k = int(params.get("top_k", -1) or -1)
        temperature = float(params.get("temperature", 1.0))
        stop = frozenset() if params.get("ignore_eos") else self.stop
        return SampleRequest(tuple(prompt), max(1, min(int(limit), room)), temperature, seed, top_k,
                             float(params.get("top_p", 1.0)), stop), bool(params.get("logprobs"))

    def _ensure_loop_state(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.get_loop() is not loop:  # built on the loop that serves
            if self._sync is not None:  # a sync on the old loop cannot finish on this one
                self._abandon_sync("its event loop ended")
            self._has_work, self._lock, self._resumed = asyncio.Event(), asyncio.Lock(), asyncio.Event()
            self._resumed.set()
            self._task = loop.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            await self._has_work.wait()
            await asyncio.sleep(0.005)  # let requests sent together arrive together
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            if not self._pending:
                self._has_work.clear()
            if not batch:
                continue
            try:
                async with self._lock:
                    if self._stale:  # a sync that waited requests out was abandoned part-way
                        raise RolloutServerError(_STALE)
                    results = await asyncio.to_thread(
                        sample_requests, self.engine.model, [b.request for b in batch], self.engine.pad_id,
                        lambda: self._abort)
            except Exception as e:  # every waiting request learns why
                for b in batch:
                    if not b.done.done():
                        b.done.set_exception(e)
                continue
            for b, r in zip(batch, results):
                if not b.done.done():
                    b.done.set_result(r)

    # ---- weights ------------------------------------------------------------------------------
    async def begin_weight_update(self, peft_config: dict[str, Any] | None = None) -> None:
        """Waits for the batch in flight; the next buckets replace the weights, or with
        ``peft_config`` (verl's adapter-only sync) the LoRA adapters. A sync still in progress
        (its sender died before ``finish_weight_update``) is abandoned and this one takes over."""
        self._ensure_loop_state()
        if self._sync is not None:
            self._abandon_sync("a new begin_weight_update arrived")  # keeps the lock for this sync
        else:
            await self._lock.acquire()
        self._syncs += 1
        self._sync, self._sync_seen, self._sync_wrote = self._syncs, time.monotonic(), False
        self._updated = set()
        self._adapter_sync = peft_config is not None
        self.known = None  # written in place: no checksums to base a delta on
        try:
            if self._adapter_sync:
                self.adapters.begin(peft_config)
        except BaseException:
            self._end_sync()
            raise
        self._watchdog = asyncio.get_running_loop().create_task(self._expire(self._sync))

    def _active_sync(self, call: str) -> None:
        """Refuses ``call`` outside a sync in progress; notes the sync is alive."""
        if self._sync is None:
            raise RolloutServerError(f"{call} outside begin_weight_update / finish_weight_update (or after its sync was "
                                     f"abandoned: silent for {self.sync_timeout_s:g} s, or taken over by a newer "
                                     "begin_weight_update); start a new sync.")
        self._sync_seen = time.monotonic()

    async def update_weights_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Copies one bucket of (HF name, full tensor) into the model (an adapter sync: keeps the
        bucket's PEFT-named factors until the sync finishes)."""
        self._active_sync("update_weights_bucket")
        if self._adapter_sync:
            return self.adapters.take(bucket)
        self._sync_wrote = True  # before the copy: one that fails part-way has written too
        taken = self.engine.update_weights(bucket)
        self._updated.update(id(self.engine.params[name]) for name, _ in bucket)
        return taken

    async def finish_weight_update(self, global_steps: int | None, complete: bool = True) -> None:
        """Checks that every parameter was replaced (an adapter sync: that every adapter is
        whole; it then replaces the served adapters; a full sync removes them), records the
        weights' step, and resumes. ``complete=False`` (the sender failed part-way): the server
        refuses to generate until a whole sync succeeds."""
        self._active_sync("finish_weight_update")
        try:
            self._stale = True
            if not complete:
                self.adapters.abandon()
                return
            if self._adapter_sync:
                self.adapters.install()
            else:
                missing = sorted(n for n, p in self.engine.params.items() if id(p) not in self._updated)
                if missing:
                    raise RolloutServerError(f"the weight sync left {len(missing)} rollout parameters unchanged "
                                             f"(e.g. {missing[:4]}); the trainer's export and the rollout model "
                                             "disagree.")
                self.adapters.clear()
            self.global_steps = global_steps
            self._seen.clear()
            self._stale = False
        finally:
            self._end_sync()

    def _abandon_sync(self, why: str) -> None:
        """Drops the sync in progress (its sender is gone); the weights are stale when it had
        written any. The lock stays held: the caller takes it over or releases it."""
        log.warning("abandoning the unfinished weight sync into rollout replica %s (%s)%s", self.replica_rank, why,
                    "; it had replaced weights: generation is refused until a whole sync" if self._sync_wrote else "")
        self._stale = self._stale or self._sync_wrote
        self.adapters.abandon()
        self._sync, self._adapter_sync = None, False
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None

    def _end_sync(self) -> None:
        """The sync is over: the watchdog stops and the lock is released."""
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._sync, self._adapter_sync, self._watchdog = None, False, None
        self._lock.release()

    async def _expire(self, sync: int) -> None:
        """Abandons sync ``sync`` once it has been silent for ``sync_timeout_s``."""
        while self._sync == sync:
            idle = time.monotonic() - self._sync_seen
            if idle >= self.sync_timeout_s:
                self._abandon_sync(f"no call for {self.sync_timeout_s:g} s")
                self._lock.release()
                return
            await asyncio.sleep(self.sync_timeout_s - idle)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ---- versions from mcore_rl's checkpoint engine -----------------------------------------------
    async def receive_weights(self, link: wire.Link, global_steps: int | None, install: bool = True) -> dict[str, Any]:
        """Joins the sync's group as ``link.rank`` and receives one version (in a thread: requests
        are served on the current weights meanwhile), then swaps it in (``install_version``).
        ``install=False`` (``weight_sync=False``, a diagnostic): received and dropped, only the
        step advances. Returns {"tensors", "bytes"} received."""
        self._ensure_loop_state()
        if self._receiving:
            raise RolloutServerError(f"rollout replica {self.replica_rank} is receiving a weight version already; "
                                     "one checkpoint-engine sync at a time.")
        self._receiving = True
        try:
            version = await asyncio.to_thread(self._receive_version, link)
        finally:
            self._receiving = False
        if not install:
            self.global_steps = global_steps
            return {"tensors": 0, "bytes": version.nbytes}
        return await self.install_version(version, global_steps, checked=True)

    def _receive_version(self, link: wire.Link) -> wire.Version:
        group = wire.open_group(link)
        try:
            return wire.receive(group, link, self.known, check=self._staged, check_names=self._check_names)
        finally:
            del group

    def _staged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the parameter ``name`` holds it (its dtype), or an error naming it (a
        LoRA factor under its PEFT name as is: ``ServedAdapters`` checks it)."""
        if is_adapter_name(name):
            return tensor
        return self.engine.checked_weight(name, tensor, "run the rollout in a wider dtype (rollout.dtype=bfloat16 "
                                          "or float32)")

    def _check_names(self, names: list[str]) -> None:
        """A version must name only rollout parameters (and LoRA factors) and cover every
        parameter (tied ones once)."""
        unknown = [n for n in names if n not in self.engine.params and not is_adapter_name(n)]
        covered = {id(self.engine.params[n]) for n in names if n in self.engine.params}
        missing = sorted(n for n, p in self.engine.params.items() if id(p) not in covered)
        if unknown or missing:
            raise RolloutServerError(f"the weight version names {len(unknown)} tensors the rollout model lacks (e.g. "
                                     f"{unknown[:3]}) and leaves {len(missing)} of its parameters out (e.g. "
                                     f"{missing[:3]}); the trainer's export and the rollout model disagree.")

    async def install_version(self, version: wire.Version, global_steps: int | None,
                              checked: bool = False) -> dict[str, Any]:
        """Swaps a whole version in under the generation lock (the batch in flight finishes on
        the old weights); its LoRA factors replace the served adapters (none: they are removed). ``checked``: names,
        shapes and dtypes were checked while receiving (else here, before anything is written)."""
        self._ensure_loop_state()
        if not checked:
            if version.base and (self.known is None or self.known[0] != version.base):
                raise RolloutServerError(f"a delta weight version against version {version.base}, but this server "
                                         f"holds {self.known[0] if self.known else 'none'}; the next sync sends "
                                         "every tensor.")
            self._check_names(version.names)
            version.tensors = {n: self._staged(n, t) for n, t in version.tensors.items()}
        async with self._lock:
            factors = self._version_adapters(version)  # checked before any weight is written
            with torch.no_grad():
                for name, tensor in version.tensors.items():
                    if not is_adapter_name(name):
                        self.engine.params[name].copy_(tensor)
            self._factors = factors
            self.global_steps, self._stale = global_steps, False
            self._seen.clear()
            self.known = (version.token, version.checksums)
        return {"tensors": len(version.tensors), "bytes": version.nbytes, "adapters": len(self.adapters.active)}

    def _version_adapters(self, version: wire.Version) -> dict[str, torch.Tensor]:
        """Installs the version's LoRA adapters (its factors: the ones it sent, the rest kept
        from the version it is based on) or removes the served ones (a version without
        adapters); returns its factors by PEFT name. Raises before changing anything when they
        do not fit the model."""
        names = [n for n in version.names if is_adapter_name(n)]
        if not names:
            self.adapters.clear()
            return {}
        if version.peft is None:
            raise RolloutServerError(f"weight version {version.token} carries LoRA factors (e.g. {names[0]!r}) without a "
                                     "PEFT config; send them with AdapterWeights(weights, peft_config).")
        factors = {n: version.tensors[n] if n in version.tensors else self._factors[n] for n in names}
        self.adapters.begin(version.peft)
        try:
            self.adapters.take(list(factors.items()))
            self.adapters.install()
        except BaseException:
            self.adapters.abandon()
            raise
        return factors

    async def known_version(self) -> tuple[int, dict[str, str]] | None:
        """(token, checksums) of the version served (None: weights of no checked version)."""
        return self.known

    def parameter_checksums(self) -> dict[str, str]:
        """Per-parameter checksum of the served weights (``weight_wire.tensor_checksum``)."""
        return {name: wire.tensor_checksum(p) for name, p in self.engine.params.items()}

    # ---- lifecycle verl calls ---------------------------------------------------------------------
    async def abort_all_requests(self, reject_request: bool = False, **_kwargs: Any) -> dict[str, Any]:
        """Ends every queued and running request as ``aborted`` (running ones with their tokens so
        far); new requests wait for ``resume_generation`` (or return aborted: ``reject_request``)."""
        self._ensure_loop_state()
        self._admitting, self._reject, self._abort = False, reject_request, True
        self._resumed.clear()
        queued, self._pending = self._pending, []
        for b in queued:
            b.done.set_result(SampleResult([], [], "aborted"))
        async with self._lock:  # the running batch has returned
            pass
        return {"aborted_count": len(queued)}

    async def resume_generation(self) -> None:
        self._ensure_loop_state()
        self._abort, self._admitting, self._reject = False, True, False
        self._resumed.set()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None  # the KV cache lives only during a batch

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **_kwargs: Any) -> None:
        log.warning("the mcore_rl rollout server has no profiler; start_profile ignored")

    async def stop_profile(self) -> None:
        return None

    async def ready(self) -> int:
        """For the replica: the model is built (returns its parameter count)."""
        return sum(p.numel() for p in self.engine.model.parameters())
