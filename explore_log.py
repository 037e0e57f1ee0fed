"""What a ScreenExplorer iteration writes: its metrics.jsonl line, its console line, its trajectories.

train_explore.py calls these after the update; view.py and bench/ read the same keys back. Plumbing
only: no number here feeds the algorithm (the rewards are computed in rewards.py, before).
"""
from __future__ import annotations

import numpy as np
import torch

from plumbing import dist
import rewards as R
import rollout
from plumbing import rundir
from explore_episode import Step, step_line


def console_line(m: dict, flags: dict, beta: float) -> str:
    """The iteration's summary. The reward terms that are on (rewards.TERMS), grouped by the first
    word of their name in the table's order: image imm/seq/wm, text imm/seq/wm, intent
    before/after/click, and any term added to the table (`-` for a term of a shown group that is
    off). `kl n/a`: no KL was computed (--beta 0, or no actor update this iteration)."""
    f = lambda k, fmt="{:.3f}": "-" if m.get(k) is None else fmt.format(m[k])  # noqa: E731
    on, groups = R.terms_on(flags), {}
    for name in R.TERMS:
        groups.setdefault(name.split("_")[0], []).append(name)
    terms = "".join(f"{g} " + "/".join(f(f"reward/{n}") if n in on else "-" for n in names) + " "
                    for g, names in groups.items() if set(names) & set(on))
    kl = f"kl {m['actor/kl']:.4f}" if beta and m.get("actor/kl") is not None else "kl n/a"
    return (f"it {m['iteration']:4d} E{m['generation']} | vms {m['vms']} steps {m['steps']} | "
            f"reward {f('reward/total')} fmt {f('reward/format', '{:.2f}')} {terms}| "
            f"wm {f('wm/loss', '{:.4f}')} | {kl} clip {f('actor/clip_low', '{:.2f}')}/{f('actor/clip_high', '{:.2f}')} | "
            f"{m['time/iteration']:.1f}s (gen {m.get('time/generation', 0):.1f} feat {m.get('time/features', 0):.1f} "
            f"upd {m.get('time/update', 0):.1f}, VM wait {100 * m.get('vm_wait_share', 0):.0f}%; per desktop: "
            f"reset {m.get('time/reset', 0):.1f} env {m.get('time/env', 0):.1f})"
            + (f" | env failures {m['env_failures']}" if m.get("env_failures") else ""))


ACTOR_KEYS = ("actor/loss", "actor/kl", "actor/clip_low", "actor/clip_high", "actor/grad_norm", "actor/lr")


def iteration_metrics(buffer: list[Step], r, adv, wm_metrics: dict, upd: dict | None, out) -> dict:
    """The metrics line's numbers of every rank: desktops and steps, every reward term over every
    rank's steps, the world model's and the update's numbers (None before the actor's first update),
    environment failures, generation batches, how the screens settled."""
    parts = dist.gather((r, adv, len({s.vm for s in buffer}), len(out.failures), out.settles))
    r_all, adv_all = R.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (N_all,) each
    return {"vms": sum(p[2] for p in parts), "steps": len(r_all.total), **R.summarize_rewards(r_all), **wm_metrics,
            "actor/updated": int(upd is not None), **dict.fromkeys(ACTOR_KEYS),
            **{f"actor/{k}": v for k, v in (upd or {}).items()},
            "adv/std": float(adv_all.std()) if len(adv_all) > 1 else 0.0, "env_failures": sum(p[3] for p in parts),
            "rollout/batches": len(out.batches), "rollout/batch_mean": float(np.mean(out.batches or [0])),
            **rollout.settle_metrics([s for p in parts for s in p[4]])}


def trajectory_lines(buffer: list[Step], rows: list[int], r, adv) -> list[dict]:
    """One JSON line per step of one desktop: what it saw (the PNG), said, did, and earned."""
    comps = {"format": r.format, **r.parts}  # every term of rewards.TERMS, (N,) each
    return [{**step_line(buffer[k]), "completion_ids": buffer[k].gen.completion_ids,
             "image_size": list(buffer[k].gen.prompt.image_sizes[0]), "reward": float(r.total[k]), "advantage": float(adv[k]),
             "rewards": {n: float(c[k]) for n, c in comps.items()}} for k in rows]


def save_trajectories(run: str, it: int, buffer: list[Step], r, adv, vm_offset: int = 0) -> None:
    """This rank's desktops' steps; VMs are numbered among all ranks' (this rank's first is vm_offset)."""
    for vm in sorted({s.vm for s in buffer}):
        rows = [k for k, s in enumerate(buffer) if s.vm == vm]
        rundir.save_trajectory(run, it, vm_offset + vm, trajectory_lines(buffer, rows, r, adv),
                               [buffer[k].before for k in rows])
