"""Tests for train_explore.py (ScreenExplorer): subprocess runs on real local Xvfb desktops with the
tiny real Qwen2.5-VL class on the CPU, plus hand-computed checks of the script's own formulas.

Run: python -m pytest -q tests/test_train_explore.py        (about 3 minutes on 2 CPU cores)

The random tiny model almost never writes a well-formed answer, so nearly every step would be a
format failure (reward 0, nothing executed) and the rewards, the world model and distillation would
see nothing. The module fixture `speaker` therefore fine-tunes the tiny model for a few seconds on
valid exploration answers (grpo.distill_step, the same SFT the script uses): a real model of the
real class that answers `{"intent": ..., "action": "Click(x, y)"}` most of the time and malformed
text sometimes, so every run sees both kinds of step.
"""
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import grpo
import model as M
import rewards as R
import train_explore as T
from env import VMPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_explore.py")
# Small screenshots for the model (140x84 -> 15 visual tokens), short answers, a short settle.
FAST = ["--max-pixels", "12544", "--max-new-tokens", "40", "--settle", "0.3", "--threads", "1", "--update-actor-delay", "0"]
KEYS = ["reward/total", "reward/format"] + [f"reward/{c}" for c in R.COMPONENTS]


def speaking_tiny(path: str, max_pixels: int = 12544, steps: int = 70, seed: int = 0) -> str:
    """The tiny random Qwen2.5-VL, SFT'd on random valid explore answers, saved to `path`."""
    torch.set_num_threads(1)  # next to the desktops of other tests, more threads run slower
    policy = M.load_policy("tiny", max_pixels=max_pixels, seed=seed)
    enc = M.encode_chat(policy, M.explore_messages(Image.new("RGB", (1280, 720), (48, 96, 144))))
    w, h = enc.image_sizes[0]
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(seed)

    def answer():
        text = '{"intent": "%s", "action": "%s(%d, %d)"}' % (
            rng.choice(["Open the file manager", "See what this menu does"]),
            rng.choice(["Click", "DoubleClick", "RightClick"]), rng.randrange(10, min(w, 100)), rng.randrange(10, min(h, 100)))
        return policy.tokenizer(text, add_special_tokens=False).input_ids + [im_end]

    opt = torch.optim.AdamW(policy.model.parameters(), lr=5e-3)
    for _ in range(steps):
        grpo.distill_step(policy, opt, [grpo.step_sample(enc, answer()) for _ in range(8)])
    M.save_policy(policy, path)
    return path


@pytest.fixture(scope="module")
def speaker(tmp_path_factory):
    return speaking_tiny(str(tmp_path_factory.mktemp("speaker") / "model"))


def run(*argv, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *map(str, argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights_differ(folder_a, folder_b) -> float:
    a, b = load_file(os.path.join(folder_a, "model.safetensors")), load_file(os.path.join(folder_b, "model.safetensors"))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -----------------------------------------------------------------------------------------------
# End to end


def test_smoke_then_resume(speaker, tmp_path):
    rd = tmp_path / "smoke"
    p = ok(run("--vms", 2, "--model", speaker, "--iterations", 2, "--steps", 2, "--run-name", rd, *FAST))
    assert json.loads((rd / "args.json").read_text())["steps"] == 2
    lines = metrics(rd)
    assert [m["iteration"] for m in lines] == [0, 1]
    for m in lines:
        assert all(k in m for k in KEYS + ["wm/loss", "actor/kl", "actor/clip_low", "actor/clip_high",
                                           "time/generate", "time/screenshot", "time/act", "time/update"]), m.keys()
        assert m["actor/updated"] == 1 and m["vms"] == 2 and m["steps"] == 4
    assert sum(line.startswith("it ") for line in p.stdout.splitlines()) == 2  # one console line per iteration
    # Trajectories: one PNG + one JSON line per step, and each line's reward is its components'
    # sum times the format reward (what rewards.py defines), i.e. the rows were put back in place.
    steps = []
    for it in (0, 1):
        for vm in (0, 1):
            folder = rd / "trajectories" / f"it{it:06d}"
            rows = [json.loads(x) for x in (folder / f"vm{vm:02d}.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1]
            for r in rows:
                assert (folder / r["screenshot"]).exists() and set(r["rewards"]) == {"format", *R.COMPONENTS}
                want = r["rewards"]["format"] * sum(r["rewards"][c] for c in R.COMPONENTS)
                assert abs(r["reward"] - want) < 1e-4 and r["valid"] == (r["rewards"]["format"] == 1.0)
            steps += rows
    assert any(s["valid"] and s["reward"] > 0 for s in steps), "the speaker produced no valid step"
    assert (rd / "ckpt" / "COMPLETE").exists() and (rd / "ckpt" / "policy" / "config.json").exists()

    p = ok(run("--resume", rd, "--iterations", 3))
    assert "resumed" in p.stdout
    assert [m["iteration"] for m in metrics(rd)] == [0, 1, 2]  # continues, nothing logged twice
    assert (rd / "trajectories" / "it000002" / "vm00.jsonl").exists()


def test_distillation_across_a_generation_boundary_and_no_world_model(speaker, tmp_path):
    rd = tmp_path / "distill"
    # Generation 1 alone, full fine-tuning (KL against a frozen copy), world model OFF: the
    # release silently stopped training the actor here; ours must still update it.
    common = ["--rewards", "all,no_world_model,no_text,no_intent,no_intent_click", "--lora-rank", 0, "--lr", 1e-3]
    ok(run("--vms", 2, "--model", speaker, "--generations", 1, "--iterations-per-generation", 1, "--steps", 3,
           "--run-name", rd, *common, *FAST))
    m0 = metrics(rd)[0]
    assert m0["actor/updated"] == 1 and m0["actor/tokens"] > 0 and m0["actor/grad_norm"] > 0
    assert m0["reward/image_world_model"] == 0.0 and m0["wm/loss"] is None
    assert weights_differ(speaker, rd / "models" / "E1") > 0  # the update really moved the weights
    data = [json.loads(x) for x in (rd / "distill" / "gen1.jsonl").read_text().splitlines()]
    assert data and all((rd / "distill" / d["image"]).exists() for d in data)
    # The kept steps are the best ceil(0.3 * valid) of generation 1.
    traj = [json.loads(x) for f in sorted((rd / "trajectories" / "it000000").glob("*.jsonl")) for x in f.read_text().splitlines()]
    valid = sorted((s["reward"] for s in traj if s["valid"]), reverse=True)
    assert [d["reward"] for d in data] == valid[:-(-3 * len(valid) // 10)]

    # Resumed with a second generation: E2 starts from the base model fine-tuned on gen1's data.
    p = ok(run("--resume", rd, "--generations", 2))
    lines = metrics(rd)
    assert [(m["iteration"], m["generation"]) for m in lines] == [(0, 1), (1, 2)]
    assert lines[1]["distill/samples"] == len(data) and lines[1]["distill/nll_first"] > 0
    assert "E2: SFT on" in p.stdout
    assert weights_differ(speaker, rd / "models" / "E2_sft") > 0
    assert (rd / "models" / "E2" / "config.json").exists() and (rd / "distill" / "gen2.jsonl").exists()


def test_eval_only_reports_diversity(tmp_path):
    rd = tmp_path / "eval"
    p = ok(run("--eval-only", "--vms", 2, "--model", "tiny", "--eval-episodes", 3, "--steps", 2, "--run-name", rd, *FAST))
    report = json.loads((rd / "eval.json").read_text())
    for who in ("policy", "random"):
        s = report[who]["summary"]
        assert s["episodes"] == 3 and len(report[who]["episodes"]) == 3
        assert 1 <= s["distinct_screens"] <= 3 and s["distinct_screens_all"] >= 1  # s_0 + 2 after-screens
    assert report["random"]["summary"]["format"] == 1.0  # random actions are always well formed
    assert "policy" in p.stdout and "random" in p.stdout and "screens/ep" in p.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, says", [
    (["--bogus", "1"], "unrecognized arguments"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--rewards", "all,no_such_term"], "Unknown reward component"),
    (["--vms", "http://127.0.0.1:{port}", "--model", "tiny"], "None of the 1 VM(s) answered"),
])
def test_user_errors_end_in_one_sentence(argv, says, tmp_path):
    argv = [a.format(port=_free_port()) for a in argv] + ["--run-name", str(tmp_path / "x")]
    p = run(*argv, timeout=120)
    assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x").exists()  # nothing half-made left behind


# -----------------------------------------------------------------------------------------------
# A desktop that dies mid-iteration drops out; the others go on (real desktops, real HTTP)


def test_dead_desktop_drops_out_of_the_rollout():
    pool = VMPool(2, timeout=10)
    try:
        args = T.Args(steps=3, settle=0.1)
        base = T.random_chooser(random.Random(0))

        def choose(images):
            if len(images) == 2 and calls:  # second step: desktop 1 dies before its action lands
                pool.local[1].stop()
            calls.append(len(images))
            return base(images)

        calls, live = [], {0, 1}
        buffer = T.rollout(pool, live, choose, args, {})
        assert live == {0}
        assert [(s.vm, s.t) for s in buffer] == [(0, 0), (1, 0), (0, 1), (0, 2)]
        assert calls == [2, 2, 1]  # one batched call per step; the dead desktop left after step 1
        assert all(s.after.size == (1280, 720) for s in buffer)
        live = {i for i, r in enumerate(pool.reset()) if r.ok}  # reset restarts the dead local desktop
        assert live == {0, 1}
    finally:
        pool.close()


# -----------------------------------------------------------------------------------------------
# The script's own formulas, by hand


def test_distinct_screens_greedy_clustering():
    # Rows (unit): a = (1, 0), b = (0.96, 0.28) [cos(a, b) = 0.96], c = (0, 1) [cos(a, c) = 0,
    # cos(b, c) = 0.28], a again. Threshold 0.95: a leads, b joins a (0.96 >= 0.95), c is new,
    # a joins a -> 2 screens. Threshold 0.97: b is new too -> 3.
    f = torch.tensor([[1.0, 0.0], [0.96, 0.28], [0.0, 1.0], [1.0, 0.0]])  # (4, 2)
    assert T.distinct_screens(f, 0.95) == 2
    assert T.distinct_screens(f, 0.97) == 3
    assert T.distinct_screens(f[:1], 0.95) == 1


def test_top_steps_keeps_the_best_fraction():
    steps = [{"reward": r, "id": i} for i, r in enumerate([0.5, 2.0, 1.0, 2.0, 0.1, 0.7, 0.9])]
    # 7 valid steps, top 0.3 -> ceil(2.1) = 3: rewards 2.0 (id 1), 2.0 (id 3, the tie keeps time
    # order), 1.0 (id 2).
    assert [s["id"] for s in T.top_steps(steps, 0.3)] == [1, 3, 2]
    assert len(T.top_steps(steps, 1.0)) == 7 and T.top_steps([], 0.3) == []
    assert [s["id"] for s in T.top_steps(steps, 0.01)] == [1]  # ceil keeps at least one


def test_parse_window_titles():
    assert T.parse_window_titles("windows: ['xterm', 'galculator']") == ["xterm", "galculator"]
    assert T.parse_window_titles('windows: ["it\'s a file", \'Mousepad\']') == ["it's a file", "Mousepad"]
    assert T.parse_window_titles("windows: []") == [] and T.parse_window_titles("") == []
