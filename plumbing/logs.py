"""plumbing/logs.py: what an iteration of each trainer writes: its metrics.jsonl line (every rank's
numbers), its console line, its trajectory files, and the tables of the evaluations.

The trainers call these after their update; view.py and bench/ read the same keys back. Plumbing
only: every number here was decided by the algorithm before (the rewards, advantages and update of
train_arpo.py / train_explore.py, grpo.py and rewards.py); nothing here feeds back into it.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import numpy as np
import torch

import rewards as R
import rollout
from env import png_bytes
from plumbing import dist, rundir

# ------------------------------------------------------------------------------------------------
# ARPO

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


def group_stats(batch: list, task_ids: list[str]) -> list[dict]:
    """Per group of this rank's batch: its fresh members' scores (a success rate read from them is
    the policy's), a replayed member's apart, and the rewards the update normalised, member by member."""
    stats = []
    for g, tid in enumerate(task_ids):
        members = [e for e in batch if e.group == g]
        if not members:
            continue
        r = torch.tensor([e.reward for e in members])  # (G,)
        stats.append({"group": g, "task": tid, "n": len(members),
                      "scores": [e.score for e in members if not e.replayed],
                      "replayed_scores": [e.score for e in members if e.replayed],
                      "rewards": r.tolist(), "members": ["replayed" if e.replayed else "fresh" for e in members],
                      "mean": float(r.mean()), "std": float(r.std()) if len(r) > 1 else 0.0,
                      "replayed": any(e.replayed for e in members)})
    return stats


def arpo_metrics(it: int, task_ids, fresh, out: rollout.Rollout, first_vm: int, batch, adv, pieces, upd: dict,
                 injections: list, replay_size: int, success_threshold: float, times: dict) -> dict:
    """One metrics.jsonl line of every rank's numbers: rewards, success, format, replay, the trained
    batch, the update's numbers, the time split (rundir.gather_times). `dropped` episodes are the
    environment's failures (nothing is retried in training, so it equals `env_failures`);
    `env_errors` says what failed where (first_vm: this rank's first VM's number)."""
    parts = dist.gather({
        "fresh": [{"reward": e.reward, "score": e.score, "format_ok": e.format_ok, "steps": len(e.actions),
                   "domain": e.task.domain} for e in fresh],
        "batch": [{"task": e.task.id, "group": e.group, "vm": e.vm, "replayed": e.replayed,
                   "from_iteration": e.iteration, "reward": e.reward, "advantage": a,
                   "target_tokens": int(sum(sum(p.target_mask) for p in ps)), "steps": len(e.actions),
                   "sequences": len(ps)} for e, a, ps in zip(batch, adv, pieces)],
        "groups": group_stats(batch, task_ids), "injections": injections, "batches": out.batches,
        "settles": out.settles, "failures": [(first_vm + f.vm if f.vm is not None else None, f.error)
                                             for f in out.failures]})
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
        "success_rate": mean([e["score"] > success_threshold for e in fresh]),
        "format_rate": mean([ok for e in fresh for ok in e["format_ok"]]),  # answers that parsed and ran (format_ok)
        "steps_mean": mean([e["steps"] for e in fresh]),
        # OSWorld's tasks have a domain (chrome, os, ...): success per domain, as OSWorld reports
        **{f"success/{d}": mean([e["score"] > success_threshold for e in fresh if e["domain"] == d])
           for d in sorted({e["domain"] for e in fresh} - {""})},
        "batch": batch, "groups": every["groups"],
        "flat_groups": flat_groups([b["group"] for b in batch], [b["advantage"] for b in batch]),
        "replay_injections": every["injections"], "n_injections": len(every["injections"]), "replay_size": replay_size,
        **{f"actor/{k}": upd.get(k, 0.0) for k in UPDATE_KEYS},
        # trainer vs sampler log-probs of this iteration's sampled tokens (0 on the HF path; vLLM
        # numerics show here), over the micro-batches whose sequences all carry the sampler's numbers
        **({"actor/logp_gap": upd["logp_gap"]} if "logp_gap" in upd else {}),
        "rollout/batches": len(every["batches"]), "rollout/batch_mean": mean(every["batches"]),
        **rollout.settle_metrics(every["settles"]),
        **rundir.gather_times(times)}


def arpo_line(m: dict, beta: float = 0.0) -> str:
    """The console line of an ARPO iteration (`kl n/a`: with --beta 0 no KL is computed)."""
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


def save_episodes(run: str, it: int, eps: list, clear: bool = True) -> None:
    """Each ARPO episode: every step's screenshot, thought, action, then a final line with the score
    and the desktop that played it. Episode e goes to trajectories/it<it>/vm<e.job>.jsonl: numbered
    by its job, not by its desktop, since a desktop may play several episodes of an iteration
    (fewer desktops than a group play it in turns)."""
    if clear:
        rundir.clear_trajectories(run, it)
    for e in eps:
        if e is None or not e.screenshots:
            continue
        # A dropped episode may have one screenshot more than answers (the VM died in between).
        n = len(e.texts)
        steps = [{"step": s, "task": e.task.id, "thought": e.thoughts[s] if s < n else "",
                  "text": e.texts[s] if s < n else "", "format_ok": e.format_ok[s] if s < n else None,
                  "action": e.actions[s] if s < n else None} for s in range(len(e.screenshots))]
        steps.append({"final": True, "task": e.task.id, "instruction": e.task.instruction,
                      **({"domain": e.task.domain} if e.task.domain else {}), "group": e.group,
                      "end": e.end, "error": e.error, "score": e.score, "score_standard": e.score_standard,
                      "format_penalty": e.reward - e.score, "reward": e.reward, "vm": e.vm})
        rundir.save_trajectory(run, it, e.job, steps, list(e.screenshots) + [None])


def eval_table(result: dict) -> str:
    fmt = lambda v: "  -  " if v is None else f"{v:5.2f}"  # noqa: E731
    rows = [f"{'task':32s} standard  hard"]
    for tid in result["standard"]["per_task"]:
        rows.append(f"{tid:32s} {fmt(result['standard']['per_task'][tid])}   {fmt(result['hard']['per_task'][tid])}")
    for d in result["standard"].get("per_domain", {}):  # OSWorld's tasks
        rows.append(f"{'domain ' + d:32s} {fmt(result['standard']['per_domain'][d])}   {fmt(result['hard']['per_domain'][d])}")
    rows.append(f"{'overall':32s} {fmt(result['standard']['overall'])}   {fmt(result['hard']['overall'])}"
                f"   ({result['episodes']} episodes, {result['lost']} lost to VM failures)")
    return "\n".join(rows)


def arpo_eval(evaluate, args, run: str, iteration: int) -> dict:
    """--eval-only: evaluate(folder) -> train_arpo.evaluate's result, with the episodes saved in
    `folder` (eval_it<N>/ beside the JSON, or none without --save-trajectories); writes
    eval_it<N>.json (or --eval-out) and prints the table. A second eval of the same checkpoint
    replaces the first."""
    out = args.eval_out or os.path.join(run, f"eval_it{iteration:06d}.json")
    root, ext = os.path.splitext(out)
    folder = root if ext else out + "_episodes"  # never the JSON's own path
    if dist.is_main():
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    result = evaluate(folder if args.save_trajectories else None)
    result.update(model=args.model, run=run, iteration=iteration, protocols={
        "standard": "an episode that runs out of steps counts its last action as FAIL (OSWorld)",
        "hard": "the last action is what the agent did (OSWorld-Hard in ARPO)"})
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(eval_table(result))
        print(f"eval written to {out}")
    return result


# ------------------------------------------------------------------------------------------------
# ScreenExplorer

ACTOR_KEYS = ("actor/loss", "actor/kl", "actor/clip_low", "actor/clip_high", "actor/grad_norm", "actor/lr")


def explore_line(m: dict, flags: dict, beta: float) -> str:
    """The console line of a ScreenExplorer iteration. The reward terms that are on (rewards.TERMS),
    grouped by the first word of their name in the table's order: image imm/seq/wm, text imm/seq/wm,
    intent before/after/click, and any term added to the table (`-` for a term of a shown group
    that is off). `kl n/a`: no KL was computed (--beta 0, or no actor update this iteration)."""
    f = lambda k, fmt="{:.3f}": "-" if m.get(k) is None else fmt.format(m[k])  # noqa: E731
    on, groups = R.terms_on(flags), {}
    for name in R.TERMS:
        groups.setdefault(name.split("_")[0], []).append(name)
    terms = "".join(f"{g} " + "/".join(f(f"reward/{n}") if n in on else "-" for n in names) + " "
                    for g, names in groups.items() if set(names) & set(on))
    kl = f"kl {m['actor/kl']:.4f}" if beta and m.get("actor/kl") is not None else "kl n/a"
    return (f"it {m['iteration']:4d} E{m['generation']} | vms {m['vms']} steps {m['steps']} | "
            f"reward {f('reward/total')} format {f('reward/format', '{:.2f}')} {terms}| "
            f"wm {f('wm/loss', '{:.4f}')} | {kl} clip {f('actor/clip_low', '{:.2f}')}/{f('actor/clip_high', '{:.2f}')} | "
            f"{m['time/iteration']:.1f}s (gen {m.get('time/generation', 0):.1f} feat {m.get('time/features', 0):.1f} "
            f"upd {m.get('time/update', 0):.1f}, VM wait {100 * m.get('vm_wait_share', 0):.0f}%; per desktop: "
            f"reset {m.get('time/reset', 0):.1f} env {m.get('time/env', 0):.1f})"
            + (f" | env failures {m['env_failures']}" if m.get("env_failures") else ""))


def explore_metrics(buffer: list, r, adv, wm_metrics: dict, upd: dict | None, out: rollout.Rollout) -> dict:
    """The metrics line's numbers of every rank: desktops and steps, every reward term over every
    rank's steps, the world model's and the update's numbers (None before the actor's first update),
    environment failures, generation batches, how the screens settled."""
    opened = {s.vm: [] for s in buffer if s.opened is not None}  # per desktop: the apps its steps opened
    for s in buffer:
        opened.get(s.vm, []).extend(s.opened or [])
    parts = dist.gather((r, adv, len({s.vm for s in buffer}), len(out.failures), out.settles, opened))
    r_all, adv_all = R.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (N_all,) each
    return {"vms": sum(p[2] for p in parts), "steps": len(r_all.total), **R.summarize_rewards(r_all), **wm_metrics,
            **app_counts([apps for p in parts for apps in p[5].values()], len(r_all.total)),
            "actor/updated": int(upd is not None), **dict.fromkeys(ACTOR_KEYS),
            **{f"actor/{k}": v for k, v in (upd or {}).items()},
            "adv/std": float(adv_all.std()) if len(adv_all) > 1 else 0.0, "env_failures": sum(p[3] for p in parts),
            "rollout/batches": len(out.batches), "rollout/batch_mean": float(np.mean(out.batches or [0])),
            **rollout.settle_metrics([s for p in parts for s in p[4]])}


def app_counts(episodes: list[list[str]], steps: int) -> dict:
    """With the window lists recorded (--record-windows, or a term that reads them): windows opened
    per step, distinct apps per episode, and the windows of each app ("other": no app of the
    desktop's 7) opened in the iteration. {} when they were not recorded."""
    if not episodes:
        return {}
    counts = Counter(x for apps in episodes for x in apps)
    return {"windows/opened_per_step": sum(counts.values()) / max(1, steps),
            "apps/distinct_per_episode": float(np.mean([len(set(apps) - {"other"}) for apps in episodes])),
            **{f"apps/{name}": n for name, n in sorted(counts.items())}}


def step_line(s) -> dict:
    """What one ScreenExplorer step did, as a line of a trajectory file (training's and the eval's):
    the answer, the action it ran (screen pixels; None = a format failure, nothing ran), the VM's
    refusal if any. `valid` is the step's format_ok (the name run folders have always had)."""
    action = None if s.parsed is None else {**s.parsed.action.to_dict(), **({"refused": s.error} if s.error else {})}
    return {"step": s.step, "intent": s.parsed.thought if s.parsed else None, "action": action, "valid": s.format_ok,
            "error": s.error, "text": s.text, "screen": list(s.before.size),
            **({"opened": s.opened} if s.opened is not None else {})}


def save_steps(run: str, it: int, buffer: list, r, adv) -> None:
    """This rank's desktops' steps, one file per desktop: what each step saw (the PNG), said, did,
    and earned (every term of rewards.TERMS)."""
    comps = {"format": r.format, **r.parts}  # (N,) each
    for vm in sorted({s.vm for s in buffer}):
        rows = [k for k, s in enumerate(buffer) if s.vm == vm]
        lines = [{**step_line(buffer[k]), "completion_ids": buffer[k].answer.ids,
                  "image_size": list(buffer[k].answer.prompt.image_sizes[0]), "reward": float(r.total[k]),
                  "advantage": float(adv[k]), "rewards": {n: float(c[k]) for n, c in comps.items()}} for k in rows]
        rundir.save_trajectory(run, it, vm, lines, [buffer[k].before for k in rows])


# The distillation data: distill/gen<g>.jsonl, one line per kept step (its screenshot in
# distill/gen<g>/, its answer's sampled ids, its reward, its iteration), appended by rank 0 as each
# iteration ends, before its checkpoint; a resume drops the lines of iterations it redoes
# (ckpt.trim_distilled).


def save_distilled(run: str, g: int, it: int, buffer: list, r, rows: list[int]) -> None:
    """Append the kept steps `rows` of this rank's buffer (every rank's, gathered) to generation g's
    distillation data."""
    mine = []
    for k in rows:
        s = buffer[k]
        mine.append({"vm": s.vm, "step": s.step, "png": png_bytes(s.before), "text": s.text, "completion_ids": s.answer.ids,
                     "intent": s.parsed.thought, "action": s.parsed.action.to_dict(), "reward": float(r.total[k])})
    kept = dist.every(mine)
    if dist.is_main():
        _append_distilled(run, g, it, sorted(kept, key=lambda d: (-d["reward"], d["vm"], d["step"])))  # as top_steps ranks
    dist.barrier()


def _append_distilled(run: str, g: int, it: int, kept: list[dict]) -> None:
    folder = os.path.join(run, "distill", f"gen{g}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(run, "distill", f"gen{g}.jsonl"), "a") as fh:
        for d in kept:
            name = f"it{it:06d}_vm{d['vm']:02d}_step{d['step']:02d}.png"
            if "png" in d:
                with open(os.path.join(folder, name), "wb") as img:
                    img.write(d["png"])
            else:  # from a trajectory file: copy its screenshot
                shutil.copyfile(d["source"], os.path.join(folder, name))
            fh.write(json.dumps({"image": f"gen{g}/{name}", "text": d["text"], "completion_ids": d["completion_ids"],
                                 "intent": d["intent"], "action": d["action"], "reward": d["reward"],
                                 "iteration": it}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def distilled(run: str, upto: int) -> list[dict]:
    """The lines of every distilled step of generations 1..upto, in order."""
    out = []
    for g in range(1, upto + 1):
        path = os.path.join(run, "distill", f"gen{g}.jsonl")
        if os.path.exists(path):
            with open(path) as fh:
                out += [json.loads(line) for line in fh if line.strip()]
    return out


def distill_from_trajectories(run: str, g: int, iterations: range, top_steps) -> None:
    """For a run written before distillation data was kept per iteration (it was made from the
    trajectory files at a generation's end): the best steps of `iterations` of generation g, read
    from their trajectory files (top_steps: the trainer's ranking), appended to its data."""
    for it in iterations:
        folder = os.path.join(run, "trajectories", f"it{it:06d}")
        steps = []
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".jsonl"):
                with open(os.path.join(folder, name)) as fh:
                    steps += [dict(json.loads(line), vm=int(name[2:-6]), iteration=it) for line in fh]
        valid = [s for s in steps if s.get("valid") and s.get("completion_ids") and s.get("screenshot")]
        kept = [{**s, "source": os.path.join(folder, s["screenshot"])} for s in top_steps(valid)]
        _append_distilled(run, g, it, kept)


def eval_summary(played: list[dict], lost: int, same_hash: int) -> dict:
    """One policy's eval episodes (every rank's) and their means."""
    keys = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "diversity", "windows")
    summary = {k: float(np.mean([e[k] for e in played])) if played else None for k in keys}
    # Across episodes too: does the agent reach different screens in different episodes?
    summary["distinct_screens_all"] = len(R.hash_leaders([int(h, 16) for e in played for h in e["hashes"]], same_hash))
    summary["episodes"], summary["lost"] = len(played), lost
    return {"summary": summary, "episodes": played}


def explore_eval(report: dict, run: str, names: list[str], same_hash: int) -> dict:
    """runs/<name>/eval.json (per episode its measures and every step's action) and the table."""
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
    for name in names:
        s = report[name]["summary"]
        print(f"{name:8s}" + "".join(f"{'-' if s[c] is None else format(s[c], '.3f'):>12s}" for c in cols))
    print(f"eval report: {path} (screens: 64-bit dHash, <= {same_hash} bits apart = one screen)", flush=True)
    return report
