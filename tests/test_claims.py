"""bench/claims.py, the claim runner: its statistics by hand, the claims' own bookkeeping on hand-made
runs, and every claim end to end with a tiny budget (--smoke) on real desktops.

Run: python -m pytest -q tests/test_claims.py      (the smoke runs take a few minutes)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import claims as C  # noqa: E402
import claims_arpo as CA  # noqa: E402
import claims_explore as CE  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Statistics, by hand


def test_sign_flip_by_hand():
    # [1, 2, 3]: observed sum 6; of the 8 sign assignments only (+, +, +) reaches 6 -> 1/8.
    assert C.sign_flip_p([1, 2, 3]) == 1 / 8
    # [2, -1]: observed 1; sums 1, 3, -1, -3 -> two of four reach 1.
    assert C.sign_flip_p([2, -1]) == 0.5
    # The fewest pairs for p < 0.05: 5 all-positive pairs give 1/32; 4 give 1/16.
    assert C.sign_flip_p([1] * 5) == 1 / 32 < 0.05 < C.sign_flip_p([1] * 4) == 1 / 16
    assert C.sign_flip_p([0, 0]) == 1.0  # no effect: every assignment ties
    assert C.sign_flip_p([]) == 1.0


def test_permutation_exact_and_sampled_by_hand():
    # after [3, 4], before [1, 2]: of the C(4, 2) = 6 ways to pick "after", mean differences
    # -2, -1, 0, 0, 1, 2; only the observed one reaches 2 -> 1/6, exactly (6 <= n).
    assert C.permutation_p([3, 4], [1, 2]) == 1 / 6
    assert C.permutation_p([1, 2], [3, 4]) == 1.0
    # Sampled (C(24, 12) > n): the observed labelling is counted once, so p >= 1 / (n + 1).
    assert C.permutation_p([3] * 12, [1] * 12, n=999) == 1 / 1000
    assert C.permutation_p([], [1, 2]) == 1.0


def test_fisher_by_hand():
    # 0/2 before, 2/2 after: given 2 successes in 4, P(both after) = 1 / C(4, 2) = 1/6.
    assert math.isclose(C.fisher_one_sided(0, 2, 2, 2), 1 / 6)
    assert C.fisher_one_sided(0, 5, 0, 5) == 1.0


def test_bootstrap_intervals_by_hand():
    assert C.bootstrap_mean([5, 5, 5]) == (5.0, 5.0)
    # [1, 3]: resampled means 1, 2, 2, 3 with probability 1/4 each: the 5% and 95% quantiles are 1 and 3.
    assert C.bootstrap_mean([1, 3]) == (1.0, 3.0)
    # Independent samples: after [2, 2], before [0, 0] -> every resample differs by exactly 2.
    assert C.bootstrap_diff([2, 2], [0, 0]) == (2.0, 2.0)
    lo, hi = C.bootstrap_diff([1, 3], [0, 0])
    assert (lo, hi) == (1.0, 3.0)


def test_a_test_passes_only_one_way():
    t = C.episodes_test("x", [3, 4], [1, 2])
    assert (t.after, t.before, t.diff, t.p) == (3.5, 1.5, 2.0, 1 / 6) and not t.ok  # p 0.17: not enough
    t = C.episodes_test("x", [3] * 12, [1] * 12)
    assert t.ok and (t.lo, t.hi) == (2.0, 2.0) and "diff +2.000 [+2.000, +2.000]" in t.line()
    assert not C.episodes_test("x", [1] * 12, [3] * 12).ok
    r = C.rate_test("s", 10, 10, 0, 10)  # 10/10 vs 0/10: Fisher's 1 / C(20, 10)
    assert r.ok and r.diff == 1.0 and math.isclose(r.p, 1 / math.comb(20, 10))
    r = C.rate_test("s", 0, 0, 4, 37)  # no episode after: its rate is unknown, not 0
    assert math.isnan(r.after) and math.isnan(r.diff) and r.before == 4 / 37 and not r.ok
    assert "nan vs 0.108, diff +nan [+nan, +nan], p 1.0000 no" in r.line()
    p = C.paired_test("d", [2, 3, 4, 5, 6], [1, 1, 1, 1, 1])
    assert p.diff == 3.0 and p.p == 1 / 32 and p.ok


def test_quarters_and_settings():
    assert C.quarters([1, 2, 3, 4, 5, 6, 7, 8]) == (1.5, 7.5)
    ns = C.parse_args(["x", "--set", "iterations=30", "--set", "rewards=all,windows", "--set", "flag=no"])
    s = C.settings({"iterations": 48, "rewards": "all", "flag": True, "vms": 8}, ns, {"vms": 2})
    assert s == {"iterations": 30, "rewards": "all,windows", "flag": False, "vms": 8}  # smoke off: vms stays
    ns.smoke = True
    assert C.settings({"iterations": 48, "rewards": "all", "flag": True, "vms": 8}, ns, {"vms": 2})["vms"] == 2
    with pytest.raises(SystemExit, match="this claim's settings are"):
        C.settings({"iterations": 48}, C.parse_args(["x", "--set", "nope=1"]))


# ------------------------------------------------------------------------------------------------
# The explore claims' bookkeeping, on hand-made records


def test_step_kinds_by_hand():
    seen = set()
    line = lambda opened, change=0.0: {"opened": opened, "rewards": {"image_immediate": change}}  # noqa: E731
    assert CE.step_kind(line(["terminal"]), seen) == "new app"
    seen.add("terminal")
    assert CE.step_kind(line(["terminal"]), seen) == "same app"
    assert CE.step_kind(line(["terminal", "editor"]), seen) == "new app"  # one of them is new
    assert CE.step_kind(line(["other"]), seen) == "other window"
    assert CE.step_kind(line([], 0.07), seen) == "menu or change"  # a right-click menu: 0.07-0.16
    assert CE.step_kind(line([], 0.0), seen) == "nothing"


def test_apps_of_an_eval_by_hand():
    ev = {"policy": {"episodes": [
        {"apps": ["terminal", "terminal", "other"], "windows": 3, "distinct_screens": 3, "format": 1.0},
        {"apps": ["editor", "terminal"], "windows": 2, "distinct_screens": 4, "format": 0.5},
        {"apps": [], "windows": 0, "distinct_screens": 1, "format": 1.0}]}}
    m = CE.apps_of(ev)
    assert m["apps"] == [1, 2, 0] and m["windows"] == [3, 2, 0] and m["screens"] == [3, 4, 1]
    # terminal 3 of the 4 app windows (a dialog of no app is "other"): share 0.75, coverage 2
    assert m["counts"] == {"terminal": 3, "editor": 1} and m["top"] == "terminal" and m["top_share"] == 0.75
    assert m["coverage"] == 2 and m["format"] == pytest.approx(2.5 / 3)


def test_what_each_kind_of_step_was_paid(tmp_path):
    """paid() reads a run's trajectory files: per iteration, per desktop, the steps in order."""
    run = tmp_path / "run"
    for it, rows in enumerate([
        [(["terminal"], 1.0, 0.7), (["terminal"], 0.5, 0.6), ([], 0.1, 0.1)],   # iteration 0, desktop 0
        [(["editor"], 2.0, 0.9), ([], 0.0, 0.0), (["other"], 0.3, 0.2)],        # iteration 1
    ]):
        d = run / "trajectories" / f"it{it:06d}"
        d.mkdir(parents=True)
        with open(d / "vm00.jsonl", "w") as fh:
            for step, (opened, total, imm) in enumerate(rows):
                fh.write(json.dumps({"step": step, "valid": True, "opened": opened, "reward": total,
                                     "rewards": {"format": 1.0, "image_immediate": imm}}) + "\n")
    p = CE.paid(str(run))  # 2 iterations: the first quarter is iteration 0, the last iteration 1
    assert p["first"]["new app"] == {"n": 1, "total": 1.0, "format": 1.0, "image_immediate": 0.7}
    assert p["first"]["same app"]["n"] == 1 and p["first"]["menu or change"]["total"] == 0.1
    assert p["last"]["new app"]["total"] == 2.0 and p["last"]["nothing"]["n"] == 1
    assert p["last"]["other window"]["image_immediate"] == 0.2


def test_self_correction_bookkeeping_by_hand(tmp_path):
    """arpo-self-correction's counts on a hand-made eval: a first step on the icon of an app the task
    does not accept is wrong (a click beside every icon, or on an accepted one, is not: XCalc for
    calc-alone, whose window is titled Calculator too); the shown episode is the first
    success, with its screenshots where --save-trajectories puts them (it<task>/vm<k>_step<i>.png)."""
    dc = lambda x, y: {"type": "double_click", "x": x, "y": y}  # noqa: E731
    close = {"type": "key", "keys": ["alt", "f4"]}
    ep = lambda task, job, acts, score: {"task": task, "job": job, "end": "max_steps", "steps": len(acts),  # noqa: E731
                                         "actions": acts, "texts": [f"a{i}" for i in range(len(acts))],
                                         "score_hard": score, "format_ok": [True] * len(acts)}
    details = [ep("calc-alone", 0, [dc(74, 46), close, dc(74, 246)], 1.0),   # Terminal first: wrong, repaired
               ep("calc-alone", 1, [dc(194, 46)], 0.0),                       # Clock first: wrong, not repaired
               ep("calc-alone", 2, [dc(74, 246)], 1.0),                       # its own icon: right
               ep("terminal-alone", 3, [dc(640, 400)], 0.0),                  # no icon: not counted
               ep("terminal-alone", 4, [], 0.0),                              # no action at all
               ep("terminal-alone", 5, [dc(74, 246), close, dc(74, 46)], 1.0),  # Calculator first: repaired
               ep("calc-alone", 6, [dc(194, 246)], 1.0),                      # XCalc (titled Calculator): right
               ep("terminal-alone", 7, [dc(194, 246)], 0.0)]                  # XCalc first: wrong here
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"details": details}))
    assert CA.wrong_first(str(path), ["calc-alone", "terminal-alone"]) == (2, 4)  # jobs 0, 1, 5, 7
    assert CA.wrong_first(str(path), ["calc-alone"]) == (1, 2)
    assert CA.per_task(str(path)) == {"calc-alone": (3, 4), "terminal-alone": (1, 4)}
    assert CA.total(CA.per_task(str(path)), ["calc-alone", "terminal-alone"]) == (4, 8)
    assert CA.share(CA.per_task(str(path)), "calc-alone") == "3/4" and CA.share({}, "calc-alone") == "0/0"
    assert CA.total({"calc-alone": (2, 3)}, ["calc-alone", "terminal-alone"]) == (2, 3)  # none played: 0/0
    lines = CA.repaired(str(path), n=3)  # 3 episodes a task: job 0 is task 0's first episode
    shots = os.path.join(str(tmp_path / "eval"), "trajectories", "it000000")
    assert lines[0].startswith("a repaired episode: calc-alone, 3 steps") and len(lines) == 1 + 2 * 3
    assert lines[3].endswith(os.path.join(shots, "vm00_step01.png")) and '"alt", "f4"' in lines[3]
    (tmp_path / "later.json").write_text(json.dumps({"details": details[3:]}))  # job 5 = task 1's third
    assert CA.repaired(str(tmp_path / "later.json"), n=3)[1].endswith(
        os.path.join(str(tmp_path / "later"), "trajectories", "it000001", "vm02_step00.png"))
    (tmp_path / "none.json").write_text(json.dumps({"details": [details[1]]}))
    assert CA.repaired(str(tmp_path / "none.json"), n=3)[0].startswith("no repaired episode")


# ------------------------------------------------------------------------------------------------
# Every claim, end to end, with a tiny budget


def test_list_names_every_claim():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "claims.py"), "--list"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for name in C.all_claims():
        assert name in out.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "claims.py"), "no-such-claim"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--list" in bad.stdout


def smoke(name: str, out, *more: str) -> dict:
    """`python bench/claims.py NAME --smoke --out OUT`: it must run through (no `stopped:`) and end
    in its verdict line; -> its JSON."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "claims.py"), name, "--smoke", "--out", str(out),
                        *more], capture_output=True, text=True, timeout=900, cwd=ROOT)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0 and last.startswith(f"claim {name}: ") and last.endswith(": smoke"), \
        p.stdout[-3000:] + p.stderr[-3000:]
    assert "stopped:" not in last, last  # the claim ran through, it did not stop on an error
    with open(os.path.join(out, f"{name}.json")) as fh:
        result = json.load(fh)
    assert result["smoke"] is True
    return result


@pytest.mark.parametrize("name", sorted(n for n in C.all_claims() if not n.startswith("explore-")))
def test_each_arpo_claim_runs_with_a_tiny_budget(name, tmp_path):
    smoke(name, tmp_path)


def test_each_explore_claim_runs_with_a_tiny_budget_on_the_diversity_runs(tmp_path):
    """ScreenExplorer's B, C and D build on A's runs (--set source=), as after a real run of A."""
    div = smoke("explore-diversity", tmp_path / "div")
    assert div["per_seed"][0]["apps"]["rl"]["apps"]  # one number per eval episode
    for name in ("explore-curiosity", "explore-distillation", "explore-curves"):
        result = smoke(name, tmp_path / name, "--set", f"source={tmp_path / 'div'}")
        assert result["source"] == str(tmp_path / "div")
    curves = json.load(open(tmp_path / "explore-curves" / "explore-curves.json"))
    assert curves["per_seed"][0]["run"] == str(tmp_path / "div" / "seed0" / "rl") and os.path.exists(curves["png"])
    # C resumed a copy of A's run into generation 2 (its SFT start, models/E2_sft, only if generation 1
    # kept a format-valid step), and A's run is untouched
    gen2 = tmp_path / "explore-distillation" / "seed0" / "rl" / "models"
    assert (gen2 / "E2").is_dir()
    assert not (tmp_path / "div" / "seed0" / "rl" / "models" / "E2").exists()
    # B trained only the arm without curiosity, from A's warm start
    assert (tmp_path / "explore-curiosity" / "seed0" / "no_curiosity" / "metrics.jsonl").exists()
    assert not (tmp_path / "explore-curiosity" / "seed0" / "warm").exists()
