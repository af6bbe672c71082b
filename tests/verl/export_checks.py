"""What the verl tests check of a role part's background HF export (``hf_model`` in verl's
``checkpoint.save_contents``): the weights and the export record in ``<role>/model/huggingface/``
(verl's layout v2), complete by the record's sizes and checksums, every file byte for byte what
``mcore_to_hf.py merge`` writes from the same role dir (the record aside), and transformers'
log-probs of those weights against mcore_rl's engine loaded from the same role dir.

``python -m tests.verl.export_checks ROLE_DIR`` (one process, gloo world of 1) prints
``{"gap": ..., "logits_gap": ...}``: max |log-prob difference| over the real tokens of sample rows
(fp32 on both sides), the engine's log-probs from ``load_model_dir`` into a fp32 ``ModelEngine``.
"""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def assert_exported(role_dir: str, step: int) -> str:
    """The role's HF dir holds a complete background export of ``step`` (record valid, every file
    there with its size and checksum) whose files equal ``merge`` of ``role_dir``; returns the dir."""
    from mcore_rl.checkpoint import hf_export_record
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.model_layout import VERL_V2, layout_of
    from mcore_rl.fileio.output_dir import EXPORT_RECORD

    assert layout_of(role_dir) == VERL_V2, role_dir
    hf_dir = VERL_V2.hf_dir(role_dir)
    assert hf_export_record.export_state(role_dir, verify=True) == "complete", (role_dir, sorted(os.listdir(hf_dir)))
    with open(os.path.join(hf_dir, EXPORT_RECORD)) as f:
        record = json.load(f)
    assert (record["writer"], record["step"], record["role"]) == ("background export", step,
                                                                  os.path.basename(role_dir)), record
    names = sorted(os.listdir(hf_dir))
    assert any(n in WEIGHTS or (n.startswith("model-") and n.endswith(".safetensors")) for n in names), names
    assert set(record["files"]) == set(names) - {EXPORT_RECORD}, (record["files"], names)
    with tempfile.TemporaryDirectory(prefix="merged_", dir=os.path.dirname(os.path.dirname(role_dir))) as tmp:
        merged = os.path.join(tmp, "hf")
        merge(role_dir, merged, dtype=record["dtype"])
        ours = [n for n in names if n != EXPORT_RECORD]
        theirs = [n for n in sorted(os.listdir(merged)) if n != EXPORT_RECORD]
        assert ours == theirs, (ours, theirs)
        differ = [n for n in ours if not filecmp.cmp(os.path.join(hf_dir, n), os.path.join(merged, n), shallow=False)]
        assert not differ, f"{hf_dir}: {differ} differ from mcore_to_hf.py merge of {role_dir}"
    return hf_dir


def engine_log_prob_gap(role_dir: str) -> dict:
    """Runs this module on ``role_dir`` in a fresh process (see the module doc)."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.verl.export_checks", role_dir], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gaps(role_dir: str) -> dict:
    """(in a gloo world of 1) the engine's and transformers' log-probs of sample rows."""
    import torch
    import transformers

    from converters.verify_logits import sample_batch
    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.fileio.model_layout import layout_of
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.forward import chunk_forward
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    hf_dir = layout_of(role_dir).hf_dir(role_dir)
    initialize_parallel_state(ParallelLayout())
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, ParallelLayout(), "actor", active_platform(), BuildOptions())
    load_model_dir(role_dir, engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    batch = sample_batch(args.vocab_size, batch=4, seq=24)
    with torch.no_grad():
        ref = hf(**batch).logits.float()
        ours = chunk_forward(engine.model[0], batch)[..., : ref.shape[-1]].float()
    real = batch["attention_mask"].bool()
    lp_ours, lp_ref = torch.log_softmax(ours, -1)[real], torch.log_softmax(ref, -1)[real]
    return {"gap": (lp_ours - lp_ref).abs().max().item(), "logits_gap": (ours[real] - ref[real]).abs().max().item(),
            "tokens": int(real.sum())}


if __name__ == "__main__":
    import torch

    from mcore_rl.platform import init_distributed, setup_platform

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="export_checks_", ignore_cleanup_errors=True) as store:
        init_distributed(setup_platform("cpu"), 0, 1, init_method=f"file://{store}/store")
        try:
            print(json.dumps(_gaps(sys.argv[1])))
        finally:
            torch.distributed.destroy_process_group()
