"""Data parallel training under torchrun (gloo, 2 ranks on this CPU) against one process.

    python -m pytest -q tests/test_dist.py

Equivalence: one update_policy step on a fixed batch of 8 samples gives the same loss, the same
gradient norm and the same new weights (to float32 rounding) in one process and as 2 ranks with 4
samples each, for both loss aggregations, with LoRA (gradients all-reduced, dist.sync_grads) and
with full fine-tuning (FSDP2, dist.fsdp). The batch and the update are tests/dist_update.py's.
"""
import os
import subprocess
import sys

import pytest
import torch

import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_update.py")


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_two_ranks_update_exactly_as_one_process(mode, agg, tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _run([sys.executable, SCRIPT, mode, agg, str(one)])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
          SCRIPT, mode, agg, str(two)])
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], abs=1e-6)
    assert a["metrics"]["loss"] != 0.0  # advantages that do not cancel: a loss worth comparing
    assert a["metrics"]["tokens"] == b["metrics"]["tokens"] == 60  # every rank's tokens counted once
    assert a["metrics"]["grad_norm"] == pytest.approx(b["metrics"]["grad_norm"], rel=1e-6)
    assert sorted(a["weights"]) == sorted(b["weights"]) == sorted(a["before"])
    moved = max(float((a["weights"][k] - a["before"][k]).abs().max()) for k in a["weights"])
    diff = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
    assert moved > 1e-3 and diff < 1e-6, (moved, diff)


def test_shard_range_splits_vms_in_contiguous_slices():
    assert [list(dist.shard_range(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(dist.shard_range(4, r, 3)) for r in range(3)] == [[0, 1], [2], [3]]
    assert list(dist.shard_range(3)) == [0, 1, 2]  # one process: everything
    assert dist.all_sum([1.5, 2]) == [1.5, 2] and dist.gather("x") == ["x"] and dist.broadcast(7) == 7
