"""What an ARPO iteration writes: one metrics.jsonl line of every rank's numbers, and its console line.

train_arpo.py calls `gather_metrics` after the update and `summary_line` for the console; view.py
and bench/ read the same keys back. Plumbing only: no number here feeds the algorithm.
"""
from __future__ import annotations

import numpy as np

from plumbing import dist
import rollout
from plumbing import rundir

UPDATE_KEYS = ("loss", "pg_loss", "kl", "clip_low", "clip_high", "clip_dual", "ratio_mean", "grad_norm", "tokens",
               "steps")


def flat_groups(groups: list, advantages: list[float]) -> int:
    """Flat groups: those whose advantages are all 0, so the update learns nothing from them
    (group_advantages gives that to equal rewards or a lone member). The update's own rule, so a
    group whose rewards differ by a hair counts as learning, as it does in the update (ARPO's
    code: std < 0.01)."""
    by_group: dict = {}
    for g, a in zip(groups, advantages):
        by_group.setdefault(g, []).append(a)
    return sum(all(a == 0 for a in advs) for advs in by_group.values())


def gather_metrics(tr, it: int, task_ids, fresh, out, batch, adv, pieces, upd, group_stats, injections,
                   times) -> dict:
    """One metrics.jsonl line of every rank's numbers (tr: train_arpo's Trainer): rewards, success,
    format, replay, the trained batch, the update's numbers, the time split (rundir.gather_times).
    `dropped` episodes are the environment's failures (nothing is retried in training, so it equals
    `env_failures`); `env_errors` says what failed where."""
    vm = tr.vm_offset
    parts = dist.gather({
        "fresh": [{"reward": e.reward, "score": e.score, "format_ok": e.format_ok, "steps": len(e.actions)}
                  for e in fresh],
        "batch": [{"task": e.task.id, "group": e.group, "vm": e.vm if e.replayed else vm + e.vm, "replayed": e.replayed,
                   "from_iteration": e.iteration, "reward": e.reward, "advantage": a,
                   "target_tokens": int(sum(sum(p.target_mask) for p in ps)), "steps": len(e.actions),
                   "sequences": len(ps)} for e, a, ps in zip(batch, adv, pieces)],
        "groups": group_stats, "injections": injections, "batches": out.batches, "settles": out.settles,
        "failures": [(vm + f.vm if f.vm is not None else None, f.error) for f in out.failures]})
    every = {k: [x for p in parts for x in p[k]] for k in parts[0]}
    fresh, failures, batch = every["fresh"], every["failures"], every["batch"]

    def mean(xs):
        return float(np.mean(xs)) if len(xs) else 0.0
    return {
        "iteration": it, "tasks": task_ids, "episodes": len(fresh), "dropped": len(failures),
        "env_failures": len(failures), **({"env_errors": {str(v): err for v, err in failures}} if failures else {}),
        "reward_mean": mean([e["reward"] for e in fresh]),
        "reward_std": float(np.std([e["reward"] for e in fresh])) if fresh else 0.0,
        "score_mean": mean([e["score"] for e in fresh]),
        "success_rate": mean([e["score"] > tr.args.success_threshold for e in fresh]),
        "format_rate": mean([ok for e in fresh for ok in e["format_ok"]]),  # share of steps that parsed
        "steps_mean": mean([e["steps"] for e in fresh]),
        "batch": batch, "groups": every["groups"],
        "flat_groups": flat_groups([b["group"] for b in batch], [b["advantage"] for b in batch]),
        "replay_injections": every["injections"], "n_injections": len(every["injections"]),
        "replay_size": len(tr.replay) if tr.replay is not None else 0,
        **{f"actor/{k}": upd.get(k, 0.0) for k in UPDATE_KEYS},
        # trainer vs sampler log-probs of this iteration's sampled tokens (0 on the HF path; vLLM
        # numerics show here), over the micro-batches whose sequences all carry the sampler's numbers
        **({"actor/logp_gap": upd["logp_gap"]} if "logp_gap" in upd else {}),
        "rollout/batches": len(every["batches"]), "rollout/batch_mean": mean(every["batches"]),
        **rollout.settle_metrics(every["settles"]),
        **rundir.gather_times(times)}


def summary_line(m: dict, beta: float = 0.0) -> str:
    """The console line of an iteration (`kl n/a`: with --beta 0 no KL is computed)."""
    kl = f"kl {m['actor/kl']:.4f}" if beta else "kl n/a"
    return (f"it {m['iteration']:4d} | tasks {','.join(m['tasks'])[:40]:40s} | reward {m['reward_mean']:+.2f}"
            f"±{m['reward_std']:.2f} | success {m['success_rate']:.2f} | format {m['format_rate']:.2f} | "
            f"replay +{m['n_injections']}{''.join(' ' + i['task'] for i in m['replay_injections'])} "
            f"({m['replay_size']} stored) | flat groups {m['flat_groups']}/{len(m['groups'])} | "
            f"{kl} clip {m['actor/clip_low']:.2f}/{m['actor/clip_high']:.2f}/"
            f"{m['actor/clip_dual']:.2f} ({m['actor/steps']:.0f} steps) | {m['time/iteration']:.1f}s (gen "
            f"{m['time/generation']:.1f} in {m['rollout/batches']} batches, upd {m['time/update']:.1f}, VM wait "
            f"{100 * m['vm_wait_share']:.0f}%; per desktop: reset {m['time/reset']:.1f} env {m['time/env']:.1f} "
            f"eval {m['time/evaluate']:.1f})" + (f" | env failures {m['env_failures']}" if m["env_failures"] else ""))
