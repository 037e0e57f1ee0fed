"""Benchmark: does it learn? A Qwen2.5-VL trained from scratch on real desktops, before vs after RL.

    python bench/learning.py --method arpo                   # 2 seeds, one step a task
    python bench/learning.py --method arpo --seeds 1 --minutes 8
    python bench/learning.py --method arpo-multi             # 2 seeds, two steps on two screens a task
    python bench/learning.py --method arpo-multi --seeds 2 --first-seed 10   # development seeds
    python bench/learning.py --method arpo-repair            # up to 4 steps: open one app, close a wrong one
    python bench/learning.py --method explore                # ScreenExplorer (bench/learning_explore.py)
    python bench/learning.py --warm-start-only runs/warm     # only the ARPO warm start (the quickstart)

No weights can be downloaded, so the policy is the tiny random Qwen2.5-VL of the real class
(`--model tiny`, screenshots at --max-pixels 12544: 140x84, 15 visual tokens). Per seed, for ARPO:

1. Warm start (learning_warm.py), with NO task knowledge: supervised on real screenshots of the
   desktop, each task prompt answered with `left_double` on each desktop icon exactly once per
   epoch (UI-TARS format), so every prompt starts with the same uniform prior over the 7 icons and
   every answer parses.
   Saved as an ordinary checkpoint folder (`train_arpo.py --model <folder>` loads it).
2. Before: `train_arpo.py --eval-only --model <warm start>` at temperature 1, --eval-episodes per task.
3. Train: `train_arpo.py --model <warm start> --select-tasks K ...` as a subprocess, as a user runs
   it: ARPO's task selection first, then GRPO with replay, lr 5e-4 with a 10% warm-up and a linear
   decay over --iterations (120; fewer if the --minutes budget leaves less, fixed before training).
   The peak lr is what keeps the format: at higher peaks (1e-3, 7e-4) the tokens after a
   coordinate drifted while the lr was high, although success rose. So does the format penalty:
   --format-penalty 1.0 here (train_arpo.py's default is ARPO's 0.5). At 0.5 a broken answer cost
   half what a success earns, and as the policy concentrated on its icons it spliced their
   coordinates (`(8,1,5)`) more and more; at 1.0 it costs as much as a success earns, and the
   parse rate held (docs/log.md has every run).
4. After: the same eval on the selected tasks, of the checkpoint chosen by a rule fixed in advance:
   the run's LAST checkpoint (the policy the run ended with; with the linear decay, the one it
   settled on), not the best of several, which would select on the eval's own noise.
5. Statistics, per seed: successes after vs before (evaluator score > 0.1, hard protocol: with
   one step per episode every episode ends by running out of steps, which the standard protocol
   scores 0 on a feasible task), one-sided Fisher exact test (`fisher_one_sided`, exact
   hypergeometric tail). The same for fresh training rollouts (early window vs late window of
   metrics.jsonl, replayed members excluded). Parse rate: the share of answers that parsed, in
   both evals and in every quarter of training; "throughout" = the lowest of these.

--method arpo-multi: the same five stages on tasks that take two actions on two screens, where
the right second action depends on what the first did: files-open-documents, -downloads,
-pictures ("Open my Downloads folder in the file manager."). The first action is the file
manager's desktop icon for every task (the window it opens is the only one with folders); the
second, a double-click on the task's folder in that window. Episodes of 2 steps with both
screenshots in the prompt (--max-steps 2 --max-images 2), trained with ARPO's trajectory-level
advantage (one reward per episode, on every answer of it), replay on. The warm start
(learning_warm.warm_start_multi) knows no task: per prompt, the first answer is each of the 7
icons equally often, and the second, on the screen that icon opened, each thing that screen
affords equally often (`affordances`: the file manager's 5 items; the desktop icons after any
other app). No task selection: a random episode succeeds 1 time in 35, so 16 rollouts would
drop most tasks; every task is trained and evaluated.
The recipe differs from the one-step bench's in four ways:
- The warm start runs 32 epochs, not 16. The format breaks in the thought's copy of the
  instruction (the tiny tokenizer spells a folder's name by characters: "Open my Dolder"); with 8
  epochs it broke early in RL ("Open my Open my"), with 16 in about one seed in eight, and one
  seed in eight learned too little; with 32 its replica met both conditions in 8 seeds of 8.
- The peak lr is 3e-4, not 5e-4: at 5e-4 the format drifted while the lr was high.
- The lr stays at that peak after the 10% warm-up (--lr-schedule constant, as ARPO's), for up to
  400 iterations (fewer where --minutes 30 a seed leaves less). The second step is learned only
  after the first, and following the instruction there (the same window for every task, a
  different folder each) takes hundreds of updates at the peak lr: with a linear decay over 200
  iterations most of the lr was spent by then, and most seeds settled on "one of the task folders,
  whatever the instruction", which scores just above the bar.
- The format penalty is ARPO's, on the reward (--format-penalty-on reward). Paid on the advantage
  instead (train_arpo.py's other choice), a group that failed alike gives its broken member the
  only gradient there is, -1 on every token of it, most of them the well-formed tokens every
  answer shares; once a seed had settled on one folder for every task, most groups were flat and
  those pushes broke the format, for good. On the reward, the well-formed members of such a group
  gain what the broken one loses, so the shared tokens hold; but before a task's first success
  those gains are all that moves the policy, and in one seed they led it away from the file
  manager's icon for good. Neither way is safe there (docs/log.md, 2026-12-06).
docs/log.md has the runs behind each choice. The table adds per step, before -> after: how often
the first action was right (a double-click on the file manager's icon) and how often the second
was, among the episodes whose first was (the task's folder opened), so it shows what of the second
step was learned.

--method arpo-repair: the setting of the self-correction claim (bench/claims.py
arpo-self-correction), arpo-multi's recipe on tasks that ask for one app and no other window
(calc-alone, terminal-alone), episodes of up to 4 steps with the last 2 screenshots in the prompt.
A wrong app opened on the way fails the task unless the policy closes it again (alt+f4) before it
finishes. Its warm start (learning_warm.warm_start_repair) knows no task: on every screen each
thing the screen affords equally often, the close key and `finished()` included where a window
is open, half its episodes from a spoiled start (a random app already open). The claim also
evaluates on those tasks' spoiled starts (calc-alone-spoiled, ...), never trained on.

Last line, one verdict over all seeds (the worst seed: the smallest gain, the largest p, the lowest parse):
    learning_arpo: before <b> after <a> gain <+g> p <p> parse <r> seeds 2: pass
    (learning_arpo_multi: ... for --method arpo-multi)
Pass = in every seed: gain >= 0.25, p < 0.01, parse >= 0.85, wall time <= --minutes.
Also written: <out>/learning_arpo.png (fresh success per iteration, every seed) and
<out>/learning_arpo.json (every number of the table). `python view.py <out>/seed0/train` shows a run.

Interface for --method explore (bench/learning_explore.py, the ScreenExplorer half):
    import learning_explore; rc = learning_explore.main(args)
    args: this script's argparse.Namespace (method, seeds, minutes, out = runs/learning/explore by
    default, vms, settle, iterations (0 = what --minutes leaves), and the rest below; ignore what
    does not apply). It prints its own table and, last, its line
    `learning_explore: ... seeds N: pass` (or `: FAIL`), and returns 0 on pass, 1 on FAIL.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The project first: bench/ has files named like the project's (qwen_vl.py). learning_explore
# is found in bench/ after it (the script's own folder is on the path when run as a script).
sys.path.insert(0, ROOT)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from claims import fisher_one_sided  # noqa: E402,F401  (the statistics live with the claim runner)
from learning_warm import FM_ICON, MAX_PIXELS, warm_start, warm_start_multi, warm_start_repair  # noqa: E402

TASK_IDS = "calc-open,clock-open,terminal-open,editor-open"
# arpo-multi: two actions on two screens. The first (the file manager's desktop icon) is the same for
# every task; the second (a folder in the window it opened) is the one the task names.
MULTI_TASK_IDS = "files-open-documents,files-open-downloads,files-open-pictures"
SUCCESS = 0.1       # ARPO's success threshold (train_arpo --success-threshold)
MULTI_ITERATIONS = 400  # arpo-multi's default budget (fewer if --minutes leaves less)
# arpo-repair: one app and no other window, up to 4 steps (see the docstring); arpo-multi's recipe.
REPAIR_TASK_IDS = "calc-alone,terminal-alone"
MULTI = ("arpo-multi", "arpo-repair")  # the methods on arpo-multi's recipe
STEPS = {"arpo": 1, "arpo-multi": 2, "arpo-repair": 4}

# ------------------------------------------------------------------------------------------------
# Statistics (pure functions; tests/test_learning.py checks them by hand; fisher_one_sided is
# bench/claims.py's, with the other tests the claims use)


def windows(metrics: list[dict], size: int) -> tuple[list[float], list[float]]:
    """Fresh rollouts' scores (groups[].scores: replayed members are apart) of the first and the
    last `size` iterations."""
    def scores(ms):
        return [s for m in ms for g in m.get("groups", []) for s in g.get("scores", [])]
    size = max(1, min(size, len(metrics) // 2))
    return scores(metrics[:size]), scores(metrics[-size:])


def verdict(seeds: list[dict], min_gain: float = 0.25, max_p: float = 0.01, min_parse: float = 0.85,
            max_seconds: float = 1200.0) -> tuple[dict, bool]:
    """The worst seed's numbers and whether every seed met every target. Each seed: before, after,
    p, parse, seconds."""
    worst = min(seeds, key=lambda s: s["after"] - s["before"])
    line = {"before": worst["before"], "after": worst["after"], "gain": worst["after"] - worst["before"],
            "p": max(s["p"] for s in seeds), "parse": min(s["parse"] for s in seeds)}
    ok = all(s["after"] - s["before"] >= min_gain and s["p"] < max_p and s["parse"] >= min_parse
             and s["seconds"] <= max_seconds for s in seeds)
    return line, ok


def final_line(method: str, line: dict, n_seeds: int, ok: bool) -> str:
    return (f"learning_{method}: before {line['before']:.2f} after {line['after']:.2f} gain {line['gain']:+.2f} "
            f"p {line['p']:.4f} parse {line['parse']:.2f} seeds {n_seeds}: {'pass' if ok else 'FAIL'}")


# ------------------------------------------------------------------------------------------------
# The runs: train_arpo.py as a subprocess, as a user would run it


def common_flags(a) -> list[str]:
    steps = STEPS[a.method]
    return ["--vms", str(a.vms), "--group-size", str(a.group_size), "--max-steps", str(steps),
            "--max-images", str(min(steps, 2)), "--max-new-tokens", str(a.max_new_tokens), "--settle", str(a.settle),
            "--max-pixels", str(MAX_PIXELS), "--temperature", "1.0", "--vm-timeout", "60"]


def train_arpo(flags: list[str], log: str, timeout: float | None = None) -> int:
    """Run train_arpo.py with these flags; its console goes to `log`. Returns the exit code."""
    with open(log, "a") as f:
        f.write("$ python train_arpo.py " + " ".join(flags) + "\n")
        f.flush()
        try:
            return subprocess.run([sys.executable, os.path.join(ROOT, "train_arpo.py"), *flags], cwd=ROOT,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write("(killed: over its time)\n")
            return 124


def eval_numbers(path: str, task_ids: list[str]) -> dict:
    """Successes, episodes, parse rate and per-task success of an --eval-only JSON, on task_ids."""
    with open(path) as f:
        res = json.load(f)
    d = [e for e in res["details"] if e["task"] in task_ids]
    oks = [ok for e in d for ok in e["format_ok"]]
    return {"k": sum(e["score_hard"] > SUCCESS for e in d), "n": len(d), "seconds": res["seconds"],
            "parse": sum(oks) / len(oks) if oks else 0.0,
            "per_task": {t: sum(e["score_hard"] > SUCCESS for e in d if e["task"] == t) /
                         max(1, sum(e["task"] == t for e in d)) for t in task_ids}}


def on_icon(action: dict | None, label: str, screen=(1280, 720)) -> bool:
    """The action is a double-click inside desktop icon `label`'s cell on pcmanfm's desktop grid."""
    from vm.desktop import ICON_PITCH, desktop_icons, ICON_CENTRE
    if not action or action.get("type") != "double_click":
        return False
    cx, cy = desktop_icons(screen)[label]
    left, top = cx - ICON_CENTRE[0], cy - ICON_CENTRE[1]
    return left <= action["x"] < left + ICON_PITCH[0] and top <= action["y"] < top + ICON_PITCH[1]


def first_right(action: dict | None, screen=(1280, 720)) -> bool:
    """Step 1 of arpo-multi was right: a double-click on the file manager's desktop icon."""
    return on_icon(action, FM_ICON, screen)


def step_rates(path: str, task_ids: list[str]) -> dict:
    """Per step of an arpo-multi eval (an --eval-only JSON): how often the first action was right
    (first_right), how often the second was, among episodes whose first was (the task's folder
    opened: the evaluator's score, the first action having opened the file manager), and the
    success rate; with the counts, per task too."""
    with open(path) as f:
        d = [e for e in json.load(f)["details"] if e["task"] in task_ids]

    def rates(es):
        first = [e for e in es if e["actions"] and first_right(e["actions"][0])]
        second = [e for e in first if e["score_hard"] > SUCCESS]
        return {"n": len(es), "first": len(first) / max(1, len(es)), "n_first": len(first),
                "second": len(second) / max(1, len(first)), "n_second": len(second),
                "success": sum(e["score_hard"] > SUCCESS for e in es) / max(1, len(es))}
    return {"all": rates(d), "per_task": {t: rates([e for e in d if e["task"] == t]) for t in task_ids}}


def run_seed(a, seed: int) -> dict:
    """Warm start, before, train, after for one seed; every number of the table. The training's
    iterations come from the --minutes budget left after the eval before (at most --iterations)."""
    t0 = time.perf_counter()
    r = seed_start(a, seed)
    iterations = planned_iterations(a, r, time.perf_counter() - t0)
    print(f"seed {seed}: eval before {r['before_seconds']:.0f}s; training {iterations} iterations", flush=True)
    r.update(train_arm(a, seed, r, iterations, [], "train"))
    r["seconds"] = time.perf_counter() - t0
    return r


def seed_start(a, seed: int) -> dict:
    """The seed's folder (<out>/seed<k>, emptied), its warm start and the warm start's eval on every
    task; every arm of a comparison (bench/claims_arpo.py) starts from these."""
    out = os.path.join(a.out, f"seed{seed}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = os.path.join(out, "console.log")
    task_ids = a.task_ids or {"arpo-multi": MULTI_TASK_IDS, "arpo-repair": REPAIR_TASK_IDS}.get(a.method, TASK_IDS)
    ids = task_ids.split(",")
    r = {"seed": seed, "out": out, "log": log, "task_ids": task_ids}
    warm = r["warm_path"] = os.path.join(out, "warm_start")
    if a.method in MULTI:
        make = warm_start_multi if a.method == "arpo-multi" else warm_start_repair
        r["warm"] = make(warm, seed, ids, a.warm_epochs, a.warm_lr)
        print(f"seed {seed}: warm start {r['warm']['seconds']:.0f}s, {r['warm']['samples']} samples x "
              f"{r['warm']['epochs']} epochs, NLL per token {r['warm']['nll_first']:.2f} -> {r['warm']['nll_last']:.3f}",
              flush=True)
    else:
        r["warm"] = warm_start(warm, seed, ids, a.warm_epochs, a.warm_lr)
        print(f"seed {seed}: warm start {r['warm']['seconds']:.0f}s, NLL per answer {r['warm']['nll_first']:.2f} -> "
              f"{r['warm']['nll_last']:.2f} (the floor, a uniform choice of 7 icons: ln 7 = {math.log(7):.2f})",
              flush=True)
    # Before: the warm start at T=1 on every task (the selected ones are read out of it later).
    r["before_json"] = os.path.join(out, "eval_before.json")
    rc = train_arpo(["--eval-only", "--model", warm, "--task-ids", task_ids, *common_flags(a),
                     "--eval-episodes", str(a.eval_episodes), "--eval-temperature", "1.0",
                     "--sample-seed", str(1000 + seed), "--runs-dir", out, "--run-name", "before",
                     "--eval-out", r["before_json"]], log)
    if rc != 0:
        raise SystemExit(f"the eval before training failed (exit {rc}); see {log}.")
    with open(r["before_json"]) as f:
        r["before_seconds"] = json.load(f)["seconds"]
    return r


def planned_iterations(a, r: dict, elapsed: float) -> int:
    """Iterations from the time left: an iteration is about one eval wave (reset, setup, a step,
    score) plus its update; the selection and the eval after cost what the eval before did. Fixed
    before training, so the evaluated checkpoint (the last) is fixed in advance too."""
    ids = r["task_ids"].split(",")
    waves = math.ceil(len(ids) * a.eval_episodes / a.vms)
    per_wave = r["before_seconds"] / max(1, waves)
    select_s = math.ceil(len(ids) * a.select_tasks / a.vms) * per_wave
    left = a.minutes * 60 - elapsed - r["before_seconds"] - select_s - 30  # 30 s: 3 starts
    per_iteration = math.ceil((a.groups or max(1, a.vms // a.group_size)) * a.group_size / a.vms)  # its waves
    fit = max(2, int(left / (per_wave * per_iteration * 1.25)))
    return min(a.iterations, fit) if a.iterations else fit


def train_arm(a, seed: int, r: dict, iterations: int, extra: list[str], name: str) -> dict:
    """Train from the seed's warm start (seed_start's r) for exactly `iterations` iterations, with
    the recipe's flags plus `extra` (an arm's own: --no-replay, ...), into <seed folder>/<name>;
    then evaluate its last checkpoint (the rule fixed in advance) on the tasks it trained. -> the
    numbers of the table (before, after, p, parse, the training curve, ...)."""
    out, log, task_ids = r["out"], r["log"], r["task_ids"]
    flags = ["--model", r["warm_path"], "--task-ids", task_ids, *common_flags(a), "--iterations", str(iterations),
             "--lr", str(a.lr), "--lr-warmup", str(max(1, iterations // 10)), "--lr-schedule", a.lr_schedule,
             "--epochs", str(a.epochs), "--beta", str(a.beta), *(["--groups", str(a.groups)] if a.groups else []),
             "--format-penalty", str(a.format_penalty), "--format-penalty-on", a.format_penalty_on,
             "--seed", str(seed), "--runs-dir", out, "--run-name", name,
             "--ckpt-every", str(max(1, iterations // 4)), *extra]
    if a.select_tasks:
        flags += ["--select-tasks", str(a.select_tasks)]
    run = os.path.join(out, name)
    rc = train_arpo(flags, log)
    sel_path = os.path.join(run, "selected_tasks.json")
    selected = task_ids.split(",")
    if os.path.exists(sel_path):
        with open(sel_path) as f:
            selected = json.load(f)["selected"]
    if rc != 0:
        raise SystemExit(f"training failed (exit {rc}); see {log}.")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    # After: the last checkpoint (the rule fixed in advance), on the selected tasks.
    after_json = os.path.join(out, "eval_after.json" if name == "train" else f"eval_after_{name}.json")
    rc = train_arpo(["--eval-only", "--resume", run, "--task-ids", ",".join(selected), "--eval-episodes",
                     str(a.eval_episodes), "--eval-temperature", "1.0", "--sample-seed", str(2000 + seed),
                     "--eval-out", after_json, "--vms", str(a.vms)], log)
    if rc != 0:
        raise SystemExit(f"the eval after training failed (exit {rc}); see {log}.")
    before_json = r["before_json"]
    b, af = eval_numbers(before_json, selected), eval_numbers(after_json, selected)
    early, late = windows(metrics, max(1, len(metrics) // 4))
    early_k, late_k = sum(s > SUCCESS for s in early), sum(s > SUCCESS for s in late)
    quarter = max(1, len(metrics) // 4)
    train_parse = [sum(m["format_rate"] for m in metrics[i:i + quarter]) / len(metrics[i:i + quarter])
                   for i in range(0, len(metrics), quarter)]
    t = dict(iterations=iterations, selected=selected, run=run, after_json=after_json,
             before=b["k"] / max(1, b["n"]), after=af["k"] / max(1, af["n"]), n_before=b["n"], n_after=af["n"],
             k_before=b["k"], k_after=af["k"], p=fisher_one_sided(b["k"], b["n"], af["k"], af["n"]),
             per_task_before=b["per_task"], per_task_after=af["per_task"],
             parse_before=b["parse"], parse_after=af["parse"], parse_train=train_parse,
             parse=min([b["parse"], af["parse"], *train_parse]),
             early=early_k / max(1, len(early)), late=late_k / max(1, len(late)), n_early=len(early),
             n_late=len(late), p_train=fisher_one_sided(early_k, len(early), late_k, len(late)),
             curve=[sum(s > SUCCESS for g in m["groups"] for s in g["scores"]) /
                    max(1, sum(len(g["scores"]) for g in m["groups"])) for m in metrics])
    if a.method == "arpo-multi":
        t["steps_before"], t["steps_after"] = step_rates(before_json, selected), step_rates(after_json, selected)
    return t


# ------------------------------------------------------------------------------------------------
# Report: table, curve picture, the last line


def table(rs: list[dict]) -> str:
    rows = [f"{'seed':>4} {'tasks':>5} {'iters':>5} | {'eval T=1 before':>15} {'after':>11} {'p':>8} | "
            f"{'train early':>11} {'late':>11} {'p':>8} | {'parse min':>9} | {'wall':>6}"]
    for r in rs:
        rows.append(f"{r['seed']:>4} {len(r['selected']):>5} {r['iterations']:>5} | "
                    f"{r['before']:>6.2f} (n={r['n_before']:>3}) {r['after']:>5.2f} (n={r['n_after']:>3}) "
                    f"{r['p']:>8.4f} | {r['early']:>5.2f} (n={r['n_early']:>2}) {r['late']:>5.2f} (n={r['n_late']:>2}) "
                    f"{r['p_train']:>8.4f} | {r['parse']:>9.2f} | {r['seconds'] / 60:>5.1f}m")
        per = ", ".join(f"{t} {r['per_task_before'][t]:.2f}->{r['per_task_after'][t]:.2f}" for t in r["selected"])
        rows.append(f"     per task (eval): {per}")
        if "steps_before" in r:
            rows.extend(step_rows(r))
    return "\n".join(rows)


def step_rows(r: dict) -> list[str]:
    """arpo-multi: per step, before -> after (step_rates), overall and per task."""
    def cell(b, a):
        return (f"first {b['first']:.2f}->{a['first']:.2f} ({b['n_first']}/{b['n']} -> {a['n_first']}/{a['n']}), "
                f"second | first {b['second']:.2f}->{a['second']:.2f} ({b['n_second']}/{b['n_first']} -> "
                f"{a['n_second']}/{a['n_first']})")
    b, a = r["steps_before"], r["steps_after"]
    return [f"     per step (eval): {cell(b['all'], a['all'])}"] + [
        f"       {t}: {cell(b['per_task'][t], a['per_task'][t])}" for t in r["selected"]]


def curve_png(rs: list[dict], path: str, smooth: int = 5, title: str = "ARPO") -> None:
    """Fresh success per iteration (moving mean over `smooth` iterations), one line per seed, with
    each seed's eval before and after as dots at the ends. PIL only (no matplotlib here)."""
    from PIL import Image, ImageDraw
    W, H, L, B, T, R = 640, 360, 50, 40, 30, 20
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    n = max(len(r["curve"]) for r in rs)
    def xy(i, v):
        return L + (W - L - R) * i / max(1, n - 1), H - B - (H - B - T) * v
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        d.line([xy(0, v), xy(n - 1, v)], fill=(225, 225, 225))
        d.text((8, xy(0, v)[1] - 6), f"{v:.2f}", fill="black")
    d.text((L, 8), f"{title}, tiny Qwen2.5-VL from a warm start: success of fresh rollouts (T=1)", fill="black")
    d.text((L, H - 22), f"iteration (0..{n - 1}); dots: desktop eval before / after", fill="black")
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    for r, c in zip(rs, colours * 4):
        ys = r["curve"]
        sm = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))]
        if len(sm) > 1:
            d.line([xy(i, v) for i, v in enumerate(sm)], fill=c, width=2)
        for i, v in ((0, r["before"]), (n - 1, r["after"])):
            x, y = xy(i, v)
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=c)
        d.text((W - R - 60, T + 14 * rs.index(r)), f"seed {r['seed']}", fill=c)
    img.save(path)


def main_arpo(a) -> int:
    name = a.method.replace("-", "_")  # arpo, arpo_multi, arpo_repair
    title = {"arpo-multi": "ARPO, 2 steps a task", "arpo-repair": "ARPO, one app alone"}.get(a.method, "ARPO")
    os.makedirs(a.out, exist_ok=True)
    rs, failed = [], []
    for seed in seed_list(a):
        try:
            rs.append(run_seed(a, seed))
        except SystemExit as e:  # one seed's failure is a FAIL line, not a traceback
            failed.append(seed)
            print(f"seed {seed}: {e}", flush=True)
    with open(os.path.join(a.out, f"learning_{name}.json"), "w") as f:
        json.dump(rs, f, indent=1)
    if rs:
        print(table(rs))
        curve_png(rs, os.path.join(a.out, f"learning_{name}.png"), title=title)
        print(f"curves: {os.path.join(a.out, f'learning_{name}.png')}")
    if failed or not rs:
        print(f"learning_{name}: seeds {a.seeds} ran {len(rs)}, failed {failed}: FAIL")
        return 1
    line, ok = verdict(rs, max_seconds=a.minutes * 60)
    print(final_line(name, line, a.seeds, ok))
    return 0 if ok else 1


def seed_list(a) -> list[int]:
    """--first-seed, --first-seed + 1, ... (--seeds of them): development runs take other seeds
    (e.g. --first-seed 10) than the reported ones (0, 1)."""
    return list(range(a.first_seed, a.first_seed + a.seeds))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=["arpo", "arpo-multi", "arpo-repair", "explore"], default="arpo",
                   help="arpo: one step a task; arpo-multi: two steps on two screens; arpo-repair: one app and no "
                        "other window, up to 4 steps (arpo-multi's recipe); explore: ScreenExplorer")
    p.add_argument("--seeds", type=int, default=2, help="independent runs (warm start, train, evals)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds --first-seed .. + --seeds - 1 (develop on others)")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-time budget per seed; caps the iterations (default: 20; arpo-multi 30)")
    p.add_argument("--out", default="", help="where the runs go (default: runs/learning/<method>)")
    p.add_argument("--vms", type=int, default=None, help="local desktops (default: 4; explore 8)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per task (one GRPO group)")
    p.add_argument("--settle", default="watch",
                   help="after each action: watch (the server waits until the screen settles) or seconds of a fixed sleep")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap (default: 40; arpo-multi 48)")
    p.add_argument("--iterations", type=int, default=None,
                   help="training iterations, fewer if --minutes leaves less time; 0 = as many as it leaves "
                        f"(default: 120 for arpo, {MULTI_ITERATIONS} for arpo-multi; explore decides its own)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (after a 10%% warm-up; then --lr-schedule; default 5e-4, arpo-multi 3e-4)")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default=None,
                   help="train_arpo.py --lr-schedule after the 10%% warm-up (default: linear for arpo, "
                        "constant (ARPO's) for arpo-multi)")
    p.add_argument("--epochs", type=int, default=1, help="train_arpo.py --epochs")
    p.add_argument("--beta", type=float, default=0.0, help="train_arpo.py --beta: KL to the warm start (a frozen copy)")
    p.add_argument("--format-penalty", type=float, default=None,
                   help="train_arpo.py --format-penalty: reward -= this when an answer did not parse "
                        "(default: 1.0)")
    p.add_argument("--format-penalty-on", choices=["reward", "advantage"], default="reward",
                   help="train_arpo.py --format-penalty-on (default: reward, as ARPO)")
    p.add_argument("--groups", type=int, default=None,
                   help="train_arpo.py --groups: tasks per iteration, in turns (default: one per --group-size desktops)")
    p.add_argument("--select-tasks", type=int, default=None,
                   help="ARPO's task selection: K rollouts a task; 0 = off (default: 16 for arpo, 0 for arpo-multi)")
    p.add_argument("--eval-episodes", type=int, default=24, help="episodes per task in each eval (T=1)")
    p.add_argument("--warm-epochs", type=int, default=None,
                   help="passes of the warm start over prompts x icons (default: 16, arpo-multi 32)")
    p.add_argument("--warm-lr", type=float, default=6e-3, help="learning rate of the warm start")
    p.add_argument("--task-ids", default="", help="comma-separated task ids (default: the method's own: "
                   f"{TASK_IDS} for arpo, {MULTI_TASK_IDS} for arpo-multi)")
    p.add_argument("--warm-start-only", default="", metavar="DIR",
                   help="only build the ARPO warm start (seed 0) into DIR, for `train_arpo.py --model DIR`")
    return p.parse_args(argv)


def resolve(a):
    """Per-method defaults: the methods never share seed folders, arpo-repair takes arpo-multi's
    recipe (MULTI), and explore gets iterations=None so learning_explore keeps its own default."""
    a.out = a.out or os.path.join(ROOT, "runs", "learning", a.method)
    if a.minutes is None:  # arpo-multi: room for its 400 iterations (see its part of the docstring)
        a.minutes = 30.0 if a.method in MULTI else 20.0
    if a.method == "arpo" and a.iterations is None:
        a.iterations = 120
    if a.method in MULTI and a.iterations is None:
        a.iterations = MULTI_ITERATIONS
    if a.select_tasks is None:
        # arpo-multi: a random 2-step episode succeeds 1 time in 35 (1/7 icons x 1/5 items), so 16
        # rollouts would drop a task 63% of the time: every task is trained and evaluated instead
        # (arpo-repair: its warm start's prior succeeds on terminal-alone 1 time in 39 from a clean
        # start, 1 in 150 from a spoiled one, on a desktop reduced to its stack of windows; on
        # calc-alone 1 in 14.7 and 1 in 67: XCalc's window is titled Calculator too).
        a.select_tasks = 0 if a.method in MULTI else 16
    if a.format_penalty is None:  # see the docstring (3.)
        a.format_penalty = 1.0
    if a.lr_schedule is None:  # arpo-multi: see its part of the docstring
        a.lr_schedule = "constant" if a.method in MULTI else "linear"
    if a.lr is None and a.method != "explore":  # arpo-multi: see its part of the docstring
        a.lr = 3e-4 if a.method in MULTI else 5e-4
    if a.vms is None and a.method != "explore":  # explore: None keeps learning_explore's own default
        a.vms = 4
    if a.max_new_tokens is None:
        a.max_new_tokens = 48 if a.method in MULTI else 40
    if a.warm_epochs is None:  # arpo-multi: see its part of the docstring
        a.warm_epochs = 32 if a.method in MULTI else 16
    return a


def main(argv=None) -> int:
    a = resolve(parse_args(argv))
    if a.warm_start_only:
        w = warm_start(a.warm_start_only, 0, TASK_IDS.split(","), a.warm_epochs, a.warm_lr)
        print(f"warm start written to {a.warm_start_only} ({w['seconds']:.0f}s, NLL per answer "
              f"{w['nll_last']:.2f}; a uniform choice of 7 icons: {math.log(7):.2f})")
        return 0
    if a.method == "explore":
        if not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "learning_explore.py")):
            print("bench/learning.py --method explore: bench/learning_explore.py (the ScreenExplorer half) "
                  "is not there yet; run --method arpo.")
            return 2
        import learning_explore
        return learning_explore.main(a)
    return main_arpo(a)


if __name__ == "__main__":
    sys.exit(main())
