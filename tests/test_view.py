"""Tests for view.py (the static HTML report of a run) and plumbing/progress.py (bars, console lines, trackers).

Run: python -m pytest -q tests/test_view.py        (about a minute on 2 CPU cores)

Reports are built from REAL smoke runs of both train scripts (subprocesses on real Xvfb desktops
with the tiny real Qwen2.5-VL class), loaded in headless Chromium (Debian's `chromium`, which
setup.sh installs), and checked on the rendered page: --dump-dom gives the DOM after the page's own
script ran (selectors applied, images given their src), --screenshot gives the pixels.
The random tiny model almost never writes a well-formed answer, so the explore run uses it after a
few seconds of SFT on valid exploration answers (as tests/test_train_explore.py does): a real model
of the real class whose steps carry real actions to draw. The ARPO run uses the raw tiny model
(every answer a format failure; --no-stop-on-format-error lets each episode go on for 2 steps).
A doctored copy of the ARPO run then holds one step of every action kind and the leftovers of a run
killed mid-write (torn lines, a missing screenshot, screenshots without lines, no args.json).
"""
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
import model as M
from plumbing import progress
import view
from model import encode_chat, explore_messages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROME = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DESKTOP_BLUE = (47, 95, 143)  # the local desktop's background (vm_server.py --xvfb)
SMALL = ["--max-pixels", "12544", "--max-new-tokens", "40"]  # 140x84 images for the model: fast


def run_script(script: str, *argv, timeout=240):
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, argv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def speaking_tiny(path: str) -> str:
    """The tiny random Qwen2.5-VL after a short SFT on valid explore answers of six action kinds."""
    torch.set_num_threads(1)
    policy = M.load_policy("tiny", max_pixels=12544, seed=0)
    enc = encode_chat(policy, explore_messages(Image.new("RGB", (1280, 720), DESKTOP_BLUE)))
    w, h = enc.image_sizes[0]  # (140, 84): the model's coordinates live in this image
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(0)
    kinds = ["Click(%d, %d)", "DoubleClick(%d, %d)", "RightClick(%d, %d)", "Move(%d, %d)", "ScrollDown(%d, %d)",
             'Text(%d, %d, \\"hi\\")']

    def answer():
        act = rng.choice(kinds) % (rng.randrange(10, w - 10), rng.randrange(10, h - 10))
        text = '{"intent": "%s", "action": "%s"}' % (rng.choice(["Open the file manager", "See this menu"]), act)
        return policy.tokenizer(text, add_special_tokens=False).input_ids + [im_end]
    opt = torch.optim.AdamW(policy.model.parameters(), lr=5e-3)
    for _ in range(60):
        grpo.distill_step(policy, opt, [grpo.step_sample(enc, answer()) for _ in range(8)])
    M.save_policy(policy, path)
    return path


@pytest.fixture(scope="module")
def explore_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explore")
    speaker = speaking_tiny(str(tmp / "model"))
    run_script("train_explore.py", "--vms", 2, "--model", speaker, "--iterations", 2, "--steps", 3,
               "--update-actor-delay", 0, "--rewards", "no_text,no_intent,no_intent_click", "--settle", 0.3,
               "--threads", 1, "--runs-dir", tmp, "--run-name", "run", *SMALL)
    # and an exploration eval of the same model (its own folder: eval.json, policy vs random actions)
    run_script("train_explore.py", "--eval-only", "--vms", 2, "--model", speaker, "--steps", 1, "--eval-episodes", 2,
               "--settle", 0.3, "--threads", 1, "--runs-dir", tmp, "--run-name", "eval", *SMALL)
    return str(tmp / "run")


@pytest.fixture(scope="module")
def arpo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arpo")
    run_script("train_arpo.py", "--vms", 2, "--group-size", 2, "--model", "tiny", "--iterations", 2, "--max-steps", 2,
               "--no-stop-on-format-error", "--settle", 0.2, "--runs-dir", tmp, "--run-name", "run", *SMALL)
    # + an evaluation of its checkpoint (eval_it000002.json in the run folder)
    run_script("train_arpo.py", "--eval-only", "--resume", tmp / "run", "--max-steps", 1,
               "--task-ids", "calc-open,clock-open", *SMALL)
    return str(tmp / "run")


# -----------------------------------------------------------------------------------------------
# Headless Chromium and reading what it rendered


def chromium(tmp, url: str, *mode: str) -> subprocess.CompletedProcess:
    assert CHROME, "headless Chromium is needed: apt-get install chromium (setup.sh installs it)."
    profile = tmp / f"profile{random.randrange(10**9)}"
    cmd = [CHROME, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=10000", *mode, url]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p


def dump_dom(tmp, report: str, hash_: str = "") -> str:
    return chromium(tmp, f"file://{os.path.abspath(report)}{hash_}", "--dump-dom").stdout


def shown(dom: str) -> dict:
    """What the rendered page shows, read from the DOM by this test (not by the page's own counts):
    per visible trajectory its step count, its <img> srcs and its drawn action kinds."""
    out = {"steps": 0, "srcs": [], "acts": [], "noshot": 0, "orphans": 0}
    for sec in re.split(r'(?=<section class="iter")', dom)[1:]:
        if "hidden" in sec[:sec.index(">")]:
            continue
        for traj in re.split(r'(?=<div class="traj")', sec)[1:]:
            if "hidden" in traj[:traj.index(">")]:
                continue
            out["steps"] += traj.count('<div class="step">')
            out["srcs"] += re.findall(r'<img [^>]*(?<![-\w])src="([^"]+)"', traj)
            out["acts"] += re.findall(r'<g class="act" data-type="(\w+)"', traj)
            out["noshot"] += traj.count('class="noshot"')
            out["orphans"] += traj.count("no trajectory line for this screenshot")
    return out


def body(dom: str) -> dict:
    """The <body data-*> counts the page's script keeps (images loaded per the browser itself)."""
    tag = re.search(r"<body[^>]*>", dom).group(0)
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', tag))


def curves(dom: str) -> dict:
    """{metric key: number of points} of every chart line, checked against the path's own d."""
    out = {}
    for key, n, d in re.findall(r'<path class="curve" data-key="([^"]+)" data-points="(\d+)" d="([^"]+)"', dom):
        assert len(re.findall(r"[ML]-?[\d.]+,-?[\d.]+", d)) == int(n), (key, d)
        out.setdefault(key, int(n))
    return out


def trajectory_lines(run: str) -> list[dict]:
    lines = []
    for it in sorted(os.listdir(os.path.join(run, "trajectories"))):
        folder = os.path.join(run, "trajectories", it)
        for name in sorted(f for f in os.listdir(folder) if f.endswith(".jsonl")):
            with open(os.path.join(folder, name)) as f:
                lines += [dict(json.loads(x), it=it) for x in f]
    return lines


# -----------------------------------------------------------------------------------------------
# The two real runs, rendered


def test_explore_report_renders_every_step_image_action_and_curve(explore_run, tmp_path):
    out = tmp_path / "report"
    report = view.build_report(explore_run, str(out))  # --out elsewhere: the screenshots are copied
    lines = trajectory_lines(explore_run)
    assert len(lines) == 12  # 2 iterations x 2 desktops x 3 steps
    assert len(list(out.glob("trajectories/it*/vm*_step*.png"))) == 12

    dom = dump_dom(tmp_path, report, "#it=all&vm=all")
    s, b = shown(dom), body(dom)
    assert s["steps"] == 12 and len(s["srcs"]) == 12 and s["noshot"] == 0
    assert all(src.startswith("trajectories/it") for src in s["srcs"])  # relative: the folder travels
    assert b["kind"] == "explore" and b["steps-shown"] == "12"
    assert b["img-shown"] == b["img-loaded"] == "12" and b["img-broken"] == "0"  # the browser decoded all 12
    # each step's drawing is its action's kind, in file order ("none" = a format failure)
    assert s["acts"] == [(x["action"] or {}).get("type", "none") for x in lines]
    assert any(a != "none" for a in s["acts"]), "the fine-tuned tiny model should have acted at least once"
    c = curves(dom)
    for key in ("reward/total", "reward/format", "reward/image_immediate", "wm/loss", "actor/kl",
                "actor/clip_low", "actor/clip_high", "time/iteration", "time/vm_wait", "vm_wait_share"):
        assert c.get(key) == 2, (key, c.get(key))  # one point per logged iteration

    # Default view: the last iteration only; the hash picks an iteration and a desktop.
    assert shown(dump_dom(tmp_path, report))["steps"] == 6
    assert shown(dump_dom(tmp_path, report, "#it=0&vm=1"))["steps"] == 3

    shot = tmp_path / "page.png"
    chromium(tmp_path, f"file://{report}#it=1&vm=all", f"--screenshot={shot}", "--window-size=1280,2400")
    px = np.asarray(Image.open(shot).convert("RGB")).astype(int)  # (H, W, 3)
    assert px.std() > 30  # not a blank page
    # The screenshots really are on the page: the desktop's blue covers a good part of it (each
    # rendered screenshot is ~640x360 = 230k pixels of mostly that blue; 6 are in view).
    blue = int((np.abs(px - np.array(DESKTOP_BLUE)).max(axis=2) <= 3).sum())
    assert blue > 400_000, blue

    # The eval-only folder: no metrics; the eval table (policy vs random actions) and the policy's
    # eval episodes (--eval-save), one step on each of the 2 desktops.
    dom = dump_dom(tmp_path, view.build_report(os.path.join(os.path.dirname(explore_run), "eval")))
    assert "eval.json: exploration, per episode" in dom and "No trajectories saved yet." not in dom
    assert shown(dom)["steps"] == 2
    # One row per chooser, one numeric cell per metric of eval.json (at least the original seven).
    assert re.search(r"<tr><td>policy</td>(<td>[\d.e-]+</td>){7,}</tr><tr><td>random</td>", dom)


def test_arpo_report_shows_episodes_scores_and_curves(arpo_run, tmp_path):
    report = view.build_report(arpo_run)  # default: report.html in the run folder, screenshots in place
    assert report == os.path.join(arpo_run, "report.html")
    lines = trajectory_lines(arpo_run)
    steps = [x for x in lines if not x.get("final")]
    finals = [x for x in lines if x.get("final")]
    assert len(steps) == 8 and len(finals) == 4  # 2 iterations x 2 desktops x (2 steps + a final line)

    dom = dump_dom(tmp_path, report, "#it=all&vm=all")
    s, b = shown(dom), body(dom)
    assert b["kind"] == "arpo" and s["steps"] == 8 and b["img-loaded"] == "8" and b["img-broken"] == "0"
    assert s["acts"] == ["none"] * 8  # the random model never parses: each step says so on its screenshot
    assert dom.count("<b>episode end</b>") == 4
    for f in finals:  # the task's instruction heads its episode (the browser writes a text node's quotes as they are)
        assert view.esc(f["instruction"]).replace("&#x27;", "'").replace("&quot;", '"') in dom
    assert dom.count(">format_penalty</th><td>-0.5</td>") == 4
    assert "eval_it000002.json: success rate, 2 episodes (0 lost)" in dom
    assert re.search(r"<tr><td>calc-open</td><td>[\d.]+</td><td>[\d.]+</td></tr>.*<tr><td>overall</td>", dom)
    c = curves(dom)
    for key in ("reward_mean", "score_mean", "success_rate", "format_rate", "actor/kl", "actor/clip_low", "actor/clip_high"):
        assert c.get(key) == 2, (key, c.get(key))


# -----------------------------------------------------------------------------------------------
# Every action kind, and a run killed mid-write


KINDS = [
    {"type": "click", "x": 100, "y": 100}, {"type": "double_click", "x": 1270, "y": 20},
    {"type": "right_click", "x": 640, "y": 360}, {"type": "move", "x": 5, "y": 715},
    {"type": "drag", "x": 100, "y": 600, "x2": 700, "y2": 300}, {"type": "scroll", "x": 1279, "y": 360, "direction": "up", "amount": 3},
    {"type": "scroll", "direction": "left"}, {"type": "type", "x": 300, "y": 200, "text": "<b>hi & bye</b>"},
    {"type": "type", "text": "no point"}, {"type": "key", "keys": ["ctrl", "s"]}, {"type": "wait"},
    {"type": "done"}, {"type": "fail"}, {"type": "key", "keys": ["nosuchkey"], "refused": "unknown key 'nosuchkey'"},
    None,
]


def test_every_action_kind_and_a_killed_run(arpo_run, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(arpo_run, run, ignore=shutil.ignore_patterns("ckpt", "report.html"))
    folder = run / "trajectories" / "it000000"
    png = (folder / "vm00_step00.png").read_bytes()
    with open(folder / "vm00.jsonl", "w") as f:
        for i, act in enumerate(KINDS):
            (folder / f"vm00_step{i:02d}.png").write_bytes(png)
            f.write(json.dumps({"step": i, "task": "t", "thought": f"thought {i}", "text": "x", "format_ok": act is not None,
                                "action": act, "screenshot": f"vm00_step{i:02d}.png"}) + "\n")
        f.write('{"step": 99, "thou')  # torn last line: the kill came mid-write
    (folder / "vm00_step03.png").unlink()  # a screenshot gone: a grey box, the action still drawn
    (folder / "vm00_step40.png").write_bytes(png)  # a screenshot whose line never got written
    late = run / "trajectories" / "it000002"
    late.mkdir()
    (late / "vm01_step00.png").write_bytes(png)  # an iteration killed before any line
    (run / "args.json").unlink()  # run type from metrics + final lines alone
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 2, "reward_me')

    report = view.build_report(str(run))
    dom = dump_dom(tmp_path, report, "#it=all&vm=all")
    s, b = shown(dom), body(dom)
    assert b["kind"] == "arpo"
    want = [(a or {}).get("type", "none") for a in KINDS]
    assert s["acts"] == want + ["none"] * (2 + 4)  # vm01 of it 0 + both VMs of it 1: format failures
    assert s["steps"] == len(KINDS) + 1 + 2 + 4 + 1  # + orphan it0 + vm01 it0 + it1 + orphan it2
    assert s["noshot"] == 1 and s["orphans"] == 2
    assert b["img-loaded"] == str(len(s["srcs"])) and b["img-broken"] == "0"
    assert "&lt;b&gt;hi &amp; bye&lt;/b&gt;" in dom and "<b>hi & bye" not in dom  # model text is escaped
    assert ">ctrl+s</text>" in dom and "refused: unknown key" in dom
    assert "no metrics line for this iteration" in dom  # it 2: its torn line was skipped
    assert curves(dom)["success_rate"] == 2


def test_action_geometry_by_hand():
    # 1280x720: one unit u = 1280 / 100 = 12.8 px; a click ring has r = 1.8u = 23.04 -> "23"
    svg = view.action_svg({"type": "click", "x": 640, "y": 360}, 1280, 720)
    assert '<circle cx="640" cy="360" r="23"' in svg and 'data-type="click"' in svg
    # drag (100,100) -> (300,100): head length 2.5u = 32 at +-0.45 rad from the shaft:
    # x = 300 - 32 cos(0.45) = 300 - 28.81 = 271.19 -> 271; y = 100 -+ 32 sin(0.45) = 100 -+ 13.92 -> 86 / 114
    svg = view.action_svg({"type": "drag", "x": 100, "y": 100, "x2": 300, "y2": 100}, 1280, 720)
    assert '<line x1="100" y1="100" x2="300" y2="100"' in svg and 'points="300,100 271,86 271,114"' in svg
    # scroll down without a point: from the screen centre, 10u = 128 px down: (640,360) -> (640,488)
    assert '<line x1="640" y1="360" x2="640" y2="488"' in view.action_svg({"type": "scroll", "direction": "down"}, 1280, 720)
    for bad in (None, "click", {"type": "explode"}, {"type": "click", "x": "a", "y": [1]}):
        assert view.action_svg(bad, 1280, 720).startswith('<g class="act" data-type="')  # never raises


def test_chart_and_series_by_hand():
    # 340x170 with margins L46 R8 T22 B22: x 0..10 -> 46..332 (286 wide), y 0..1 -> 148..22 (126 high)
    svg = view.chart_svg("t", {"a": [(0, 0.0), (10, 1.0)]})
    assert 'd="M46.0,148.0 L332.0,22.0"' in svg
    # a flat series (5, 5) is drawn mid-height: the range widens to 4..6, so y = 148 - 0.5 * 126 = 85
    assert 'd="M46.0,85.0 L332.0,85.0"' in view.chart_svg("t", {"a": [(0, 5.0), (10, 5.0)]})
    m = [{"iteration": 3, "a": 1, "b": None, "c": [1], "d": {"e": 2}, "f": "x", "g": float("nan"), "h": True}]
    assert view.numeric_series(m) == {"a": [(3, 1.0)], "d/e": [(3, 2.0)]}


def test_reward_charts_follow_what_the_run_logged_and_old_keys_are_read(tmp_path):
    # The "reward components" chart holds every reward/<term> of the metrics, in the order logged
    # (a term added to rewards.TERMS shows up with no edit here); total and format have their own.
    m = [{"iteration": 0, "reward/total": 1.0, "reward/format": 1.0, "reward/image_immediate": 0.5,
          "reward/windows": 2.0, "wm/loss": 0.1}]
    heads = dict(view.headline("explore", view.numeric_series(m)))
    assert heads["reward components"] == ["reward/image_immediate", "reward/windows"]
    assert heads["total reward"] == ["reward/total"] and heads["format reward"] == ["reward/format"]
    html = view.charts_html("explore", m)
    assert 'data-key="reward/windows"' in html and "every other metric (0)" in html
    # an ARPO run written before the groups with no learning signal were called flat_groups
    run = tmp_path / "old"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"group_size": 2}))
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "zero_std_groups": 1, "success_rate": 0.5}) + "\n")
    loaded = view.load_run(str(run))
    assert loaded["metrics"][0]["flat_groups"] == 1 and "zero_std_groups" not in loaded["metrics"][0]
    assert 'data-key="flat_groups"' in view.charts_html("arpo", loaded["metrics"])


def test_cli_one_sentence_errors(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "view.py"), str(tmp_path / "nope")], capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip().endswith("pass a run folder such as runs/<name>.")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "view.py"), str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "holds no args.json" in p.stderr


# -----------------------------------------------------------------------------------------------
# plumbing/progress.py


def test_bars_say_and_scalars(capsys):
    out = io.StringIO()  # not a terminal: no bar unless asked for
    with progress.bar(3, "rollout", file=out) as pb:
        pb.update(1)
    assert out.getvalue() == ""
    with progress.bar(3, "rollout", enabled=True, file=out) as pb:
        pb.update(1), pb.set_postfix_str("2 vms")
    assert "rollout" in out.getvalue() and "/3" in out.getvalue()
    assert progress.track(range(3), "x", enabled=False) == range(3)  # off: the iterable itself
    assert list(progress.track(range(3), "x", enabled=True)) == [0, 1, 2]
    progress.say("it    0 | reward 0.5")
    assert capsys.readouterr().out == "it    0 | reward 0.5\n"
    m = {"iteration": 0, "reward/total": 0.5, "wm": {"loss": 2}, "tasks": ["a"], "kl": None, "x": float("inf")}
    assert progress.scalars(m) == {"iteration": 0.0, "reward/total": 0.5, "wm/loss": 2.0}


def test_trackers_are_optional_imports(tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="pip install tensorboard"):
            progress.open_trackers(str(tmp_path), {}, tensorboard=True)
    else:  # installed: the numbers go in and come back out of the event file
        tr = progress.open_trackers(str(tmp_path), {}, tensorboard=True)
        for it in range(2):
            progress.log(tr, {"iteration": it, "reward/total": 0.5 * it, "groups": [{"n": 2}]}, step=it)
        progress.close(tr)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        ea = EventAccumulator(str(tmp_path / "tb"))
        ea.Reload()
        assert [(e.step, e.value) for e in ea.Scalars("reward/total")] == [(0, 0.0), (1, 0.5)]
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="pip install wandb"):
            progress.open_trackers(str(tmp_path), {}, wandb=True)
    assert progress.open_trackers(str(tmp_path), {}) == progress.Trackers()  # none asked: nothing imported
