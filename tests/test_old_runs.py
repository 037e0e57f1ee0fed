"""Run folders written before the shared checkpoint format still resume, in both train scripts.

    python -m pytest -q tests/test_old_runs.py

tests/fixtures/old_runs/ holds two run folders written by the train scripts of commit 1c55b86
(one iteration each, the tiny model with LoRA rank 4, two local desktops; the bulky files a resume
does not read left out): train_arpo.py's checkpoint has `iteration` = the next iteration and the
adapter as named parameters (`trainable`); train_explore.py's has `iteration` = the last one done
and `save_every` in its args. Each is resumed for one more iteration by today's script.

The saved adapter's lora_B is shifted by +0.5 before the resume: a fresh adapter starts with
lora_B = 0, so a resume that dropped the saved weights ends ~0.5 away from them, while a resume
that kept them moves them by at most a few learning rates.
"""
import json
import os
import shutil
import subprocess
import sys

import torch

from plumbing import ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = os.path.join(ROOT, "tests", "fixtures", "old_runs")


def _copy_with_shifted_adapter(name: str, tmp_path, key: str) -> tuple[str, dict]:
    run = str(tmp_path / name)
    shutil.copytree(os.path.join(OLD, name), run)
    path = os.path.join(run, "ckpt", "state.pt")
    state = torch.load(path, weights_only=False)
    for k, v in state[key].items():
        if "lora_B" in k:
            state[key][k] = v + 0.5
    torch.save(state, path)
    # peft's own naming (what the shared format stores): the adapter name dropped from the keys
    return run, {k.replace(".default", ""): v for k, v in state[key].items()}


def _resume(script: str, run: str) -> str:
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--resume", run, "--iterations", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _steps(optimizer_state: dict) -> int:
    return int(max(float(v["step"]) for v in optimizer_state["state"].values()))


def _check(run: str, out: str, old: dict, old_state: dict, lr: float):
    assert f"resumed {run} at iteration 1" in out
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["iteration"] for m in lines] == [0, 1]  # the old line kept, the new one appended once
    state, _ = ckpt.load_checkpoint(run)
    assert state["next_iteration"] == 2 and "trainable" not in state
    steps = _steps(state["optimizer"]) - _steps(old_state["optimizer"])
    assert steps == lines[1]["actor/steps"] >= 1  # the optimizer went on from its saved step count
    new = state["adapter"]
    assert sorted(new) == sorted(old)
    # Adam moves each weight by about lr per step (5 lr: room for its bias correction)
    drift = max(float((new[k] - old[k]).abs().max()) for k in new)
    assert drift <= 5 * lr * steps + 1e-7, drift
    return lines


def test_an_old_arpo_run_resumes(tmp_path):
    run, old = _copy_with_shifted_adapter("arpo_lora", tmp_path, "trainable")
    old_state = torch.load(os.path.join(run, "ckpt", "state.pt"), weights_only=False)
    assert old_state["iteration"] == 1 and "next_iteration" not in old_state  # the old format
    out = _resume("train_arpo.py", run)
    lines = _check(run, out, old, old_state, lr=1e-6)
    assert "actor/kl" in lines[1] and "time/iteration" in lines[1] and "kl" in lines[0]


def test_an_old_explore_run_resumes(tmp_path):
    run, old = _copy_with_shifted_adapter("explore_lora", tmp_path, "adapter")
    old_state = torch.load(os.path.join(run, "ckpt", "state.pt"), weights_only=False)
    assert old_state["iteration"] == 0 and "save_every" in json.load(open(os.path.join(run, "args.json")))
    out = _resume("train_explore.py", run)
    lines = _check(run, out, old, old_state, lr=4e-5)
    assert lines[1]["generation"] == 1
    assert json.load(open(os.path.join(run, "args.json")))["ckpt_every"] == 1  # the renamed flag, carried over
