"""ARPO's claims (arXiv 2505.16282), run by bench/claims.py:

    python bench/claims.py arpo-sequence    # two steps on two screens: the second follows the first
    python bench/claims.py arpo-replay      # the replay buffer against --no-replay, on two-step tasks
    python bench/claims.py arpo-selection   # --select-tasks 16 against every task, on a mixed task list
    python bench/claims.py arpo-generalisation  # trained tasks against reworded and other-app tasks
    python bench/claims.py arpo-self-correction # a wrong app opened first: closed again, and the task done

Each plays the tiny Qwen2.5-VL on real local desktops from bench/learning.py's warm starts (the
format and a uniform prior over the desktop's icons, no task knowledge) with bench/learning.py's
recipes (`resolve` gives each method's defaults; its docstring says why each). An arm is that
recipe with one flag changed, trained from the SAME warm start for the SAME number of iterations
(bench/learning.py `seed_start`, `train_arm`). Settings: --set KEY=VALUE on any of bench/learning.py's
options (iterations, eval_episodes, vms, ...).

Statistics: per seed (every seed must pass), because a seed costs 20-40 minutes here and a
sign-flip test over seeds needs 5 of them for p < 0.05: success counts by Fisher's exact test,
per-iteration or per-group numbers by a permutation test (bench/claims.py), each with its effect
size and 90% interval.
"""
from __future__ import annotations

import os

import numpy as np

import claims as C
import learning as L

SMOKE = dict(iterations=2, eval_episodes=1, warm_epochs=1, vms=2, group_size=2, select_tasks=0)


def bench_args(a, method: str, extra: dict | None = None):
    """bench/learning.py's namespace for `method` (its defaults resolved), then --smoke's budget
    (with `extra`, the claim's own smoke settings) and --set; runs under the claim's output folder."""
    la = L.resolve(L.parse_args(["--method", method, "--out", a.out]))
    s = C.settings({k: v for k, v in vars(la).items() if k not in ("method", "out")}, a, {**SMOKE, **(extra or {})})
    for k, v in s.items():
        setattr(la, k, v)
    return la


# ------------------------------------------------------------------------------------------------


def sequence(a) -> dict:
    """On the two-step bench (bench/learning.py --method arpo-multi: open the file manager, then the
    folder the task names), per task and seed: how often the second step is right when the first
    was (P(second | first)) before and after training, and no task ending below its start. Pass:
    the bench's own rule (gain >= 0.25, p < 0.01, parse >= 0.85, in every seed) and no task of any
    seed below its start. Goal, reported: P(second | first) >= 0.8 for every task in every seed."""
    la = bench_args(a, "arpo-multi")
    rs, rows, below, goal = [], [], [], True
    for seed in a.seed_list:
        r = L.run_seed(la, seed)
        rs.append(r)
        for t in r["selected"]:
            b, af = r["steps_before"]["per_task"][t], r["steps_after"]["per_task"][t]
            lower = r["per_task_after"][t] < r["per_task_before"][t]
            below += [f"seed {seed} {t}"] if lower else []
            goal &= af["second"] >= 0.8
            rows.append(f"  seed {seed} {t:24s} first {b['first']:.2f}->{af['first']:.2f}  second|first "
                        f"{b['second']:.2f}->{af['second']:.2f} ({af['n_second']}/{af['n_first']})  success "
                        f"{r['per_task_before'][t]:.2f}->{r['per_task_after'][t]:.2f}{'  BELOW ITS START' if lower else ''}")
    print(L.table(rs))
    print("\nPer task (eval, T=1):\n" + "\n".join(rows))
    line, ok = L.verdict(rs, max_seconds=float("inf"))  # fixed iterations: no minutes rule here
    ok = ok and not below
    worst = min((r["steps_after"]["per_task"][t]["second"], t, r["seed"]) for r in rs for t in r["selected"])
    numbers = (f"gain {line['gain']:+.2f} p {line['p']:.4f} parse {line['parse']:.2f}, tasks below their start "
               f"{len(below)}, lowest P(second|first) {worst[0]:.2f} (seed {worst[2]} {worst[1]}; goal 0.80 "
               f"{'met' if goal else 'not met'})")
    return {"numbers": numbers, "pass": ok, "per_seed": rs, "below": below, "goal_met": goal}


def replay(a) -> dict:
    """ARPO's replay buffer (a stored success replaces a member of a group that failed alike)
    against --no-replay, on the two-step tasks, where fresh groups often fail alike early on. Per
    seed, from the same warm start for the same iterations: success after training (Fisher, replay >
    no replay) and the mean reward of fresh rollouts over training (replayed members excluded; a
    permutation test over iterations) both higher with replay. The paper: replay overtakes after
    about 30 steps and ends higher (0.75 against 0.65). Every seed must pass."""
    la = bench_args(a, "arpo-multi")
    iterations = la.iterations
    per_seed, ok, curves = [], True, []
    for seed in a.seed_list:
        r = L.seed_start(la, seed)
        arms = {name: L.train_arm(la, seed, r, iterations, extra, name)
                for name, extra in (("replay", []), ("no_replay", ["--no-replay"]))}
        fresh = {name: fresh_rewards(t["run"]) for name, t in arms.items()}
        on, off = arms["replay"], arms["no_replay"]
        tests = [C.rate_test("success after, replay > no replay", on["k_after"], on["n_after"], off["k_after"],
                             off["n_after"]),
                 C.episodes_test("fresh reward over training, replay > no replay", fresh["replay"], fresh["no_replay"],
                                 seed)]
        seed_ok = all(t.ok for t in tests)
        ok &= seed_ok
        cross = overtakes(fresh["replay"], fresh["no_replay"])
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}): warm start success {on['before']:.2f}")
        for name, t in arms.items():
            print(f"  {name:10s} after {t['after']:.2f} ({t['k_after']}/{t['n_after']})  fresh reward first/last "
                  f"quarter {C.quarters(fresh[name])[0]:+.3f}/{C.quarters(fresh[name])[1]:+.3f}  parse {t['parse']:.2f}")
        for t in tests:
            print("  " + t.line())
        print(f"  replay's moving mean stays above no-replay's from iteration {cross}")
        per_seed.append({"seed": seed, "ok": seed_ok, "tests": [vars(t) for t in tests], "overtakes": cross,
                         "arms": {n: {k: v for k, v in t.items() if k != "curve"} for n, t in arms.items()},
                         "fresh": fresh})
        curves.append((seed, fresh))
    png = os.path.join(a.out, "replay_curves.png")
    curves_png(curves, png)
    print(f"curves: {png}")
    numbers = "; ".join(f"seed {r['seed']}: success {r['tests'][0]['after']:.2f} vs {r['tests'][0]['before']:.2f} "
                        f"p {r['tests'][0]['p']:.3f}, fresh reward {r['tests'][1]['diff']:+.3f} p {r['tests'][1]['p']:.3f}"
                        for r in per_seed)
    return {"numbers": numbers, "pass": ok, "per_seed": per_seed, "png": png}


def selection(a) -> dict:
    """ARPO's task selection on a task list that mixes the one-step bench's learnable tasks with
    tasks its warm start never solves in one step (they need typing or several screens): --select-tasks
    16 against training on every task, the same warm start and iterations. Compared on the tasks
    both arms train (those selection kept): the share of groups that are not flat, the reward std
    inside groups (a permutation test over those groups, selection > all), and the iterations until
    their fresh success first reaches 0.5 (a 10-iteration moving mean; fixed in advance), reported.
    Pass: both group measures higher with selection, in every seed."""
    la = bench_args(a, "arpo", {"select_tasks": 2})
    la.task_ids = la.task_ids or L.TASK_IDS + ",files-rename,terminal-count-lines,editor-replace-name"
    per_seed, ok = [], True
    for seed in a.seed_list:
        r = L.seed_start(la, seed)
        k = la.select_tasks
        la.select_tasks = 0
        every = L.train_arm(la, seed, r, la.iterations, [], "all_tasks")
        la.select_tasks = k
        try:
            sel = L.train_arm(la, seed, r, la.iterations, [], "selected")
        except SystemExit:
            kept = kept_tasks(os.path.join(r["out"], "selected"))
            if kept != []:  # a failure of another kind
                raise
            print(f"\nseed {seed} (FAIL): selection kept no task: the warm start solved none in {k} tries")
            per_seed.append({"seed": seed, "ok": False, "kept": [], "tests": [], "reach": {}})
            ok = False
            continue
        kept = set(sel["selected"])
        g_sel, g_all = groups_of(sel["run"], kept), groups_of(every["run"], kept)
        tests = [C.episodes_test("non-flat groups, selection > all", [float(g["std"] > 0) for g in g_sel],
                                 [float(g["std"] > 0) for g in g_all], seed),
                 C.episodes_test("reward std inside groups, selection > all", [g["std"] for g in g_sel],
                                 [g["std"] for g in g_all], seed)]
        seed_ok = all(t.ok for t in tests)
        ok &= seed_ok
        reach = {name: first_reach(arm["run"], kept) for name, arm in (("selected", sel), ("all_tasks", every))}
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}): selection kept {sorted(kept)} of {la.task_ids}")
        for t in tests:
            print("  " + t.line())
        print(f"  iterations until fresh success on the kept tasks first reaches 0.5: selection {reach['selected']}, "
              f"all tasks {reach['all_tasks']}")
        per_seed.append({"seed": seed, "ok": seed_ok, "kept": sorted(kept), "tests": [vars(t) for t in tests],
                         "reach": reach})
    numbers = "; ".join(f"seed {r['seed']}: non-flat {r['tests'][0]['diff']:+.2f} p {r['tests'][0]['p']:.3f}, "
                        f"std {r['tests'][1]['diff']:+.3f} p {r['tests'][1]['p']:.3f}, 0.5 reached at "
                        f"{r['reach']['selected']} vs {r['reach']['all_tasks']}" if r["tests"] else
                        f"seed {r['seed']}: no task kept" for r in per_seed)
    return {"numbers": numbers, "pass": ok, "per_seed": per_seed}


def generalisation(a) -> dict:
    """In-domain against out-of-domain: train the one-step recipe on two tasks (calc-open,
    terminal-open; no task selection, so both are trained), then evaluate the warm start and the
    trained policy on them (in-domain) and on tasks never trained on: the same apps in other words
    (calc-start, terminal-start) and other apps (clock-open, editor-open). Pass: the in-domain gain
    is above 0 (Fisher, p < 0.05) in every seed; the two out-of-domain gains are reported beside it
    with their 90% intervals, as the paper reports them (its in-domain 43.8% -> 81.25%; unseen
    tasks "only a little")."""
    la = bench_args(a, "arpo", {"select_tasks": 0})
    la.task_ids = la.task_ids or "calc-open,terminal-open"
    la.select_tasks = 0
    groups = {"in-domain": la.task_ids.split(","), "reworded": ["calc-start", "terminal-start"],
              "other apps": ["clock-open", "editor-open"]}
    unseen = groups["reworded"] + groups["other apps"]
    per_seed, ok = [], True
    for seed in a.seed_list:
        r = L.seed_start(la, seed)
        t = L.train_arm(la, seed, r, la.iterations, [], "train")
        before_ood = eval_on(la, r, r["warm_path"], unseen, 1000 + seed, "eval_before_unseen.json", model=True)
        after_ood = eval_on(la, r, t["run"], unseen, 2000 + seed, "eval_after_unseen.json", model=False)
        b_all, a_all = {**per_task(r["before_json"]), **before_ood}, {**per_task(t["after_json"]), **after_ood}
        tests = []
        for name, ids in groups.items():
            kb, nb = sum(b_all[i][0] for i in ids), sum(b_all[i][1] for i in ids)
            ka, na = sum(a_all[i][0] for i in ids), sum(a_all[i][1] for i in ids)
            tests.append(C.rate_test(f"{name} success after > before", ka, na, kb, nb))
        seed_ok = tests[0].ok
        ok &= seed_ok
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}): trained on {groups['in-domain']}")
        for tid in [i for ids in groups.values() for i in ids]:
            print(f"  {tid:16s} {b_all[tid][0] / max(1, b_all[tid][1]):.2f} -> {a_all[tid][0] / max(1, a_all[tid][1]):.2f}")
        for x in tests:
            print("  " + x.line())
        per_seed.append({"seed": seed, "ok": seed_ok, "tests": [vars(x) for x in tests], "before": b_all,
                         "after": a_all, "parse": t["parse"], "run": t["run"]})
    numbers = "; ".join(f"seed {r['seed']}: " + ", ".join(f"{x['name'].split(' success')[0]} {x['diff']:+.2f} "
                                                           f"[{x['lo']:+.2f}, {x['hi']:+.2f}] p {x['p']:.3f}"
                                                           for x in r["tests"]) for r in per_seed)
    return {"numbers": numbers, "pass": ok, "per_seed": per_seed}


# The desktop icons that open an app each self-correction task accepts (a first step on another is
# wrong). XCalc's window is titled "Calculator" too, so calc-alone's check passes on it.
APP_ICON = {"calc-alone": ("Calculator", "XCalc"), "terminal-alone": ("Terminal",)}


def self_correction(a) -> dict:
    """Self-correction (the paper: after a wrong step the agent notices it on the next screenshot,
    undoes it and still succeeds). Tasks an agent can spoil and repair: open one app and leave no
    other window open (calc-alone, terminal-alone): a wrong app opened on the way fails the task
    unless it is closed again (alt+f4) before the episode ends. Episodes of up to 4 steps on
    arpo-multi's recipe (bench/learning.py --method arpo-repair), from a warm start whose uniform
    prior includes the close key and finishing. Trained on the clean starts only. Before and after
    training: the success from a spoiled start (the same tasks with a wrong app opened by the
    setup, calc-alone-spoiled and terminal-alone-spoiled, never trained on), and on the clean starts
    the success of the episodes whose first step opened a wrong app. Pass: the spoiled-start success
    rises (Fisher, p < 0.05) in every seed; the other is reported beside it, and one repaired episode
    of the eval after training is shown step by step with its screenshots' paths."""
    la = bench_args(a, "arpo-repair")
    ids = (la.task_ids or L.REPAIR_TASK_IDS).split(",")
    if set(ids) - set(APP_ICON):
        raise SystemExit(f"arpo-self-correction knows the app icon of {sorted(APP_ICON)} only; add the others to "
                         "APP_ICON (bench/claims_arpo.py) with a <id>-spoiled task each.")
    la.task_ids, spoiled = ",".join(ids), [i + "-spoiled" for i in ids]
    per_seed, ok = [], True
    for seed in a.seed_list:
        r = L.seed_start(la, seed)
        before = eval_on(la, r, r["warm_path"], spoiled, 1000 + seed, "eval_before_spoiled.json", model=True)
        t = L.train_arm(la, seed, r, la.iterations, [], "train")
        after = eval_on(la, r, t["run"], spoiled, 2000 + seed, "eval_after_spoiled.json", model=False, save=True)
        wb, wa = wrong_first(r["before_json"], ids), wrong_first(t["after_json"], ids)
        tests = [C.rate_test("spoiled-start success after > before", *total(after, spoiled), *total(before, spoiled)),
                 C.rate_test("success after a wrong first step, after > before", *wa, *wb)]
        seed_ok = tests[0].ok
        ok &= seed_ok
        print(f"\nseed {seed} ({'pass' if seed_ok else 'FAIL'}): trained on {ids}, parse {t['parse']:.2f}")
        for tid in ids:
            sp = tid + "-spoiled"
            print(f"  {tid:16s} clean start {share(per_task(r['before_json']), tid)} -> "
                  f"{share(per_task(t['after_json']), tid)}   spoiled start {share(before, sp)} -> {share(after, sp)}")
        print(f"  episodes whose first step opened a wrong app: {wb[1]} before ({wb[0]} succeeded), "
              f"{wa[1]} after ({wa[0]} succeeded)")
        for x in tests:
            print("  " + x.line())
        shown = repaired(os.path.join(r["out"], "eval_after_spoiled.json"), la.eval_episodes)
        print("\n".join("  " + line for line in shown))
        per_seed.append({"seed": seed, "ok": seed_ok, "tests": [vars(x) for x in tests], "before_spoiled": before,
                         "after_spoiled": after, "wrong_first": {"before": wb, "after": wa}, "run": t["run"],
                         "parse": t["parse"], "repaired": shown})
    numbers = "; ".join(f"seed {r['seed']}: spoiled start {r['tests'][0]['before']:.2f} -> {r['tests'][0]['after']:.2f} "
                        f"p {r['tests'][0]['p']:.3f}, after a wrong first step {r['tests'][1]['before']:.2f} -> "
                        f"{r['tests'][1]['after']:.2f}" for r in per_seed)
    return {"numbers": numbers, "pass": ok, "per_seed": per_seed}


def wrong_first(path: str, task_ids: list[str]) -> tuple[int, int]:
    """Of an --eval-only JSON's episodes of `task_ids`: (successes, episodes) among those whose
    first action double-clicked the desktop icon of an app the task does not accept (APP_ICON)."""
    import json
    from vm.desktop import desktop_icons
    with open(path) as fh:
        details = [e for e in json.load(fh)["details"] if e["task"] in task_ids]
    wrong = [e for e in details if e["actions"] and any(L.on_icon(e["actions"][0], label)
                                                         for label in desktop_icons() if label not in APP_ICON[e["task"]])]
    return sum(e["score_hard"] > L.SUCCESS for e in wrong), len(wrong)


def total(counts: dict, task_ids: list[str]) -> tuple[int, int]:
    """(successes, episodes) over `task_ids` of a per_task() dict (a task with no episode counts 0/0)."""
    return tuple(sum(counts.get(i, (0, 0))[j] for i in task_ids) for j in (0, 1))


def share(counts: dict, tid: str) -> str:
    """"k/n": task `tid`'s successes and episodes in a per_task() dict."""
    k, n = counts.get(tid, (0, 0))
    return f"{k}/{n}"


def repaired(path: str, n: int) -> list[str]:
    """Lines showing the first successful episode of a saved eval (eval_on(..., save=True)) whose
    start was spoiled: each step's action and the screenshot it was chosen on."""
    import json
    with open(path) as fh:
        details = json.load(fh)["details"]
    good = [e for e in details if e["score_hard"] > L.SUCCESS]
    if not good:
        return ["no repaired episode: no spoiled start succeeded after training"]
    e = good[0]
    folder = os.path.join(os.path.splitext(path)[0], "trajectories", f"it{e['job'] // n:06d}")
    lines = [f"a repaired episode: {e['task']}, {e['steps']} steps, ended by {e['end']} ({folder}):"]
    vm = f"vm{e['job'] % n:02d}"
    for i, (act, text) in enumerate(zip(e["actions"], e["texts"])):
        lines.append(f"  step {i + 1}: {json.dumps(act)}, seen on {os.path.join(folder, f'{vm}_step{i:02d}.png')}")
        lines.append(f"          its answer: {text!r}")
    return lines


def eval_on(la, r: dict, what: str, task_ids: list[str], sample_seed: int, name: str, model: bool,
            save: bool = False) -> dict:
    """train_arpo.py --eval-only of a model folder (model=True) or a run's last checkpoint on
    `task_ids`, as bench/learning.py evaluates (T = 1, --eval-episodes a task); save: the episodes'
    screenshots and answers too (in <name without .json>/trajectories/). -> per_task()."""
    out = os.path.join(r["out"], name)
    flags = ["--eval-only", *(["--model", what] if model else ["--resume", what]), "--task-ids", ",".join(task_ids),
             *L.common_flags(la), "--eval-episodes", str(la.eval_episodes), "--eval-temperature", "1.0",
             "--sample-seed", str(sample_seed), "--eval-out", out, *(["--save-trajectories"] if save else [])]
    if model:
        flags += ["--runs-dir", r["out"], "--run-name", name.replace(".json", "")]
    rc = L.train_arpo(flags, r["log"])
    if rc != 0:
        raise SystemExit(f"an eval failed (exit {rc}); see {r['log']}.")
    return per_task(out)


def per_task(path: str) -> dict:
    """{task id: (successes, episodes)} of an --eval-only JSON (hard protocol, score > 0.1)."""
    import json
    with open(path) as fh:
        details = json.load(fh)["details"]
    out = {}
    for e in details:
        k, n = out.get(e["task"], (0, 0))
        out[e["task"]] = (k + (e["score_hard"] > L.SUCCESS), n + 1)
    return out


# ------------------------------------------------------------------------------------------------
# Reading a run's metrics.jsonl


def metrics(run: str) -> list[dict]:
    import json
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [json.loads(x) for x in fh if x.strip()]


def kept_tasks(run: str) -> list[str] | None:
    """What --select-tasks kept in this run (selected_tasks.json), or None if it never selected."""
    import json
    path = os.path.join(run, "selected_tasks.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)["selected"]


def fresh_rewards(run: str) -> list[float]:
    """Per iteration, the mean reward of its fresh rollouts (replayed members are not in
    groups[].rewards' fresh part: metrics' reward_mean is over fresh rollouts only)."""
    return [m["reward_mean"] for m in metrics(run) if m.get("reward_mean") is not None]


def groups_of(run: str, tasks: set) -> list[dict]:
    """Every group of the run on `tasks`: its task and the std of its fresh members' rewards (a
    replayed member is left out: what the policy itself spread)."""
    out = []
    for m in metrics(run):
        for g in m.get("groups", []):
            fresh = [r for r, who in zip(g.get("rewards", []), g.get("members", [])) if who == "fresh"]
            if g.get("task") in tasks and len(fresh) > 1:
                out.append({"task": g["task"], "std": float(np.std(fresh))})
    return out


def first_reach(run: str, tasks: set, level: float = 0.5, window: int = 10) -> int | None:
    """The first iteration at which the fresh success on `tasks`, a moving mean over `window`
    iterations, reaches `level` (None: never)."""
    hits = []
    for i, m in enumerate(metrics(run)):
        hits += [[s > L.SUCCESS for g in m.get("groups", []) if g.get("task") in tasks for s in g.get("scores", [])]]
        flat = [x for h in hits[-window:] for x in h]
        if len(hits) >= window and flat and np.mean(flat) >= level:
            return i
    return None


def overtakes(a: list[float], b: list[float], window: int = 10) -> int | None:
    """The first iteration from which a's moving mean (over `window`) stays above b's to the end."""
    ma = [float(np.mean(a[max(0, i - window + 1):i + 1])) for i in range(len(a))]
    mb = [float(np.mean(b[max(0, i - window + 1):i + 1])) for i in range(len(b))]
    n = min(len(ma), len(mb))
    for i in range(n):
        if all(ma[j] > mb[j] for j in range(i, n)):
            return i
    return None


def curves_png(curves: list, path: str, smooth: int = 10) -> None:
    """Fresh reward per iteration of both arms (solid: replay, thin: no replay), one colour a seed."""
    from PIL import Image, ImageDraw
    W, H, Lm, B, T, Rm = 640, 360, 50, 40, 30, 20
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    vals = [v for _, f in curves for arm in f.values() for v in arm] or [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    hi = hi if hi > lo else lo + 1
    n = max((len(arm) for _, f in curves for arm in f.values()), default=2)

    def xy(i, v):
        return Lm + (W - Lm - Rm) * i / max(1, n - 1), H - B - (H - B - T) * (v - lo) / (hi - lo)
    d.text((Lm, 8), "ARPO two-step tasks: fresh reward per iteration, replay (thick) vs --no-replay (thin)", fill="black")
    d.text((8, T), f"{hi:.2f}", fill="black")
    d.text((8, H - B - 10), f"{lo:.2f}", fill="black")
    d.text((Lm, H - 22), f"iteration (0..{n - 1}), moving mean of {smooth}", fill="black")
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    for k, (seed, f) in enumerate(curves):
        c = colours[k % len(colours)]
        for arm, width in (("replay", 3), ("no_replay", 1)):
            ys = f.get(arm, [])
            sm = [float(np.mean(ys[max(0, i - smooth + 1):i + 1])) for i in range(len(ys))]
            if len(sm) > 1:
                d.line([xy(i, v) for i, v in enumerate(sm)], fill=c, width=width)
        d.text((W - Rm - 60, T + 14 * k), f"seed {seed}", fill=c)
    img.save(path)


CLAIMS = {
    "arpo-sequence": C.Claim(sequence, "Multi-turn: on two-step tasks the trained agent's second step follows "
                             "its first (P(second right | first right)), and no task loses what it had.",
                             "the two-step bench's rule per seed (Fisher) + no task below its start"),
    "arpo-replay": C.Claim(replay, "The replay buffer: training overtakes no-replay after about 30 steps and "
                           "the mean trajectory reward ends higher (0.75 against 0.65).",
                           "per seed: success after (Fisher), fresh reward over iterations (permutation)"),
    "arpo-generalisation": C.Claim(generalisation, "RL raises success on the training tasks a lot (43.8% -> "
                                   "81.25%) and on unseen tasks only a little.",
                                   "per seed, Fisher on in-domain success (every seed); out-of-domain reported"),
    "arpo-self-correction": C.Claim(self_correction, "After a wrong step the agent notices it on the next "
                                    "screenshot, undoes it and still succeeds.",
                                    "per seed, Fisher on spoiled-start success (every seed)"),
    "arpo-selection": C.Claim(selection, "Task selection (tasks solved once in 16 tries) gives more non-flat "
                              "groups, a larger reward std inside groups and faster convergence.",
                              "per seed over groups of the kept tasks (permutation), every seed"),
}
