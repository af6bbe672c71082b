"""verl's RL dataset that records every trained batch (``data.custom_cls``, loaded by path in the
TaskRunner: no imports from the repo).

verl's separated trainers (one-step-off) call ``train_dataset.on_batch_end(batch)`` once per step
after the actor's update; this writes, per step, what the tests compare: each sample's prompt
and response token ids (unpadded), the rollout's log-probs of the response tokens, the trainer's
``old_log_probs`` and the versions the rollout server reported (``min/max_global_steps``), into
``$MCORE_RL_TEST_BATCHES/<n>.pt`` (n = 1, 2, ...: the call count, i.e. the trainer step of a run
that did not resume)."""
import os

import torch
from verl.utils.dataset.rl_dataset import RLHFDataset

ENV = "MCORE_RL_TEST_BATCHES"


def _version(value) -> int:
    return -1 if value is None else int(value)


class RecordingRLHFDataset(RLHFDataset):
    """``RLHFDataset`` plus ``on_batch_end`` writing the trained batch (see the module doc)."""

    calls = 0

    def on_batch_end(self, batch) -> None:
        directory = os.environ.get(ENV)
        if not directory:
            return
        self.calls += 1
        t, extra = batch.batch, batch.non_tensor_batch
        prompt_mask = t["attention_mask"][:, : t["prompts"].shape[1]].bool()
        response_mask = t["response_mask"].bool()
        rows = []
        for i in range(t["responses"].shape[0]):
            rows.append({
                "prompt": t["prompts"][i][prompt_mask[i]].tolist(),
                "response": t["responses"][i][response_mask[i]].tolist(),
                "rollout_log_probs": t["rollout_log_probs"][i][response_mask[i]].float().clone(),
                "old_log_probs": t["old_log_probs"][i][response_mask[i]].float().clone(),
                "min_global_steps": _version(extra["min_global_steps"][i]),
                "max_global_steps": _version(extra["max_global_steps"][i]),
            })
        os.makedirs(directory, exist_ok=True)
        torch.save(rows, os.path.join(directory, f"{self.calls}.pt"))
