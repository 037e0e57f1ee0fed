"""explore_eval.py: how much of the desktop a policy explores, next to random actions (--eval-only).

    python train_explore.py --eval-only --model runs/<name>/models/E1 --episodes 20   # calls run_eval
    python -m pytest -q tests/test_train_explore.py -k "eval or dhash or diversity or distinct"

Each episode starts from a freshly reset desktop and plays --steps steps (explore_episode.explore,
with the window list recorded); per episode: the format rate, rewards.py's immediate and sequence
image terms per step, distinct screens (64-bit perceptual hash, dHash; and feature clusters), the
mean pairwise diversity of its distinct screens, and the windows it opened (X windows seen after a
step that were not open at the start, from the VM's GET /windows: one window counts once, whatever
its title does). eval.json holds every episode's numbers and actions; with `save` each episode is
also a trajectory view.py shows. Under torchrun each rank plays its share of the episodes.

Where this departs from the paper: its own numbers are its reward terms; these are ours, chosen
because they are what exploring means and the reward never sees them (the hash, the windows).
"""
from __future__ import annotations

import json
import os
from functools import partial

import numpy as np
import torch
from PIL import Image

from plumbing import dist
import rewards as R
import rollout
from plumbing import rundir
from env import VMPool
from explore_episode import Step, explore, step_line
from env import parse_settle


def dhash(img: Image.Image) -> int:
    """ALGO: the screen's 64-bit perceptual hash (dHash): grayscale, box-averaged down to 9 x 8
    pixels; bit k (row by row, the first bit highest) = pixel k+1 of its row is brighter than pixel k.
    It sees layout (a window, a menu), not detail: typing in a terminal keeps the hash."""
    a = np.asarray(img.convert("L").resize((9, 8), Image.BOX), dtype=np.int16)  # (8, 9)
    bits = (a[:, 1:] > a[:, :-1]).ravel()  # (64,)
    return sum(1 << (63 - k) for k, b in enumerate(bits) if b)


def hash_leaders(hashes: list[int], max_bits: int) -> list[int]:
    """ALGO: greedy leader clustering by Hamming distance: a screen is new when its hash differs
    from every earlier leader's in more than `max_bits` bits. Returns the leaders' indices."""
    leaders = []
    for k, h in enumerate(hashes):
        if all((h ^ hashes[j]).bit_count() > max_bits for j in leaders):
            leaders.append(k)
    return leaders


def distinct_screens(feats: torch.Tensor, same: float) -> int:
    """ALGO: greedy leader clustering of unit feature rows (N, D): a screen is new when its cosine
    to every earlier cluster leader is below `same`. Returns the number of clusters."""
    leaders = []
    for row in feats:
        if not leaders or float((torch.stack(leaders) @ row).max()) < same:
            leaders.append(row)
    return len(leaders)


def pairwise_diversity(feats: torch.Tensor) -> float:
    """ALGO: mean of 1 - cos over all pairs p < q of unit feature rows (N, D); 0 with fewer than 2."""
    n = len(feats)
    if n < 2:
        return 0.0
    sim = feats @ feats.T  # (N, N) cosines (unit rows)
    iu = torch.triu_indices(n, n, offset=1)  # (2, N(N-1)/2) every pair once
    return float((1 - sim[iu[0], iu[1]]).mean())


def opened_windows(steps: list[Step]) -> dict:
    """{X window id: title} of the windows seen after some step of the episode that were not open
    at its start (the first title a window was seen with)."""
    start, opened = steps[0].windows_before or {}, {}
    for s in steps:
        for wid, title in (s.windows_after or {}).items():
            if wid not in start and wid not in opened:
                opened[wid] = title
    return opened


def episode_metrics(steps: list[Step], same_hash: int, same_screen: float) -> dict:
    """One eval episode (its steps in order): format rate, immediate visual change and sequence
    diversity per step (rewards.py's image terms, 0 on format failures); over its screens [s_0,
    s'_1, ..., s'_T]: distinct screens (perceptual hash, <= same_hash bits apart = one screen; and
    feature clusters, cosine >= same_screen = one screen), the mean pairwise diversity of the
    distinct ones; windows: how many it opened (opened_windows)."""
    flags = R.parse_reward_flags("none,image,immediate,sequence")
    sb = R.screen_features([s.before for s in steps])  # (T, D)
    sa = R.screen_features([s.after for s in steps])  # (T, D)
    r = R.reward(R.Steps([s.vm for s in steps], [s.parsed is not None for s in steps], sb, sa), flags)
    screens = torch.cat([sb[:1], sa])  # (T + 1, D): s_0, s'_1 .. s'_T
    hashes = [dhash(im) for im in [steps[0].before] + [s.after for s in steps]]
    lead = hash_leaders(hashes, same_hash)
    windows = opened_windows(steps)
    return {"vm": steps[0].vm, "steps": len(steps), "format": float(r.format.mean()),
            "immediate": float(r.image_immediate.mean()), "sequence": float(r.image_sequence.mean()),
            "distinct_screens": len(lead), "distinct_screens_feat": distinct_screens(screens, same_screen),
            "diversity": pairwise_diversity(screens[lead]), "windows": len(windows),
            "window_titles": [windows[k] for k in sorted(windows)],
            "hashes": [f"{h:016x}" for h in hashes], "actions": [step_line(s) for s in steps]}


def eval_episode(desk: rollout.Desktop, steps: int, settle):
    """One eval episode (a generator for rollout.run): reset, `steps` steps with the window lists
    recorded; the desktop's next reset started when it ends. -> its Steps."""
    out = []
    yield from explore(desk, steps, parse_settle(settle), out, reset=True, windows=True, reset_after=True)
    return out


def run_eval(pool: VMPool, choosers: dict, run: str, steps: int, settle, episodes: int, same_hash: int = 2,
             same_screen: float = 0.95, save: bool = True, vm_offset: int = 0, config: dict | None = None) -> dict:
    """`episodes` episodes of `steps` steps (each on a freshly reset desktop; a desktop that finishes
    one starts the next) for each chooser ({name: chooser}: the policy, the random baseline); writes
    runs/<name>/eval.json (per episode its metrics and every step's action; `config`: the run's
    args, kept in it), prints a table. An episode the environment failed is played once more on
    another desktop (`lost` if that fails too). With `save` each episode is also saved as a
    trajectory (screenshots + one line per step): this rank's episode k in trajectories/it<k //
    desktops>/vm<vm_offset + k % desktops>.jsonl (the policy's; another chooser's under
    runs/<name>/<chooser>/), so `python view.py runs/<name>` shows them. Under torchrun each rank
    plays its share of the episodes on its desktops; rank 0 reports them all."""
    want = len(dist.shard_range(episodes))
    report = {"args": config or {}, "same_screen_hash_bits": same_hash, "same_screen_cosine": same_screen}
    for name, choose in choosers.items():
        out = rollout.run(pool, [partial(eval_episode, steps=steps, settle=settle)] * want, choose, retries=1,
                          desktops=rollout.in_service(pool), desc=f"eval {name}")
        played = []
        for k, result in enumerate(out.results):
            if isinstance(result, rollout.Lost):
                continue
            e = episode_metrics(result, same_hash, same_screen)
            e["round"], slot = divmod(k, pool.size)
            if save:
                rundir.save_trajectory(run if name == "policy" else os.path.join(run, name), e["round"],
                                       vm_offset + slot, e["actions"], [s.before for s in result])
            e["vm"] += vm_offset
            played.append(e)
        lost = int(dist.all_sum([want - len(played)])[0])
        played = [e for part in dist.gather(played) for e in part]  # every rank's, in rank order
        keys = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "diversity", "windows")
        summary = {k: float(np.mean([e[k] for e in played])) if played else None for k in keys}
        # Across episodes too: does the agent reach different screens in different episodes?
        summary["distinct_screens_all"] = len(hash_leaders([int(h, 16) for e in played for h in e["hashes"]],
                                                           same_hash))
        summary["episodes"], summary["lost"] = len(played), lost
        report[name] = {"summary": summary, "episodes": played}
    if not dist.is_main():
        return report
    path = os.path.join(run, "eval.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    cols = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "distinct_screens_all",
            "diversity", "windows", "episodes")
    heads = ("format", "immediate", "sequence", "screens/ep", "feat scr/ep", "screens all", "diversity", "windows/ep",
             "episodes")
    print(f"{'':8s}" + "".join(f"{h:>12s}" for h in heads))
    for name in choosers:
        s = report[name]["summary"]
        print(f"{name:8s}" + "".join(f"{'-' if s[c] is None else format(s[c], '.3f'):>12s}" for c in cols))
    print(f"eval report: {path} (screens: 64-bit dHash, <= {same_hash} bits apart = one screen)", flush=True)
    return report
