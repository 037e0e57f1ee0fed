"""Both trainers under torchrun (gloo, 2 ranks on this CPU), against one process.

    python -m pytest -q tests/test_dist.py          (~3 minutes)

- Equivalence: one update_policy step on a fixed batch of 8 samples gives the same loss, the same
  gradient norm and the same new weights (to float32 rounding) in one process and as 2 ranks with
  4 samples each, for both loss aggregations, with LoRA (gradients all-reduced, dist.sync_grads)
  and with full fine-tuning (FSDP2, dist.fsdp). The batch and the update: tests/dist_update.py.
- Smoke: train_arpo.py (FSDP2) and train_explore.py (LoRA, the world model on) as 2 ranks with
  their own local desktops write one run folder, resume on 2 ranks and in one process, and
  ARPO's evaluation splits its episodes over the ranks.
- A SIGKILL of one rank stops the job, and the resume logs every iteration exactly once.
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from plumbing import dist
from conftest import free_port, proc_descendants, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_update.py")


def _run(cmd: list[str]) -> None:
    # its own process group: a hung run is killed whole (torchrun's ranks too), never left behind
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    assert p.returncode == 0, out[-2000:] + err[-4000:]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_ranks_update_exactly_as_one_process(mode, tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _run([sys.executable, SCRIPT, mode, str(one)])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
          SCRIPT, mode, str(two)])
    ones, twos = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    for agg in ("seq-mean-token-mean", "token-mean"):
        a, b = ones[agg], twos[agg]
        assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], abs=1e-6)
        assert a["metrics"]["loss"] != 0.0  # advantages that do not cancel: a loss worth comparing
        assert a["metrics"]["tokens"] == b["metrics"]["tokens"] == 60  # every rank's tokens counted once
        assert a["metrics"]["grad_norm"] == pytest.approx(b["metrics"]["grad_norm"], rel=1e-6)
        assert sorted(a["weights"]) == sorted(b["weights"]) == sorted(a["before"])
        moved = max(float((a["weights"][k] - a["before"][k]).abs().max()) for k in a["weights"])
        diff = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
        assert moved > 1e-3 and diff < 1e-6, (agg, moved, diff)
    # the two aggregations are different losses (so each comparison above tests its own)
    assert ones["token-mean"]["metrics"]["loss"] != pytest.approx(ones["seq-mean-token-mean"]["metrics"]["loss"])


def test_shard_range_splits_vms_in_contiguous_slices():
    assert [list(dist.shard_range(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(dist.shard_range(4, r, 3)) for r in range(3)] == [[0, 1], [2], [3]]
    assert list(dist.shard_range(3)) == [0, 1, 2]  # one process: everything
    assert dist.all_sum([1.5, 2]) == [1.5, 2] and dist.gather("x") == ["x"] and dist.broadcast(7) == 7


# ------------------------------------------------------------------------------------------------
# Both trainers under torchrun: 2 ranks, each with its own local desktops


def _script(*argv, ranks: int = 2, timeout: int = 420) -> str:
    """A train script as `torchrun --nproc_per_node ranks` (ranks=1: plain python); -> its output."""
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
             str(free_port())] if ranks > 1 else [sys.executable])
    p = subprocess.Popen([*head, *map(str, argv)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
    assert p.returncode == 0, out[-5000:]
    return out


def _metrics(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


TINY_ARPO = ["--model", "tiny", "--max-pixels", 12544, "--max-new-tokens", 16, "--settle", 0.2]


def test_arpo_under_torchrun_trains_resumes_with_any_rank_count_and_evaluates(tmp_path):
    run = tmp_path / "arpo"
    # full fine-tuning (ARPO's default): FSDP2 over 2 ranks, 2 desktops and one group of 2 each
    out = _script("train_arpo.py", "--vms", 4, "--group-size", 2, "--iterations", 2, "--max-steps", 2, *TINY_ARPO,
                  "--run-name", run)
    assert sum(line.startswith("it ") for line in out.splitlines()) == 2  # one console line, rank 0's
    ms = _metrics(run)
    assert [m["iteration"] for m in ms] == [0, 1]
    for m in ms:
        # two groups a line (one per rank), never split: each group's members are one rank's VMs
        assert len(m["tasks"]) == 2 and m["episodes"] + m["dropped"] == 4
        assert sorted(g["group"] for g in m["groups"]) == [0, 1]
        by_group = {}
        for b in m["batch"]:
            by_group.setdefault(b["group"], set()).add(b["vm"] // 2)  # VMs 0-1: rank 0, VMs 2-3: rank 1
        assert all(len(ranks) == 1 for ranks in by_group.values()), by_group
        assert len(m["ranks"]) == 2 and all(r["vm_wait"] > 0 for r in m["ranks"])
        assert m["time/iteration"] == max(r["time/iteration"] for r in m["ranks"])  # the slowest rank
        assert m["actor/steps"] == 2 and m["actor/tokens"] == sum(b["target_tokens"] for b in m["batch"])
    # every rank's desktops in one folder, numbered among all ranks' VMs
    assert {f"vm{k:02d}.jsonl" for k in range(4)} <= set(os.listdir(run / "trajectories" / "it000000"))
    # resumed on 2 ranks, then in one process: the sharded checkpoint is a whole one
    _script("train_arpo.py", "--resume", run, "--iterations", 3)
    out = _script("train_arpo.py", "--resume", run, "--iterations", 4, "--vms", 2, ranks=1)
    assert "resumed" in out and [m["iteration"] for m in _metrics(run)] == [0, 1, 2, 3]
    state = torch.load(run / "ckpt" / "state.pt", weights_only=False)
    assert state["next_iteration"] == 4
    # the evaluation split over 2 ranks: every episode once, in one report
    _script("train_arpo.py", "--eval-only", "--resume", run, "--vms", 4, "--task-ids", "calc-open,clock-open",
            "--eval-episodes", 2)
    res = json.load(open(run / "eval_it000004.json"))
    assert res["lost"] == 0 and [d["job"] for d in res["details"]] == [0, 1, 2, 3]
    assert [d["task"] for d in res["details"]] == ["calc-open", "calc-open", "clock-open", "clock-open"]
    assert {d["vm"] for d in res["details"]} == {0, 1, 2, 3}  # jobs 0-1 on rank 0's VMs, 2-3 on rank 1's
    assert set(res["hard"]["per_task"]) == {"calc-open", "clock-open"}


def test_explore_under_torchrun_shares_one_group_and_one_world_model(tmp_path):
    from test_train_explore import speaking_tiny  # the tiny model, SFT'd to answer in the format
    speaker = speaking_tiny(str(tmp_path / "speaker"))
    run = tmp_path / "explore"
    fast = ["--max-pixels", 12544, "--max-new-tokens", 40, "--settle", 0.3, "--threads", 1,
            "--update-actor-delay", 0, "--rewards", "none,image,immediate,sequence,world_model", "--lora-rank", 4]
    _script("train_explore.py", "--vms", 2, "--model", speaker, "--iterations", 2, "--steps", 2, "--run-name", run, *fast)
    ms = _metrics(run)
    assert [m["iteration"] for m in ms] == [0, 1] and all(m["vms"] == 2 and m["steps"] == 4 for m in ms)
    assert all(m["wm/loss"] is not None and m["actor/updated"] == 1 for m in ms)
    # the advantages of the steps both ranks saved are one group's: mean 0 over all 8 steps
    adv = [json.loads(x)["advantage"] for it in (0, 1) for vm in (0, 1)
           for x in open(run / "trajectories" / f"it{it:06d}" / f"vm{vm:02d}.jsonl")]
    assert len(adv) == 8 and abs(sum(adv[:4])) < 1e-4 and abs(sum(adv[4:])) < 1e-4
    out = _script("train_explore.py", "--resume", run, "--iterations", 3, ranks=1)
    assert "resumed" in out and [m["iteration"] for m in _metrics(run)] == [0, 1, 2]


def _cmdline(pid: int) -> str:
    try:  # a short-lived child (a desktop's helper) may be gone by the time we look
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_a_killed_rank_stops_the_job_and_the_resume_loses_nothing(tmp_path):
    run = tmp_path / "arpo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "train_arpo.py", "--vms", "2", "--group-size", "1", "--iterations", "6", "--max-steps", "2",
           "--lora-rank", "4", *map(str, TINY_ARPO), "--run-name", str(run)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        wait_for(lambda: (run / "ckpt" / "COMPLETE").exists(), "the first checkpoint", timeout=300)
        # the ranks run the script (python -u train_arpo.py ...); a desktop's sandbox only names it among
        # the files it mounts
        ranks = [pid for pid in proc_descendants(p.pid) if "train_arpo.py" in _cmdline(pid).split("\0")[:3]]
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)  # one rank dies mid-run
        p.wait(timeout=120)  # torchrun stops the other one and exits
        assert p.returncode != 0
        wait_for(lambda: not [q for q in ranks if os.path.exists(f"/proc/{q}")], "every rank gone", timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    done = torch.load(run / "ckpt" / "state.pt", weights_only=False)["next_iteration"]
    assert 1 <= done < 6
    _script("train_arpo.py", "--resume", run, ranks=2)
    assert [m["iteration"] for m in _metrics(run)] == list(range(6))  # every iteration exactly once
