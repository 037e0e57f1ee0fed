"""Tests for bench/learning_explore.py (does ScreenExplorer learn?): its warm-start data and its
statistics by hand, and one end-to-end pass at the smallest size (a real desktop, the real
train_explore.py subprocesses; it shows the plumbing, not learning).

Run: python -m pytest -q tests/test_learning_explore.py
"""
import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import learning_explore as L  # noqa: E402
from actions import parse_action  # noqa: E402


def test_warm_answers_are_balanced_and_parse():
    n = 6 * 4  # one warm-start step's answers (--warm-batch 4)
    answers = L.warm_answers(n, (140, 84), random.Random(0))
    parsed = [parse_action(t, "explore", (1280, 720), (140, 84)) for t in answers]
    assert all(p is not None for p in parsed)  # the warm start teaches the format, every answer
    # Every action type of the random baseline equally often (scroll split by direction).
    kinds = Counter(t.split('"action": "')[1].split("(")[0] for t in answers)
    assert kinds == {k: 4 for k in L.KINDS}
    # x stratified over the 140 px the model sees: the k-th smallest x lies in the k-th of n equal
    # slices of [0, 140) (floored to a pixel), likewise y over 84.
    xs = sorted(int(t.split("(")[1].split(",")[0]) for t in answers)
    ys = sorted(int(t.split(", ")[-1].split(")")[0]) for t in answers)
    assert all(k * 140 // n <= x < (k + 1) * 140 / n for k, x in enumerate(xs)), xs
    assert all(k * 84 // n <= y < (k + 1) * 84 / n for k, y in enumerate(ys)), ys
    assert set(t.split('"intent": "')[1].split('"')[0] for t in answers) == set(L.INTENTS)  # no screen content


def test_drawn_answers_point_at_what_is_drawn():
    """The warm start's points lie on drawn pixels only, every drawn pixel alike: a 140x84 screen
    (the size the model sees) of wallpaper with a 20x10 white box and a 10x5 dark one has
    200 + 50 = 250 drawn pixels, 200 of them in the white box."""
    from PIL import Image, ImageDraw
    im = Image.new("RGB", (140, 84), (47, 95, 143))
    d = ImageDraw.Draw(im)
    d.rectangle([10, 20, 29, 29], fill="white")
    d.rectangle([100, 50, 109, 54], fill="black")
    px = L.drawn_pixels(im, (140, 84))
    assert len(px) == 250 and ((px[:, 0] < 30) & (px[:, 1] < 30)).sum() == 200
    answers = L.drawn_answers(600, im, (140, 84), random.Random(0))
    pts = [tuple(map(int, t.split("(")[1].split(")")[0].split(", "))) for t in answers]
    assert all((10 <= x <= 29 and 20 <= y <= 29) or (100 <= x <= 109 and 50 <= y <= 54) for x, y in pts)
    in_white = sum(x < 30 for x, _ in pts) / len(pts)
    assert 0.72 < in_white < 0.88  # 200/250 = 0.8: by area, not one box per thing
    assert Counter(t.split('"action": "')[1].split("(")[0] for t in answers) == {k: 100 for k in L.KINDS}
    assert all(parse_action(t, "explore", (1280, 720), (140, 84)) is not None for t in answers)


def test_permutation_p_by_hand():
    # after [1, 1] vs before [0, 0]: of the C(4, 2) = 6 ways to pick the "after" pair from the pooled
    # [1, 1, 0, 0], only {1, 1} reaches the observed difference 1 -> p = 1/6.
    assert abs(L.permutation_p([1, 1], [0, 0], n=20000) - 1 / 6) < 0.01
    # The other way round, every relabeling is at least the observed -1: p = (n + 1) / (n + 1) = 1.
    assert L.permutation_p([0, 0], [1, 1], n=100) == 1.0
    # 12 vs 12 with no overlap: 1 / C(24, 12) = 3.7e-7, so only the observed labeling counts: 1 / (n + 1).
    assert L.permutation_p([3] * 12, [1] * 12, n=999) == 1 / 1000


def test_report_line_and_verdict(tmp_path, capsys):
    a = L.parser().parse_args(["--seeds", "2", "--out", str(tmp_path), "--minutes", "20"])
    summary = {"format": 0.9, "distinct_screens": 2.0, "windows": 0.1, "immediate": 0.1, "sequence": 0.1,
               "diversity": 0.2, "episodes": 2}

    def seed(s, x, y, p, minutes):
        return {"seed": s, "x": x, "y": y, "p": p, "seconds": minutes * 60, "iterations": 30, "load": (2.0, 2.0, 2.0),
                "random": summary, "before": summary, "after": dict(summary, format=0.8 + s / 10),
                "terms": {"total": (1.0, 1.5)}, "wx": [0, 0], "wy": [1, 2], "wr": [0, 1], "p_windows": 0.02,
                "p_windows_random": 0.04}
    # Means over seeds: before (1.5 + 1.0) / 2 = 1.25, after (2.5 + 3.0) / 2 = 2.75; the worst p; the lowest parse.
    results = [seed(0, [1, 2], [2, 3], 0.01, 15), seed(1, [1, 1], [3, 3], 0.03, 19)]
    assert L.report(results, a) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "learning_explore: before 1.25 after 2.75 gain +1.50 p 0.0300 parse 0.80 seeds 2: pass"
    assert json.loads((tmp_path / "learning_explore.json").read_text())["pass"] is True
    # One seed not significant, or over the time budget: FAIL.
    assert L.report([results[0], dict(results[1], p=0.2)], a) == 1
    assert L.report([results[0], dict(results[1], seconds=21 * 60)], a) == 1
    # Windows opened not above the warm start, or not above random actions, in one seed: FAIL.
    assert L.report([results[0], dict(results[1], p_windows=0.06)], a) == 1
    assert L.report([dict(results[0], p_windows_random=0.05), results[1]], a) == 1
    assert capsys.readouterr().out.strip().endswith("seeds 2: FAIL")


@pytest.mark.timeout(400)
def test_bench_end_to_end_smallest(tmp_path):
    """One seed through every stage at the smallest size: warm start (saved as a model folder that
    train_explore.py loads), the before-eval with its random baseline, one RL iteration, the
    after-eval of models/E1, the table and the last line; run twice, as a rerun is."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "learning_explore.py"), "--seeds", "1",
           "--out", str(tmp_path), "--vms", "1", "--steps", "1", "--eval-episodes", "1",
           "--iterations", "1", "--update-actor-delay", "0", "--warm-steps", "2", "--warm-screens", "2",
           "--rewards", "none,image,immediate"]
    for _ in range(2):  # the same command twice into one folder: a rerun starts afresh (it once refused)
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=190)
        assert p.returncode in (0, 1), p.stdout[-2000:] + p.stderr[-2000:]  # 1: FAIL, as expected of 1 iteration
        assert "no seed finished" not in p.stdout, p.stdout[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("learning_explore: before ") and last.endswith(("seeds 1: pass", "seeds 1: FAIL")), last
    seed = tmp_path / "seed0"
    assert (seed / "warm" / "config.json").exists() and (seed / "rl" / "models" / "E1" / "config.json").exists()
    before = json.loads((seed / "before" / "eval.json").read_text())
    assert before["policy"]["summary"]["episodes"] == 1 and before["random"]["summary"]["episodes"] == 1
    assert "random" not in json.loads((seed / "after" / "eval.json").read_text())
    assert (seed / "before" / "trajectories" / "it000000" / "vm00.jsonl").exists()
    saved = json.loads((tmp_path / "learning_explore.json").read_text())
    assert saved["headline"] == "distinct_screens" and len(saved["results"][0]["y"]) == 1
