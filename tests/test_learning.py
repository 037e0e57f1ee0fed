"""Tests for bench/learning.py: its statistics by hand, and a short smoke of the whole bench.

    python -m pytest -q tests/test_learning.py

- fisher_one_sided, windows, verdict and the last line with hand-computed numbers;
- the balanced warm start: every task prompt x every icon, answers that parse onto the icons;
- smoke: `bench/learning.py --method arpo` end to end on a tiny budget (one seed, 2 desktops, 2
  iterations, one eval rollout a task): real desktops, train_arpo.py as subprocesses, and the last
  line in its documented form. The numbers of so short a run mean nothing; their form and files do.
- arpo-multi: which first action is right, the per-step rates by hand, the warm start's balance
  over icons and items, the two-click path on a real desktop (the file manager's icon, then the
  folder: the evaluator scores 1, another item 0), and the method's smoke with the per-step table
  recomputed from the evals it saved.
- bench/learning_replica.py: its hit boxes and evaluator by hand, the same boxes against a real
  desktop (a window opens, a folder opens, or nothing does), and its smoke.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "bench"))  # after the project: bench/ has look-alike file names

import learning as L  # noqa: E402
import learning_warm as W  # noqa: E402

LINE = re.compile(r"learning_arpo: before \d\.\d\d after \d\.\d\d gain [+-]\d\.\d\d p \d\.\d{4} "
                  r"parse \d\.\d\d seeds \d+: (pass|FAIL)")


def test_fisher_one_sided_by_hand():
    # before 0/2, after 2/2: all 2 successes land in "after": C(2,2) C(2,0) / C(4,2) = 1/6
    assert L.fisher_one_sided(0, 2, 2, 2) == pytest.approx(1 / 6)
    # before 1/4, after 3/4: P(X >= 3), X ~ Hypergeom(population 8, 4 successes, 4 drawn)
    #   = (C(4,3) C(4,1) + C(4,4) C(4,0)) / C(8,4) = (16 + 1) / 70
    assert L.fisher_one_sided(1, 4, 3, 4) == pytest.approx(17 / 70)
    # worse after than before: the whole upper tail from 0 successes is 1
    assert L.fisher_one_sided(3, 4, 0, 4) == pytest.approx(1.0)
    assert L.fisher_one_sided(0, 5, 0, 5) == 1.0 and L.fisher_one_sided(2, 5, 0, 0) == 1.0


def test_windows_use_fresh_rollouts_only():
    def it(scores, replayed=()):
        return {"groups": [{"scores": list(scores), "replayed_scores": list(replayed)}]}
    ms = [it([0, 0], [1]), it([1, 0]), it([0, 1]), it([1, 1], [1]), it([1, 1])]
    early, late = L.windows(ms, 2)
    assert early == [0, 0, 1, 0] and late == [1, 1, 1, 1]  # replayed successes never count
    # a window never takes more than half the run, so early and late do not overlap
    assert L.windows(ms, 10) == ([0, 0, 1, 0], [1, 1, 1, 1])


def test_verdict_reports_the_worst_seed():
    seeds = [{"before": 0.2, "after": 0.8, "p": 0.0001, "parse": 0.97, "seconds": 900},
             {"before": 0.25, "after": 0.55, "p": 0.004, "parse": 0.9, "seconds": 1100}]
    line, ok = L.verdict(seeds)
    assert line == pytest.approx({"before": 0.25, "after": 0.55, "gain": 0.30, "p": 0.004, "parse": 0.9})
    assert ok
    assert L.final_line("arpo", line, 2, ok) == \
        "learning_arpo: before 0.25 after 0.55 gain +0.30 p 0.0040 parse 0.90 seeds 2: pass"
    # each target on its own fails the verdict: gain < 0.25, p >= 0.01, parse < 0.85, over time
    for bad in ({"after": 0.45}, {"p": 0.01}, {"parse": 0.84}, {"seconds": 1201}):
        assert not L.verdict([seeds[0], {**seeds[1], **bad}])[1], bad


def test_per_method_defaults():
    arpo = L.resolve(L.parse_args(["--method", "arpo"]))
    explore = L.resolve(L.parse_args(["--method", "explore"]))
    assert arpo.iterations == 120 and explore.iterations is None  # explore's own default stays
    assert arpo.out.endswith(os.path.join("learning", "arpo")) and explore.out.endswith(os.path.join("learning", "explore"))
    assert L.resolve(L.parse_args(["--method", "explore", "--iterations", "3"])).iterations == 3
    multi = L.resolve(L.parse_args(["--method", "arpo-multi"]))
    assert multi.iterations == L.MULTI_ITERATIONS and multi.out.endswith(os.path.join("learning", "arpo-multi"))
    # arpo keeps ARPO's task selection; arpo-multi trains every task (see resolve); both settle by watching
    assert (arpo.select_tasks, multi.select_tasks) == (16, 0) and arpo.settle == multi.settle == "watch"
    # the ARPO methods' lr, penalty and desktops; explore leaves them to bench/learning_explore.py (None)
    assert (arpo.lr, arpo.format_penalty, arpo.format_penalty_on, arpo.vms) == (5e-4, 1.0, "reward", 4)
    assert (multi.lr, multi.format_penalty, multi.format_penalty_on, multi.vms) == (3e-4, 1.0, "reward", 4)
    # arpo-multi keeps ARPO's constant lr for its 400 iterations, and 30 minutes a seed to run them (docstring)
    assert (arpo.lr_schedule, multi.lr_schedule, multi.iterations) == ("linear", "constant", 400)
    assert (arpo.minutes, multi.minutes, explore.minutes) == (20.0, 30.0, 20.0)
    assert (arpo.warm_epochs, multi.warm_epochs) == (16, 32)  # a sharp format before RL moves it (docstring)
    assert (explore.lr, explore.vms) == (None, None)
    assert L.seed_list(L.parse_args(["--seeds", "2", "--first-seed", "10"])) == [10, 11]
    # arpo-repair (the self-correction claim's setting) takes arpo-multi's recipe, 4 steps, 2 screenshots
    repair = L.resolve(L.parse_args(["--method", "arpo-repair"]))
    assert {k: v for k, v in vars(repair).items() if k not in ("method", "out")} == \
        {k: v for k, v in vars(multi).items() if k not in ("method", "out")}
    flags = L.common_flags(repair)
    assert flags[flags.index("--max-steps") + 1] == "4" and flags[flags.index("--max-images") + 1] == "2"


def test_warm_start_balances_prompts_and_icons():
    """Every prompt is paired with each of the 7 icons once per epoch, answers parse onto the
    icons on the screen, and the folder loads as an ordinary checkpoint."""
    from vm.desktop import desktop_icons
    from actions import parse_action
    pts = W.icon_points((140, 84), (1280, 720))
    assert len(pts) == len(set(pts)) == 7
    icons = list(desktop_icons((1280, 720)).values())
    for (x, y), (ix, iy) in zip(pts, icons):
        p = parse_action(f"Thought: I open it.\nAction: left_double(start_box='({x},{y})')", "uitars",
                         (1280, 720), (140, 84))
        # within half a model pixel of the icon's centre (1280 / 140 = 9.1 screen pixels a model pixel)
        assert p.action.type == "double_click" and abs(p.action.x - ix) <= 5 and abs(p.action.y - iy) <= 5


def test_smoke_the_bench_end_to_end(tmp_path):
    out = tmp_path / "learn"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--method", "arpo", "--seeds", "1",
           "--iterations", "2", "--eval-episodes", "1", "--select-tasks", "0", "--warm-epochs", "1",
           "--vms", "2", "--group-size", "2", "--settle", "0.2", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = p.stdout.strip().splitlines()
    assert lines and LINE.fullmatch(lines[-1]), p.stdout[-2000:] + p.stderr[-3000:]
    assert p.returncode == (0 if lines[-1].endswith("pass") else 1)
    with open(out / "learning_arpo.json") as f:
        (r,) = json.load(f)
    assert r["iterations"] == 2 and r["n_before"] == 4 and r["n_after"] == 4 and len(r["curve"]) == 2
    # p and parse recomputed from the files the run saved: the two evals' details and the metrics
    evals = {}
    for when in ("before", "after"):
        with open(out / "seed0" / f"eval_{when}.json") as f:
            d = [e for e in json.load(f)["details"] if e["task"] in r["selected"]]
        oks = [ok for e in d for ok in e["format_ok"]]
        evals[when] = (sum(e["score_hard"] > L.SUCCESS for e in d), len(d), sum(oks) / len(oks))
    (kb, nb, parse_b), (ka, na, parse_a) = evals["before"], evals["after"]
    assert (nb, na) == (r["n_before"], r["n_after"]) and (kb / nb, ka / na) == (r["before"], r["after"])
    assert r["p"] == pytest.approx(L.fisher_one_sided(kb, nb, ka, na))
    with open(out / "seed0" / "train" / "metrics.jsonl") as f:
        rates = [json.loads(line)["format_rate"] for line in f if line.strip()]
    assert r["parse_train"] == pytest.approx(rates)  # 2 iterations: a quarter is one iteration
    assert r["parse"] == pytest.approx(min(parse_b, parse_a, *rates))
    assert Image.open(out / "learning_arpo.png").size == (640, 360)
    # the warm start is an ordinary checkpoint folder; the evals saved what they clicked
    assert (out / "seed0" / "warm_start" / "config.json").exists()
    with open(out / "seed0" / "eval_after.json") as f:
        assert all("actions" in d for d in json.load(f)["details"])
    assert (out / "seed0" / "eval_after" / "trajectories").is_dir()


# ------------------------------------------------------------------------------------------------
# arpo-multi

MULTI_LINE = re.compile(r"learning_arpo_multi: before \d\.\d\d after \d\.\d\d gain [+-]\d\.\d\d p \d\.\d{4} "
                        r"parse \d\.\d\d seeds \d+: (pass|FAIL)")


def test_first_right_is_a_double_click_in_the_file_managers_cell():
    # File Manager's icon centre (74, 346): its cell on the desktop grid is x 16..135, y 316..415
    assert L.first_right({"type": "double_click", "x": 74, "y": 346})
    assert L.first_right({"type": "double_click", "x": 16, "y": 316}) and L.first_right({"type": "double_click", "x": 135, "y": 415})
    assert not L.first_right({"type": "double_click", "x": 136, "y": 346})  # the next column (XCalc's row)
    assert not L.first_right({"type": "double_click", "x": 74, "y": 315})   # the Calculator's cell
    assert not L.first_right({"type": "click", "x": 74, "y": 346})          # one click opens nothing
    assert not L.first_right(None)                                           # an answer that did not parse


def test_step_rates_by_hand(tmp_path):
    fm, term = {"type": "double_click", "x": 74, "y": 346}, {"type": "double_click", "x": 74, "y": 46}
    item = {"type": "double_click", "x": 715, "y": 215}
    def ep(task, actions, score):
        return {"task": task, "actions": actions, "score_hard": score, "format_ok": [a is not None for a in actions]}
    details = [ep("a", [fm, item], 1.0), ep("a", [fm, item], 0.0), ep("a", [term, item], 0.0), ep("a", [None], 0.0),
               ep("b", [fm, item], 1.0), ep("b", [term, term], 0.0), ep("other", [fm, item], 1.0)]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"details": details}))
    r = L.step_rates(str(path), ["a", "b"])
    # a and b: 6 episodes, first right in 3 (a, a, b), of which 2 succeeded; "other" is left out
    assert r["all"] == {"n": 6, "first": 0.5, "n_first": 3, "second": pytest.approx(2 / 3), "n_second": 2,
                        "success": pytest.approx(2 / 6)}
    assert r["per_task"]["a"] == {"n": 4, "first": 0.5, "n_first": 2, "second": 0.5, "n_second": 1, "success": 0.25}
    assert r["per_task"]["b"]["first"] == 0.5 and r["per_task"]["b"]["second"] == 1.0
    row = L.step_rows({"selected": ["a", "b"], "steps_before": r, "steps_after": r})[0]
    assert "first 0.50->0.50 (3/6 -> 3/6), second | first 0.67->0.67 (2/3 -> 2/3)" in row


def test_multi_warm_start_is_uniform_over_icons_and_items():
    """Per epoch, every desktop icon is the first answer equally often (5 times: 5 second answers
    each); after the file manager the 5 items once each; after any other app 5 of the 7 icons,
    each icon 5 times in any 7 epochs. The same lists for every task (no task in the function)."""
    from vm.desktop import desktop_icons
    icons = desktop_icons((1280, 720))
    for e in range(7):
        assert all(len(W.second_answers(label, e)) == 5 for label in icons)
        assert sorted(W.second_answers(W.FM_ICON, e)) == sorted(W.FM_ITEMS.values())
    seen = Counter(q for e in range(7) for q in W.second_answers("Terminal", e))
    assert seen == {p: 5 for p in icons.values()}
    # the arpo-multi answers parse onto the items the warm start meant
    from actions import parse_action
    for name, (x, y) in W.FM_ITEMS.items():
        q = (round(x * 140 / 1280), round(y * 84 / 720))
        a = parse_action(W.answer("Open it.", q), "uitars", (1280, 720), (140, 84)).action
        assert a.type == "double_click" and abs(a.x - x) <= 5 and abs(a.y - y) <= 5, name


def test_repair_walk_is_the_uniform_prior_over_each_screens_affordances():
    """arpo-repair's warm start: a clean start's first step is one of the 7 icons, each 1/7; on a
    screen with a window each of the 9 affordances 1/9 (close and finish included); close takes the
    top window off, finish ends the episode; a spoiled start begins under a window. Frequencies of
    20000 walks within 0.01 of the hand-computed shares. The answers parse: alt+f4 and done."""
    import random
    from actions import parse_action
    from vm.desktop import desktop_icons
    labels = list(desktop_icons())
    rng = random.Random(0)
    first, on_window, n = Counter(), Counter(), 20000
    for k in range(n):
        seen, did = W.repair_walk(rng, labels, spoiled=k % 2 == 1)
        assert 1 <= len(did) <= 4 and len(seen) == len(did) and ("finish" not in did[:-1])
        if k % 2 == 0:
            assert seen[0] is None and did[0] in labels  # the bare desktop affords the icons only
            first[did[0]] += 1
        else:
            assert seen[0] in labels  # a window is open from the start
        stack = [seen[0]] if seen[0] else []
        for i, (s_, d) in enumerate(zip(seen, did)):
            assert s_ == (stack[-1] if stack else None)  # each step sees the window on top
            if s_ is not None:
                on_window["icon" if d in labels else d] += 1
            stack = stack[:-1] if d == "close" else stack if d == "finish" else stack + [d]
    assert all(abs(first[x] / (n / 2) - 1 / 7) < 0.01 for x in labels)
    total = sum(on_window.values())
    assert abs(on_window["close"] / total - 1 / 9) < 0.01 and abs(on_window["finish"] / total - 1 / 9) < 0.01
    close = parse_action(f"Thought: Open it.\nAction: {W.CLOSE}", "uitars", (1280, 720), (140, 84)).action
    finish = parse_action(f"Thought: Open it.\nAction: {W.FINISH}", "uitars", (1280, 720), (140, 84)).action
    assert (close.type, close.keys, finish.type) == ("key", ["alt", "f4"], "done")


def test_last_turn_only_keeps_the_last_answer_as_the_target():
    from grpo import Sample
    s = Sample([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 0, 1, 1, 0], None, None)
    assert W.last_turn_only(s).target_mask == [0, 0, 0, 0, 0, 1, 1, 0]


def test_the_two_click_path_on_a_real_desktop(vm_desktop):
    """What arpo-multi's tasks need, on a real desktop: the file manager's desktop icon opens HOME
    with the items at FM_ITEMS, and a double-click on the task's folder there solves the task;
    on another item (or after another icon) it does not."""
    from vm.desktop import desktop_icons
    from env import VMClient
    from env import load_tasks
    vm = VMClient(vm_desktop.url, vm_desktop.token, timeout=60)
    tasks = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
    fm = desktop_icons((1280, 720))[W.FM_ICON]
    for tid in L.MULTI_TASK_IDS.split(","):
        folder = tasks[tid].evaluator["checks"][0]["title"].strip("^$")
        for first, second, want in ((fm, W.FM_ITEMS[folder], 1.0), (fm, W.FM_ITEMS["Desktop"], 0.0)):
            vm.reset()
            vm.setup(tasks[tid].setup)
            for x, y in (first, second):
                vm.act({"type": "double_click", "x": x, "y": y}, settle="watch")
            assert vm.evaluate(tasks[tid].evaluator)["score"] == want, (tid, second)


def test_smoke_arpo_multi_end_to_end(tmp_path):
    out = tmp_path / "multi"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--method", "arpo-multi", "--seeds", "1",
           "--iterations", "2", "--eval-episodes", "1", "--warm-epochs", "1", "--vms", "2", "--group-size", "2",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = p.stdout.strip().splitlines()
    assert lines and MULTI_LINE.fullmatch(lines[-1]), p.stdout[-2000:] + p.stderr[-3000:]
    with open(out / "learning_arpo_multi.json") as f:
        (r,) = json.load(f)
    assert r["selected"] == L.MULTI_TASK_IDS.split(",")  # no task selection: every task, trained and evaluated
    assert r["n_before"] == r["n_after"] == 3 and len(r["curve"]) == 2
    with open(out / "seed0" / "train" / "args.json") as f:
        cfg = json.load(f)
    assert cfg["max_steps"] == 2 and cfg["max_images"] == 2 and cfg["settle"] == "watch"
    # the per-step table recomputed from the evals the run saved
    for when in ("before", "after"):
        with open(out / "seed0" / f"eval_{when}.json") as f:
            d = json.load(f)["details"]
        first = [e for e in d if e["actions"] and L.first_right(e["actions"][0])]
        assert r[f"steps_{when}"]["all"]["n_first"] == len(first)
        assert r[f"steps_{when}"]["all"]["n_second"] == sum(e["score_hard"] > L.SUCCESS for e in first)
    assert "per step (eval): first" in p.stdout
    assert Image.open(out / "learning_arpo_multi.png").size == (640, 360)


def test_smoke_arpo_multi_iter():
    """bench/arpo_multi_iter.py end to end with a tiny budget: both ways run on one trainer and the
    last line has the ratio (its numbers mean nothing at this size)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "arpo_multi_iter.py"), "--model", "tiny", "--vms", "2",
           "--blocks", "1", "--block", "2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = p.stdout.strip().splitlines()
    assert lines and re.fullmatch(r"arpo_multi_iter: before [\d.]+ s now [\d.]+ s per iteration: [\d.]+x "
                                  r"\(cpu [\d.]+x\)", lines[-1]), p.stdout[-2000:] + p.stderr[-3000:]
    assert re.search(r"^before .*\(1 iterations\)$", p.stdout, re.M) and re.search(r"^now .*\(2 iterations\)$", p.stdout, re.M)


# ------------------------------------------------------------------------------------------------
# bench/learning_replica.py: its lookups by hand, against a real desktop, and a smoke run


def test_replica_lookups_by_hand():
    import learning_replica as R
    dc = lambda x, y: {"type": "double_click", "x": x, "y": y}  # noqa: E731
    assert R.icon_hit(dc(74, 346)) == W.FM_ICON and R.icon_hit(dc(74, 46)) == "Terminal"
    # XCalc at (194, 246): picture x 170..217, y 222..271; label x 171..215 to y 294
    assert R.icon_hit(dc(170, 222)) == R.icon_hit(dc(217, 271)) == R.icon_hit(dc(215, 294)) == "XCalc"
    assert R.icon_hit(dc(169, 246)) is None and R.icon_hit(dc(216, 294)) is None and R.icon_hit(dc(194, 295)) is None
    # File Manager's label is wider than its picture: x 24..123 at y 372..394
    assert R.icon_hit(dc(24, 394)) == R.icon_hit(dc(123, 372)) == W.FM_ICON and R.icon_hit(dc(24, 371)) is None
    assert R.icon_hit({"type": "click", "x": 74, "y": 346}) is None and R.icon_hit(None) is None
    # Downloads' cell from x 668: picture 690..738 x 184..231, label 668..756 x 232..249
    assert R.item_hit(dc(715, 215)) == R.item_hit(dc(690, 184)) == R.item_hit(dc(756, 249)) == "Downloads"
    assert R.item_hit(dc(689, 215)) is None and R.item_hit(dc(739, 231)) is None and R.item_hit(dc(715, 250)) is None
    assert R.item_hit(dc(757, 240)) is None and R.item_hit(dc(715, 183)) is None
    assert R.item_hit(dc(621, 215)) == "Documents" and R.item_hit(dc(810, 215)) == "Pictures"
    assert R.item_hit({"type": "click", "x": 715, "y": 215}) is None
    # solved: the file manager opened, then the task's folder; a first double-click inside the File
    # Manager's grid cell but off its picture and label (44, 371) opens nothing, so the folder's
    # place on the bare desktop solves nothing
    fm, down = dc(74, 346), dc(715, 215)
    assert R.solved(R.icon_hit(fm), [fm, down], "files-open-downloads")
    assert not R.solved(R.icon_hit(dc(44, 371)), [dc(44, 371), down], "files-open-downloads")
    assert not R.solved(R.icon_hit(fm), [fm, down], "files-open-pictures")
    assert not R.solved(R.icon_hit(fm), [fm], "files-open-downloads")
    assert not R.solved(R.icon_hit(dc(194, 246)), [dc(194, 246), down], "files-open-downloads")  # XCalc first


def test_replica_agrees_with_a_real_desktop(vm_desktop):
    """Where the replica says a double-click opens something, a real desktop opens it, and where it
    says nothing opens, nothing does: points on either side of its boxes' edges."""
    import learning_replica as R
    from env import VMClient, load_tasks
    from vm.desktop import desktop_icons
    vm = VMClient(vm_desktop.url, vm_desktop.token, timeout=60)
    task = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}["files-open-downloads"]
    dc = lambda x, y: {"type": "double_click", "x": x, "y": y}  # noqa: E731
    # desktop icons: a window opens, or none does
    fm, xcalc = desktop_icons((1280, 720))[W.FM_ICON], desktop_icons((1280, 720))["XCalc"]
    for x, y in [fm, (fm[0] - 50, fm[1] + 40), (fm[0] - 51, fm[1] + 40), (fm[0] - 30, fm[1] + 25),
                 (xcalc[0] + 23, xcalc[1] - 24), (xcalc[0] + 24, xcalc[1]), (xcalc[0], xcalc[1] + 49)]:
        vm.reset()
        vm.act(dc(x, y), settle="watch")
        assert (len(vm.windows()) > 0) == (R.icon_hit(dc(x, y)) is not None), (x, y)
    # the file manager's folders: the task's evaluator says Downloads opened, or not
    for x, y in [(715, 215), (690, 184), (689, 200), (756, 249), (757, 240), (738, 231), (739, 215), (715, 250)]:
        vm.reset()
        for p in (fm, (x, y)):
            vm.act(dc(*p), settle="watch")
        assert vm.evaluate(task.evaluator)["score"] == (1.0 if R.item_hit(dc(x, y)) == "Downloads" else 0.0), (x, y)


def test_smoke_replica(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "learning_replica.py"), "--seeds", "1", "--first-seed", "0",
           "--iterations", "2", "--eval-episodes", "1", "--warm-epochs", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-3000:]
    assert re.fullmatch(r"learning_replica: seeds 1 gain min [+-]\d\.\d\d median [+-]\d\.\d\d, below 0\.25: [01], parse below 0\.85: [01]", lines[-1])
    assert re.match(r"seed 0: before \d\.\d\d after \d\.\d\d gain [+-]\d\.\d\d parse \d\.\d\d \| after: documents", lines[-2])
    assert (tmp_path / "seed0" / "warm_start-1x0.006" / "config.json").exists()  # named by its recipe
    assert re.search(r"\| fresh success by quarter( (\d\.\d\d|nan)){4}, replayed \d+ \| ", lines[-2])
    # replay's ablation: no buffer at all (train_arpo.py --no-replay), the same warm start reused
    p = subprocess.run(cmd + ["--no-replay"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-3000:]
    assert re.search(r", replayed 0 \| ", lines[-2])
