"""ScreenExplorer's claims (arXiv 2505.19095), run by bench/claims.py:

    python bench/claims.py explore-diversity     # A: a trained agent opens more apps, and more kinds
    python bench/claims.py explore-curiosity     # B: without the world model's curiosity, less of both
    python bench/claims.py explore-distillation  # C: generation 2 starts where generation 1 could not
    python bench/claims.py explore-curves        # D: the reward terms rise, the world model's loss stays high

Every claim plays the tiny Qwen2.5-VL (--model tiny, weights from the seed) on real local desktops,
from a warm start that knows the answer format and nothing of the desktop (bench/learning_explore.py:
every action type equally often, points drawn where something is drawn on real screenshots). The
setting (`DEFAULTS`, each overridable with --set KEY=VALUE):
- the paper's reward and advantages: `--rewards all` (every term of the paper: image and OCR-text
  immediate / sequence / world-model, intent) and `--scale-rewards on` (GRPO's division by the
  buffer's std); 8 desktops, episodes of `steps` steps (the paper plays 10);
- the optimiser of bench/learning_explore.py (full fine-tuning of the tiny model at lr 1e-3 with a
  2-iteration warm-up and a linear decay, the actor from iteration 2, `iterations` iterations):
  the paper's LoRA lr 4e-5 on a 3B model does not move a tiny model trained from scratch.

Apps. The desktop has 7 apps behind its icons; a window is counted as one of them by its class
(WM_CLASS, GET /windows; env.app_of), so the file manager is one app whatever folder its title
names; dialogs and openbox's own windows are windows, not apps. Per evaluation episode (fresh
desktop, T = 1, `steps` steps): distinct apps opened, windows opened, distinct screens (64-bit
dHash). Over an evaluation: the most-opened app's share of the app windows, and coverage (apps
opened at least once).

B, C and D build on A's runs, so the arms of a comparison share A's warm start and A's trained
arm is not trained twice: they read `--set source=DIR` (default: runs/claims/explore-diversity, A's
last output; with --smoke, A's smoke output beside theirs) and run A there first if a seed is
missing. B trains its one new arm (no curiosity) from A's warm start; C copies A's run and resumes
it into a second generation; D reads A's training curves. So run A, then B, C, D on its output:
each verdict of B, C, D is on the same seeds and warm starts as the A run it names.

Statistics: per seed, over evaluation episodes (bench/claims.py `episodes_test`: a one-sided
permutation test with the difference of means and its 90% bootstrap interval), every seed must
pass. Why not paired over seeds: a sign-flip test needs 5 seeds for p < 0.05, and a seed here costs
15-30 minutes; each seed's 24+ episodes are a replication of their own.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from collections import Counter

import numpy as np

import claims as C
import learning_explore as LE

DEFAULTS = dict(
    vms=8, steps=10, iterations=48, eval_episodes=24, rewards="all", paper_rewards="all", scale_rewards="on",
    lr=1e-3, lr_warmup=2, lr_schedule="linear", update_actor_delay=2, max_new_tokens=40, max_pixels=12544,
    settle="watch", warm_steps=150, warm_batch=4, warm_lr=3e-3, warm_screens=6, warm_points="drawn",
    source="",  # B, C, D: the explore-diversity output folder to build on (default: its own, beside theirs)
)
SMOKE = dict(vms=2, steps=2, iterations=2, eval_episodes=2, warm_steps=4, warm_screens=2, update_actor_delay=0,
             lr_warmup=0)
STEP_KINDS = ("new app", "same app", "other window", "menu or change", "nothing")
CHANGED = 0.01  # image_immediate above this: the screen changed (a click on the empty desktop: 0.000,
#                 a right-click menu 0.07-0.16, an app's window 0.06-1.03; docs/log.md, 2026-12-02)


# ------------------------------------------------------------------------------------------------
# The runs: a warm start and its eval per seed (shared by every arm), then each arm's training


def le_args(s: dict, out: str) -> argparse.Namespace:
    """bench/learning_explore.py's namespace with this claim's settings."""
    a = LE.parser().parse_args([])
    for k, v in s.items():
        if hasattr(a, k):
            setattr(a, k, v)
    a.out = out
    return a


def seed_start(seed: int, s: dict, out: str) -> dict:
    """The seed's warm start and its eval beside random actions, built once and kept in
    <out>/seed<k>/ (every arm of the claim starts from it; a rerun of the claim rebuilds it)."""
    start = fresh_start(out, seed, os.path.join(out, f"seed{seed}", "warm"))
    root, log, warm = start["root"], start["log"], start["warm"]
    a = le_args(s, out)
    info = LE.build_warm_start(warm, seed, LE.desktop_screens(a.warm_screens, seed), a)
    print(f"seed {seed}: warm start {info['seconds']:.0f} s, parse {info['parse']:.2f}", flush=True)
    before = LE.evaluate(warm, os.path.join(root, "before"), 1000 + seed, a, log, baseline=True)
    return {"root": root, "log": log, "warm": warm, "info": info, "before": before}


def train_arm(seed: int, s: dict, start: dict, arm: str, extra: list, out: str) -> dict:
    """Train one arm from the seed's warm start for exactly s["iterations"] iterations (per
    generation), then evaluate its last model. extra: the arm's own train_explore.py flags."""
    a = le_args(s, out)
    run = os.path.join(start["root"], arm)
    flags = ["--model", start["warm"], "--iterations", s["iterations"], "--run-name", run, "--runs-dir", "",
             "--seed", seed, "--lora-rank", 0, "--lr", s["lr"], "--lr-warmup", s["lr_warmup"],
             "--lr-schedule", s["lr_schedule"], "--update-actor-delay", s["update_actor_delay"],
             "--rewards", s["rewards"], "--record-windows", *([] if s["scale_rewards"] == "on" else ["--no-scale-rewards"]),
             *LE.common_flags(a), *map(str, extra)]
    seconds = LE.trainer(flags, start["log"])
    print(f"seed {seed} {arm}: trained in {seconds / 60:.1f} min", flush=True)
    return {"run": run, "seconds": seconds}


def evaluate(model: str, seed: int, s: dict, start: dict, name: str, out: str) -> dict:
    a = le_args(s, out)
    return LE.evaluate(model, os.path.join(start["root"], name), 1000 + seed, a, start["log"], baseline=False)


def fresh_start(out: str, seed: int, warm: str) -> dict:
    """An emptied <out>/seed<k> whose arms start from `warm` (A's warm start of that seed)."""
    root = os.path.join(out, f"seed{seed}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    return {"root": root, "log": os.path.join(root, "console.log"), "warm": warm}


def diversity_runs(a, s: dict) -> tuple[str, dict]:
    """A's runs for B, C and D: per seed its warm start, the warm start's eval (beside random
    actions), the trained run and its eval, read from `source` (--set source=DIR; default A's own
    output folder beside this claim's), after running A there for the seeds it lacks. -> (source,
    {seed: {"root", "warm", "before", "rl", "after"}})."""
    src = s["source"] or os.path.join(os.path.dirname(a.out), "explore-diversity" + ("-smoke" if a.smoke else ""))

    def have(seed):
        root = os.path.join(src, f"seed{seed}")
        return all(os.path.exists(os.path.join(root, p)) for p in
                   ("warm", "before/eval.json", "rl/models/E1", "after/eval.json", "rl/metrics.jsonl"))
    missing = [seed for seed in a.seed_list if not have(seed)]
    if missing:
        print(f"explore-diversity has no runs of seeds {missing} in {src}: running them first", flush=True)
        div = argparse.Namespace(**{**vars(a), "out": src, "seed_list": missing})
        diversity(div)
    runs = {}
    for seed in a.seed_list:
        root = os.path.join(src, f"seed{seed}")
        with open(os.path.join(root, "before", "eval.json")) as fh:
            before = json.load(fh)
        with open(os.path.join(root, "after", "eval.json")) as fh:
            after = json.load(fh)
        runs[seed] = {"root": root, "warm": os.path.join(root, "warm"), "before": before,
                      "rl": os.path.join(root, "rl"), "after": after}
    return src, runs


# ------------------------------------------------------------------------------------------------
# What an eval shows of apps


def apps_of(ev: dict, who: str = "policy") -> dict:
    """Per episode of one policy's eval (eval.json): distinct apps, windows, distinct screens; over
    the eval: app counts (windows opened per app), the most-opened app's share, coverage."""
    eps = ev[who]["episodes"]
    counts = Counter(app for e in eps for app in e.get("apps", []) if app != "other")
    total = sum(counts.values())
    top, top_n = counts.most_common(1)[0] if counts else ("-", 0)
    return {"apps": [len(set(e.get("apps", [])) - {"other"}) for e in eps],
            "windows": [e["windows"] for e in eps], "screens": [e["distinct_screens"] for e in eps],
            "counts": dict(counts.most_common()), "top": top, "top_share": top_n / total if total else None,
            "coverage": len(counts), "format": float(np.mean([e["format"] for e in eps])) if eps else 0.0}


def app_row(label: str, m: dict) -> str:
    share = "-" if m["top_share"] is None else f"{m['top_share']:.2f}"
    counts = ", ".join(f"{k} {v}" for k, v in m["counts"].items()) or "none"
    return (f"  {label:>8s} apps/ep {np.mean(m['apps']):5.2f}  windows/ep {np.mean(m['windows']):5.2f}  "
            f"screens/ep {np.mean(m['screens']):5.2f}  parse {m['format']:.2f}  top {m['top']} ({share})  "
            f"coverage {m['coverage']}/7  [{counts}]")


# ------------------------------------------------------------------------------------------------
# What training paid for: the reward terms per kind of step, and their curves


def trajectory_steps(run: str) -> list[list[dict]]:
    """Per iteration of a training run, its step lines (every desktop's), from trajectories/."""
    root = os.path.join(run, "trajectories")
    out = []
    for it in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        lines = []
        for name in sorted(os.listdir(os.path.join(root, it))):
            if name.endswith(".jsonl"):
                with open(os.path.join(root, it, name)) as fh:
                    lines += [dict(json.loads(x), episode=name) for x in fh if x.strip()]
        out.append(lines)
    return out


def step_kind(line: dict, seen: set) -> str:
    """ALGO (the claim's, not the method's): what one format-valid step did, from its trajectory
    line: opened an app not yet opened in its episode, the same app again, a window that is no app
    (a dialog), no window but a changed screen (a menu, a focus, a scroll: the image immediate term
    above CHANGED), or nothing visible."""
    opened = line.get("opened") or []
    apps = [x for x in opened if x != "other"]
    if any(x not in seen for x in apps):
        return "new app"
    if apps:
        return "same app"
    if opened:
        return "other window"
    return "menu or change" if (line.get("rewards") or {}).get("image_immediate", 0) > CHANGED else "nothing"


def paid(run: str) -> dict:
    """For the first and the last quarter of training: per kind of step, how many steps and the
    mean of each reward term (and the total) they were paid."""
    its = trajectory_steps(run)
    q = max(1, len(its) // 4)
    out = {}
    for part, chunk in (("first", its[:q]), ("last", its[-q:])):
        rows = {k: [] for k in STEP_KINDS}
        for lines in chunk:
            seen_by = {}
            for line in sorted(lines, key=lambda x: (x["episode"], x["step"])):
                seen = seen_by.setdefault(line["episode"], set())
                if not line.get("valid"):
                    continue
                kind = step_kind(line, seen)
                seen.update(x for x in line.get("opened") or [] if x != "other")
                rows[kind].append({"total": line["reward"], **line["rewards"]})
        out[part] = {k: {"n": len(v), **({t: float(np.mean([r[t] for r in v])) for t in v[0]} if v else {})}
                     for k, v in rows.items()}
    return out


def paid_table(p: dict) -> list[str]:
    terms = [t for t in next((v for v in p["last"].values() if v["n"]), {"n": 0}) if t not in ("n", "format")]
    rows = [f"    {'':7s} {'kind':15s} {'steps':>6s} " + " ".join(f"{t[:14]:>14s}" for t in terms)]
    for part in ("first", "last"):
        for kind in STEP_KINDS:
            v = p[part][kind]
            rows.append(f"    {part:7s} {kind:15s} {v['n']:6d} " + " ".join(
                f"{v[t]:14.3f}" if t in v else f"{'-':>14s}" for t in terms))
    return rows


def curves(run: str) -> dict:
    """Each reward term's and the world model's loss's first- and last-quarter means (metrics.jsonl),
    with a one-sided test of last > first over the iterations of the two quarters, and the raw
    reward's std across the buffer per iteration (from the trajectories: before any normalisation)."""
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        ms = [json.loads(x) for x in fh if x.strip()]
    q = max(1, len(ms) // 4)
    out = {}
    keys = [k for k in ms[0] if k.startswith("reward/") and k != "reward/total"
            and any(m.get(k) for m in ms)]  # a term that is off is logged as 0 throughout: left out
    for k in ["reward/total"] + keys + ["wm/loss"]:
        first = [m[k] for m in ms[:q] if m.get(k) is not None]
        last = [m[k] for m in ms[-q:] if m.get(k) is not None]
        if first and last:
            out[k] = C.episodes_test(k, last, first)
    stds = [float(np.std([x["reward"] for x in lines])) for lines in trajectory_steps(run) if lines]
    return {"tests": out, "reward_std": stds}


# ------------------------------------------------------------------------------------------------
# The claims


def diversity(a) -> dict:
    """A. A trained agent opens more apps an episode than its warm start and than random actions
    (each p < 0.05, in every seed), and no one app takes more than half of the app windows it opens;
    coverage (apps opened at least once in the eval) is reported against its goal of 4 of 7.
    Two rows, each trained from the seed's warm start: `rewards` (the recipe; its run is `rl`, which
    B, C and D read) and, when it differs, `paper_rewards` (the paper's exact reward, `rl_paper`),
    each with its own verdict; the claim's is the recipe's."""
    s = C.settings(DEFAULTS, a, SMOKE)
    rows = [("rl", s["rewards"])] + ([("rl_paper", s["paper_rewards"])]
                                     if s["paper_rewards"] and s["paper_rewards"] != s["rewards"] else [])
    per_seed = []
    for seed in a.seed_list:
        start = seed_start(seed, s, a.out)
        for name, rewards in rows:
            per_seed.append(diversity_row(seed, {**s, "rewards": rewards}, start, name, a.out))
    lines = {name: row_numbers([r for r in per_seed if r["row"] == name]) for name, _ in rows}
    ok = {name: all(r["ok"] for r in per_seed if r["row"] == name) for name, _ in rows}
    if len(rows) > 1:
        print(f"\nthe paper's exact reward ({s['paper_rewards']}): {lines['rl_paper']} : "
              f"{'pass' if ok['rl_paper'] else 'FAIL'}")
    numbers = lines["rl"] + (f"; the paper's exact reward: {'pass' if ok['rl_paper'] else 'FAIL'}" if len(rows) > 1 else "")
    return {"numbers": numbers, "pass": ok["rl"], "settings": s, "rows": dict(rows), "row_pass": ok,
            "per_seed": [r for r in per_seed if r["row"] == "rl"], "paper_row": [r for r in per_seed if r["row"] != "rl"]}


def diversity_row(seed: int, s: dict, start: dict, name: str, out: str) -> dict:
    """One row of A on one seed: train from the seed's warm start with s["rewards"] into <seed>/<name>,
    evaluate its last model (into after/, or after_paper/ for the paper's row), test, print."""
    arm = train_arm(seed, s, start, name, [], out)
    after = evaluate(os.path.join(arm["run"], "models", "E1"), seed, s, start, name.replace("rl", "after"), out)
    m = {"random": apps_of(start["before"], "random"), "warm": apps_of(start["before"]), "rl": apps_of(after)}
    tests = [C.episodes_test("apps/ep RL > warm", m["rl"]["apps"], m["warm"]["apps"], seed),
             C.episodes_test("apps/ep RL > random", m["rl"]["apps"], m["random"]["apps"], seed),
             C.episodes_test("screens/ep RL > warm", m["rl"]["screens"], m["warm"]["screens"], seed)]
    spread = m["rl"]["top_share"] is not None and m["rl"]["top_share"] <= 0.5
    seed_ok = tests[0].ok and tests[1].ok and spread
    print(f"\nseed {seed}, --rewards {s['rewards']} ({'pass' if seed_ok else 'FAIL'}):")
    for who in ("random", "warm", "rl"):
        print(app_row(who, m[who]))
    for t in tests:
        print("  " + t.line())
    share = "-" if m["rl"]["top_share"] is None else f"{m['rl']['top_share']:.2f}"
    print(f"  most-opened app {m['rl']['top']}: {share} of the app windows (goal <= 0.50); "
          f"coverage {m['rl']['coverage']}/7 (goal >= 4)")
    p = paid(arm["run"])
    print("  what each term paid, per kind of step (first / last quarter of training):")
    print("\n".join(paid_table(p)))
    cv = curves(arm["run"])
    return {"seed": seed, "row": name, "rewards": s["rewards"], "apps": m, "tests": [vars(t) for t in tests],
            "spread": spread, "ok": seed_ok, "paid": p, "curves": {k: vars(t) for k, t in cv["tests"].items()},
            "reward_std": cv["reward_std"], "run": arm["run"], "train_seconds": arm["seconds"]}


def row_numbers(per_seed: list[dict]) -> str:
    """A row's numbers for the last line: the worst seed's apps/ep, the largest p, top share, coverage."""
    worst = min(per_seed, key=lambda r: r["tests"][0]["diff"])
    return (f"apps/ep {np.mean(worst['apps']['warm']['apps']):.2f} -> "
            f"{np.mean(worst['apps']['rl']['apps']):.2f} (random {np.mean(worst['apps']['random']['apps']):.2f}), "
            f"p {max(max(r['tests'][0]['p'], r['tests'][1]['p']) for r in per_seed):.4f}, top share "
            f"{top_share(per_seed)}, coverage {min(r['apps']['rl']['coverage'] for r in per_seed)}/7, "
            f"seeds {len(per_seed)}")


def top_share(per_seed: list[dict]) -> str:
    """The largest share of one app among the app windows any seed's trained policy opened ("-":
    no seed opened an app)."""
    shares = [r["apps"]["rl"]["top_share"] for r in per_seed if r["apps"]["rl"]["top_share"] is not None]
    return f"{max(shares):.2f}" if shares else "-"


def curiosity(a) -> dict:
    """B. The same seeds and warm starts, two arms: the paper's reward (A's trained run) against it
    without the world model's terms (`,no_world_model`, trained here from A's warm start for as many
    iterations). With curiosity, after training: more distinct apps an episode (and distinct
    screens, reported), and in the first quarter of training a larger std of the raw rewards across
    the buffer (per iteration; before any normalisation): curiosity is what gives a GRPO group
    something to compare at the cold start. Every seed must pass both."""
    s = C.settings(DEFAULTS, a, SMOKE)
    src, runs = diversity_runs(a, s)
    per_seed, ok = [], True
    for seed in a.seed_list:
        d = runs[seed]
        start = fresh_start(a.out, seed, d["warm"])
        without = train_arm(seed, {**s, "rewards": s["rewards"] + ",no_world_model"}, start, "no_curiosity", [], a.out)
        res = {"curiosity": {"run": d["rl"], "eval": apps_of(d["after"])},
               "no_curiosity": {"run": without["run"], "eval": apps_of(evaluate(
                   os.path.join(without["run"], "models", "E1"), seed, s, start, "after_no_curiosity", a.out))}}
        for r in res.values():
            r["curves"] = curves(r["run"])
        w, wo = res["curiosity"], res["no_curiosity"]
        q = max(1, len(w["curves"]["reward_std"]) // 4)
        tests = [C.episodes_test("apps/ep with > without", w["eval"]["apps"], wo["eval"]["apps"], seed),
                 C.episodes_test("reward std, first quarter, with > without", w["curves"]["reward_std"][:q],
                                 wo["curves"]["reward_std"][:q], seed),
                 C.episodes_test("screens/ep with > without", w["eval"]["screens"], wo["eval"]["screens"], seed)]
        seed_ok = tests[0].ok and tests[1].ok
        ok &= seed_ok
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}), with curiosity: {d['rl']}")
        print(app_row("warm", apps_of(d["before"])))
        for arm in res:
            print(app_row(arm[:8], res[arm]["eval"]))
        for t in tests:
            print("  " + t.line())
        for arm in res:
            print(f"  {arm}, first -> last quarter: " + ", ".join(
                f"{k.split('/')[-1]} {t.before:.3f}->{t.after:.3f}" for k, t in res[arm]["curves"]["tests"].items()))
        per_seed.append({"seed": seed, "tests": [vars(t) for t in tests], "ok": seed_ok,
                         **{arm: {"eval": r["eval"], "reward_std": r["curves"]["reward_std"], "run": r["run"],
                                  "curves": {k: vars(t) for k, t in r["curves"]["tests"].items()}}
                            for arm, r in res.items()}})
    numbers = "; ".join(f"seed {r['seed']}: " + ", ".join(
        f"{t['name'].split(',')[0].split(' with')[0]} {t['diff']:+.3f} p {t['p']:.3f}" for t in r["tests"])
        for r in per_seed)
    return {"numbers": numbers, "pass": ok, "settings": s, "source": src, "per_seed": per_seed}


def distillation(a) -> dict:
    """C. Experience-stream distillation: generation 2 starts from the BASE model (the seed's warm
    start) fine-tuned on generation 1's best steps (models/E2_sft). A's run is generation 1: a copy
    of it is resumed with `--generations 2` (the boundary runs the SFT, then as many iterations
    again). Generation 2's start explores more than generation 1's start did: more distinct apps an
    episode than the warm start (p < 0.05, every seed). Where generation 2 ends (models/E2) is
    reported beside generation 1's end (models/E1, A's eval)."""
    s = C.settings(DEFAULTS, a, SMOKE)
    src, runs = diversity_runs(a, s)
    per_seed, ok = [], True
    for seed in a.seed_list:
        d = runs[seed]
        start = fresh_start(a.out, seed, d["warm"])
        run = os.path.join(start["root"], "rl")
        shutil.copytree(d["rl"], run)
        ipg = s["iterations"]
        seconds = LE.trainer(["--resume", run, "--generations", 2, "--iterations-per-generation", ipg,
                              "--iterations", ipg], start["log"])
        print(f"seed {seed}: generation 2 in {seconds / 60:.1f} min", flush=True)
        ev, warm = {"E1": apps_of(d["after"])}, apps_of(d["before"])
        for name in ("E2_sft", "E2"):
            model = os.path.join(run, "models", name)
            if os.path.isdir(model):
                ev[name] = apps_of(evaluate(model, seed, s, start, f"after_{name}", a.out))
            else:  # no format-valid step to distil: generation 2 started from the base model itself
                print(f"seed {seed}: no {name} (generation 1 kept no step): its start is the warm start", flush=True)
                ev[name] = warm
        tests = [C.episodes_test("apps/ep E2 start > E1 start", ev["E2_sft"]["apps"], warm["apps"], seed),
                 C.episodes_test("apps/ep E2 end > E1 end", ev["E2"]["apps"], ev["E1"]["apps"], seed)]
        seed_ok = tests[0].ok
        ok &= seed_ok
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}), generation 1: {d['rl']}")
        for name, m in (("E1 start", warm), ("E1 end", ev["E1"]), ("E2 start", ev["E2_sft"]), ("E2 end", ev["E2"])):
            print(app_row(name, m))
        for t in tests:
            print("  " + t.line())
        per_seed.append({"seed": seed, "tests": [vars(t) for t in tests], "ok": seed_ok, "evals": ev, "warm": warm,
                         "run": run})
    numbers = "; ".join(f"seed {r['seed']}: E2 start - E1 start {r['tests'][0]['diff']:+.2f} apps/ep "
                        f"p {r['tests'][0]['p']:.3f}, E2 end - E1 end {r['tests'][1]['diff']:+.2f}" for r in per_seed)
    return {"numbers": numbers, "pass": ok, "settings": s, "source": src, "per_seed": per_seed}


def reward_curves(a) -> dict:
    """D. During training the reward terms rise and the world model's loss stays high (it keeps
    meeting new states). Read from explore-diversity's runs (--set source=DIR; default: its last
    output, runs/claims/explore-diversity), or run them first if there are none. Per term: the
    first- and last-quarter means and a one-sided test of last > first over those iterations; the
    world model's loss "stays high" when its last quarter keeps at least half its first quarter.
    Pass: the total reward rises (p < 0.05) in every seed; each term is reported, risen or not."""
    s = C.settings(DEFAULTS, a, SMOKE)
    src, div = diversity_runs(a, s)
    per_seed, ok = [], True
    for seed, run in ((seed, d["rl"]) for seed, d in div.items()):
        cv = curves(run)
        total = cv["tests"]["reward/total"]
        wm = cv["tests"].get("wm/loss")
        high = wm is not None and wm.after >= 0.5 * wm.before
        ok &= total.ok
        print(f"\nseed {seed} ({'pass' if total.ok else 'FAIL'}), {run}:")
        for k, t in cv["tests"].items():
            print(f"  {k:28s} first {t.before:8.4f}  last {t.after:8.4f}  {'rises' if t.ok else 'does not rise':14s} "
                  f"(diff {t.diff:+.4f} [{t.lo:+.4f}, {t.hi:+.4f}], p {t.p:.4f})")
        print(f"  world model loss stays high (last >= half of first): {high}")
        per_seed.append({"seed": seed, "run": run, "ok": total.ok, "wm_high": high,
                         "tests": {k: vars(t) for k, t in cv["tests"].items()}})
    png = os.path.join(a.out, "explore_curves.png")
    curves_png([r["run"] for r in per_seed], png, [f"seed {r['seed']}" for r in per_seed])
    print(f"curves: {png}")
    rises = sorted({k.replace("reward/", "").replace("wm/loss", "wm loss") for r in per_seed
                    for k, t in r["tests"].items() if t["p"] < 0.05 and t["diff"] > 0})
    numbers = (f"total reward rises in {sum(r['ok'] for r in per_seed)}/{len(per_seed)} seeds; rising terms "
               f"(any seed): {', '.join(rises) or 'none'}; wm loss stays high in "
               f"{sum(r['wm_high'] for r in per_seed)}/{len(per_seed)}")
    return {"numbers": numbers, "pass": ok, "source": src, "per_seed": per_seed, "png": png}


def curves_png(runs: list[str], path: str, labels: list[str] | None = None, smooth: int = 5) -> None:
    """One panel per reward term that moved (and the world model's loss), one line per seed
    (`labels`, in the first panel): moving means over `smooth` iterations. PIL only (no matplotlib here)."""
    from PIL import Image, ImageDraw
    series = []
    for run in runs:
        with open(os.path.join(run, "metrics.jsonl")) as fh:
            series.append([json.loads(x) for x in fh if x.strip()])
    keys = [k for k in series[0][0] if (k.startswith("reward/") or k == "wm/loss")
            and any(m.get(k) not in (None, 0) for ms in series for m in ms)] or ["reward/total"]
    cols, W, H = 3, 300, 170
    img = Image.new("RGB", (cols * W, ((len(keys) + cols - 1) // cols) * H), "white")
    d = ImageDraw.Draw(img)
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    for j, c in enumerate(colours[:len(series)]):  # which line is which seed, in the first panel
        d.text((W - 70, 4 + 12 * j), (labels or [f"run {i + 1}" for i in range(len(runs))])[j], fill=c)
    for n, k in enumerate(keys):
        x0, y0 = (n % cols) * W, (n // cols) * H
        vals = [v for ms in series for m in ms if (v := m.get(k)) is not None] or [0.0]
        lo, hi = min(vals), max(vals)
        hi = hi if hi > lo else lo + 1
        d.rectangle([x0 + 40, y0 + 20, x0 + W - 10, y0 + H - 20], outline=(200, 200, 200))
        d.text((x0 + 40, y0 + 4), k, fill="black")
        d.text((x0 + 2, y0 + 18), f"{hi:.3g}", fill="black")
        d.text((x0 + 2, y0 + H - 30), f"{lo:.3g}", fill="black")
        for c, ms in zip(colours * 4, series):
            ys = [m.get(k) for m in ms]
            pts = []
            for i in range(len(ys)):
                win = [y for y in ys[max(0, i - smooth + 1):i + 1] if y is not None]
                if win:
                    px = x0 + 40 + (W - 50) * i / max(1, len(ys) - 1)
                    py = y0 + H - 20 - (H - 40) * (float(np.mean(win)) - lo) / (hi - lo)
                    pts.append((px, py))
            if len(pts) > 1:
                d.line(pts, fill=c, width=2)
    img.save(path)


CLAIMS = {
    "explore-diversity": C.Claim(diversity, "A trained explorer opens more apps an episode than its base model "
                                 "and than random actions, and no one app dominates (paper: 'diverse exploration').",
                                 "per seed over eval episodes (permutation, every seed); the top app's share <= 0.5"),
    "explore-curiosity": C.Claim(curiosity, "Without the world model's curiosity the agent does not learn to "
                                 "interact; curiosity raises the reward variance a GRPO group sees at the start.",
                                 "per seed over eval episodes and first-quarter iterations (permutation, every seed)"),
    "explore-distillation": C.Claim(distillation, "Each generation, fine-tuned from the base on earlier generations' "
                                    "best steps, starts exploring better than the one before.",
                                    "per seed over eval episodes: E2's start vs E1's start (permutation, every seed)"),
    "explore-curves": C.Claim(reward_curves, "During training the reward terms rise and the world model's loss "
                              "stays high.", "per seed over iterations: last quarter vs first (permutation)"),
}
