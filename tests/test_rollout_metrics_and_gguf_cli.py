"""verl's rollout_corr definitions on hand-computed values, and gguf_to_hf's refusals (one error
line, exit code 2, nothing written)."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from mcore_rl.rollout.engine import RolloutError
from mcore_rl.rollout.metrics import rollout_corr_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rollout_corr_definitions():
    old = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    roll = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the masked column differs wildly: it must not count
    m = rollout_corr_metrics(old, roll, mask)
    r = [0.5, 0.0, 0.0, 0.5, 0.0]  # old - rollout over the 5 response tokens
    assert m["rollout_corr/kl"] == pytest.approx(sum(-x for x in r) / 5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 5)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in r) / 5 - 1)
    # per row: mean rollout - mean old = (-1.75 + 1.5) and (-2/3 + 0.5), then the batch mean
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(((-0.25) + (-1 / 6)) / 2)
    assert m["rollout_corr/max_abs_log_prob_diff"] == pytest.approx(0.5)
    with pytest.raises(RolloutError, match="at least one response token"):
        rollout_corr_metrics(old, roll, torch.zeros_like(mask))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "converters", "gguf_to_hf.py"), *args],
                          capture_output=True, text=True)


def test_gguf_to_hf_refusals(tmp_path):
    from mcore_rl.conversion.gguf_convert import gguf_to_hf
    from mcore_rl.errors import McoreRLError

    garbage = tmp_path / "bad.gguf"
    garbage.write_bytes(b"not a gguf file")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    inside = full / "m.gguf"
    inside.write_bytes(b"GGUF")
    cases = [  # the library's refusals, in-process (a CLI start costs ~5 s each)
        ((tmp_path / "missing.gguf", tmp_path / "o1", False), "is not a file"),
        ((garbage, tmp_path / "o2", False), "not a readable GGUF file"),
        ((garbage, full, False), "is not empty"),
    ]
    for (src, dst, overwrite), message in cases:
        with pytest.raises(McoreRLError, match=message):
            gguf_to_hf(str(src), str(dst), overwrite)
    # the CLI: one error line, exit code 2
    done = _cli("--gguf_path", str(inside), "--output_path", str(full), "--overwrite")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") \
        and "contains --gguf_path" in lines[0], done.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf", "full"]
    assert sorted(os.listdir(full)) == ["keep.txt", "m.gguf"]
    typo = _cli("--gguf_pth", "x", "--output_path", str(tmp_path / "o3"))
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
