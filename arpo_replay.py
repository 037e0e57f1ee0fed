"""ARPO's replay buffer: per task, the successes of earlier iterations, and a group whose members
all failed gets one of them in place of its lowest scorer, so GRPO sees a non-zero advantage.

Used by train_arpo.py (`replay_and_store`: replay into this iteration's groups, THEN store its
successes); the buffer is saved in every checkpoint. Tests: `python -m pytest -q tests/test_arpo_replay.py`.

Where this departs from ARPO (arXiv 2505.16282 and its code):
1. Replay injection replaces the (first) lowest-scoring member of a failed group. ARPO's paper
   says a random member, its code the first one; in a group that qualifies (std < 0.05, mean <
   0.2) the members score about the same, and taking the lowest keeps a rare partial success
   (e.g. one 0.1 among seven 0s, std 0.035) that a random or first pick could throw away.
2. The buffer is saved in every checkpoint and restored on resume, its RNG included (ARPO's is lost).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import replace
from typing import Any, Sequence

import torch

from arpo_episode import Episode, from_record



class ReplayBuffer:
    """Per-task store of successful trajectories (ARPO). Trajectories are opaque: whatever the
    train script keeps (they must be picklable for checkpoints).

    Call order per iteration: inject into each new group first, then add its members, so an
    injected success always comes from an earlier iteration.
    """

    def __init__(self, capacity_per_task: int = 8, success_threshold: float = 0.1, seed: int = 0):
        self.capacity_per_task = int(capacity_per_task)
        self.success_threshold = float(success_threshold)
        self.data: dict[str, list[tuple[Any, float]]] = {}  # task -> [(trajectory, score)], oldest first
        self.rng = random.Random(seed)  # own RNG: resuming from state_dict replays the same choices

    def add(self, task_id, trajectory, score: float) -> bool:
        """Keep a success (score strictly above the threshold); returns whether it was kept."""
        if not (float(score) > self.success_threshold):  # ALGO: success = score > 0.1 (NaN is not)
            return False
        items = self.data.setdefault(str(task_id), [])
        items.append((trajectory, float(score)))
        if len(items) > self.capacity_per_task:
            items.pop(0)  # ALGO: bounded per task, oldest out: stays close to the current policy
        return True

    def sample(self, task_id):
        """A random stored success of this task, or None."""
        items = self.data.get(str(task_id))
        return self.rng.choice(items)[0] if items else None

    def inject(self, task_id, trajectories: list, scores: Sequence[float], std_below: float = 0.05,
               mean_below: float = 0.2) -> tuple[list, list[float], bool]:
        """If the group failed alike (std < std_below and mean < mean_below), replace its lowest
        scorer (the first of them on a tie) with a stored success so GRPO sees a non-zero
        advantage. ARPO's code replaces the first member, its paper a random one: the lowest keeps
        a partial success the group may hold (departure 1). Returns new lists + flag."""
        trajectories, scores = list(trajectories), [float(s) for s in scores]
        if not scores:
            return trajectories, scores, False
        std = statistics.stdev(scores) if len(scores) > 1 else 0.0  # unbiased, as group_advantages
        items = self.data.get(str(task_id))
        if not (std < std_below and statistics.fmean(scores) < mean_below) or not items:  # ALGO
            return trajectories, scores, False
        traj, score = self.rng.choice(items)
        worst = min(range(len(scores)), key=scores.__getitem__)
        trajectories[worst], scores[worst] = traj, score  # ALGO: one success into the failed group
        return trajectories, scores, True

    def __len__(self) -> int:
        return sum(len(v) for v in self.data.values())

    def state_dict(self) -> dict:
        """Plain lists, ints and floats (plus the trajectories): fits torch.save / pickle."""
        version, internal, gauss = self.rng.getstate()
        return {"capacity_per_task": self.capacity_per_task, "success_threshold": self.success_threshold,
                "data": {k: [[t, s] for t, s in v] for k, v in self.data.items()},
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, d: dict) -> None:
        self.capacity_per_task = int(d["capacity_per_task"])
        self.success_threshold = float(d["success_threshold"])
        self.data = {k: [(t, float(s)) for t, s in v] for k, v in d["data"].items()}
        version, internal, gauss = d["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def apply_replay(buffer: ReplayBuffer, members: list[Episode], group: int, vm_offset: int = 0) -> tuple[list, dict | None]:
    """ALGO: ARPO's replay. If the group failed alike (score std < 0.05 and mean < 0.2), one member
    is replaced by a stored success of the same task (stored in an EARLIER iteration: the buffer is
    filled only after this step). Returns the group's trajectories for the update + the injection."""
    # ARPO decides on the evaluator scores (not the rewards with their format penalty): a group
    # whose members all failed the task needs a success, however well-formed their answers were.
    new, _, injected = buffer.inject(members[0].task.id, members, [e.score for e in members])
    if not injected:
        return members, None
    k = next(i for i, (a, b) in enumerate(zip(members, new)) if a is not b)  # the replaced member
    # The stored success joins this group: its own reward, normalised against today's members. Its
    # sampler log-probs are an older policy's: dropped, so logp_gap compares like with like.
    ep = replace(from_record(new[k]), group=group, replayed=True, logprobs=[])
    return members[:k] + [ep] + members[k + 1:], {
        "task": ep.task.id, "group": group, "replaced_vm": vm_offset + members[k].vm, "from_iteration": ep.iteration,
        "from_vm": ep.vm, "score": ep.score, "reward": ep.reward}


def replay_groups(buffer: ReplayBuffer | None, fresh: list[Episode], task_ids: list[str], scores: dict,
                  vm_offset: int = 0):
    """Per group: replay (if on) and its stats. Returns (update batch, injections, group stats) of
    this rank's groups. `scores`: {group: its fresh members' scores} of EVERY group (under torchrun,
    of every rank): each rank keeps the same replay buffer, so every rank draws for every group."""
    batch, injections, stats = [], [], []
    for g, tid in enumerate(task_ids):
        members = [e for e in fresh if e.group == g]
        if not members:
            if buffer is not None and scores.get(g):  # another rank's group: the same draw as there
                buffer.inject(tid, [None] * len(scores[g]), scores[g])
            continue  # (or every VM of this group failed: nothing to learn from it)
        if buffer is not None:
            members, inj = apply_replay(buffer, members, g, vm_offset)
            injections += [inj] if inj else []
        batch += members
        r = torch.tensor([e.reward for e in members])  # (G,)
        # `scores` are this iteration's fresh rollouts only, so a success rate read from them is the
        # policy's; a replayed member's score is listed apart. `rewards` (and mean, std) are what the
        # update normalised, fresh and replayed members alike, labelled member by member in `members`.
        stats.append({"group": g, "task": tid, "n": len(members),
                      "scores": [e.score for e in members if not e.replayed],
                      "replayed_scores": [e.score for e in members if e.replayed],
                      "rewards": r.tolist(), "members": ["replayed" if e.replayed else "fresh" for e in members],
                      "mean": float(r.mean()), "std": float(r.std()) if len(r) > 1 else 0.0,
                      "replayed": any(e.replayed for e in members)})
    return batch, injections, stats
