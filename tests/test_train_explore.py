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
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import grpo
import model as M
import rewards as R
from plumbing import logs, rundir
import train_explore as T
from train_explore import top_steps
from model import encode_chat, explore_messages
from env import VMPool
from conftest import free_port, kill_x_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_explore.py")
# Small screenshots for the model (140x84 -> 15 visual tokens), short answers, a short settle.
FAST = ["--max-pixels", "12544", "--max-new-tokens", "40", "--settle", "0.3", "--threads", "1", "--update-actor-delay", "0"]
KEYS = ["reward/total", "reward/format"] + [f"reward/{c}" for c in R.COMPONENTS]


def speaking_tiny(path: str, max_pixels: int = 12544, steps: int = 70, seed: int = 0) -> str:
    """The tiny random Qwen2.5-VL, SFT'd on random valid explore answers, saved to `path`."""
    torch.set_num_threads(1)  # next to the desktops of other tests, more threads run slower
    policy = M.load_policy("tiny", max_pixels=max_pixels, seed=seed)
    enc = encode_chat(policy, explore_messages(Image.new("RGB", (1280, 720), (48, 96, 144))))
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


def trainer(flags, wm=None, opt=None):
    """The trainer's state for scoring alone: no desktops, no policy."""
    return T.Trainer(args=T.Args(), pool=None, run=None, policy=None, optimizer=None, start_model="", ref_fn=None,
                     generation=1, wm=wm, wm_opt=opt, reward_flags=flags, tools=None)


def scored(tr, buffer, a=None):
    """The trainer's rewards of a buffer as its iteration computes them, in one process: the
    format-valid steps' features -> the world model's guesses (then it learns) -> every term."""
    a = a or T.Args()
    valid = [s for s in buffer if s.format_ok]
    f = T.step_features(tr, valid)
    pred_s, pred_t, m = T.predict_and_learn(tr, f, [s.parsed.action for s in valid], a)
    return T.step_rewards(tr, buffer, f, pred_s, pred_t), m


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
    p = ok(run("--vms", 2, "--model", speaker, "--iterations", 2, "--steps", 2, "--run-name", rd, "--lr-warmup", 2,
               "--lr-schedule", "linear", *FAST))
    assert json.loads((rd / "args.json").read_text())["steps"] == 2
    lines = metrics(rd)
    assert [m["iteration"] for m in lines] == [0, 1]
    for m in lines:
        assert all(k in m for k in KEYS + ["wm/loss", "actor/kl", "actor/clip_low", "actor/clip_high",
                                           "time/generation", "time/env", "time/vm_wait", "time/update"]), m.keys()
        assert m["actor/updated"] == 1 and m["vms"] == 2 and m["steps"] == 4
        # The trainer scores the tokens as the sampler drew them (temperature, vision tokens off).
        assert m["actor/logp_gap"] < 1e-3, m["actor/logp_gap"]
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
    assert (rd / "ckpt" / "COMPLETE").exists()
    # The actor's and the world model's optimizers are the release's AdamW (betas 0.9, 0.95).
    state = torch.load(rd / "ckpt" / "state.pt", weights_only=False)
    # LoRA: the adapter alone, on top of the run's starting model; a resume starts at iteration 2
    assert state["next_iteration"] == 2 and state["adapter"] and state["start_model"] == speaker
    assert not (rd / "ckpt" / "policy").exists()
    assert {g["betas"] for k in ("optimizer", "wm_opt") for g in state[k]["param_groups"]} == {(0.9, 0.95)}
    # The warm-up (2 updates from lr / 2) is what the optimizer stepped with, and what was logged.
    assert [m["actor/lr"] for m in lines] == [2e-5, 4e-5] and state["optimizer"]["param_groups"][0]["lr"] == 4e-5

    p = ok(run("--resume", rd, "--iterations", 3))
    assert "resumed" in p.stdout
    assert [m["iteration"] for m in metrics(rd)] == [0, 1, 2]  # continues, nothing logged twice
    assert (rd / "trajectories" / "it000002" / "vm00.jsonl").exists()
    # --eval-only --resume: the checkpoint's policy, evaluated into the run's eval_it<N>/
    ok(run("--eval-only", "--resume", rd, "--episodes", 2, "--steps", 1, "--no-eval-random"))
    report = json.loads((rd / "eval_it000003" / "eval.json").read_text())
    assert report["policy"]["summary"]["episodes"] == 2 and "random" not in report
    assert [m["iteration"] for m in metrics(rd)] == [0, 1, 2]  # the run's own record untouched

    # This run handed to train_arpo.py's --resume: one sentence (not a KeyError), the run untouched.
    saved = (rd / "args.json").read_text()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_arpo.py"), "--resume", str(rd)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "not a train_arpo.py run" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and (rd / "args.json").read_text() == saved


def test_distillation_across_a_generation_boundary_and_no_world_model(speaker, tmp_path):
    rd = tmp_path / "distill"
    # Generation 1 alone, full fine-tuning (KL against a frozen copy), world model OFF: the
    # release silently stopped training the actor here; ours must still update it.
    common = ["--rewards", "all,no_world_model,no_text,no_intent,no_intent_click", "--lora-rank", 0, "--lr", 1e-3]
    ok(run("--vms", 2, "--model", speaker, "--generations", 1, "--iterations-per-generation", 1, "--steps", 2,
           "--run-name", rd, *common, *FAST))
    m0 = metrics(rd)[0]
    traj = [json.loads(x) for f in sorted((rd / "trajectories" / "it000000").glob("*.jsonl")) for x in f.read_text().splitlines()]
    valid = sorted((s["reward"] for s in traj if s["valid"]), reverse=True)
    assert m0["actor/updated"] == 1 and m0["actor/tokens"] > 0
    if valid[0] > valid[-1]:  # 4 clicks that all changed nothing tie at 0: every advantage is 0, no gradient
        assert m0["actor/grad_norm"] > 0
    assert m0["reward/image_world_model"] == 0.0 and m0["wm/loss"] is None
    assert weights_differ(speaker, rd / "models" / "E1") > 0  # the optimizer stepped (AdamW's decay at least)
    data = [json.loads(x) for x in (rd / "distill" / "gen1.jsonl").read_text().splitlines()]
    assert data and all((rd / "distill" / d["image"]).exists() for d in data)
    # The kept steps are the best ceil(0.3 * valid) of generation 1 (one iteration: ranked within it).
    assert [d["reward"] for d in data] == valid[:-(-3 * len(valid) // 10)]

    # Resumed with a second generation: E2 starts from the base model fine-tuned on gen1's data.
    p = ok(run("--resume", rd, "--generations", 2))
    lines = metrics(rd)
    assert [(m["iteration"], m["generation"]) for m in lines] == [(0, 1), (1, 2)]
    assert lines[1]["distill/samples"] == len(data) and lines[1]["distill/nll_first"] > 0
    assert "E2: SFT on" in p.stdout
    assert weights_differ(speaker, rd / "models" / "E2_sft") > 0  # the SFT moved the weights
    assert (rd / "models" / "E2" / "config.json").exists() and (rd / "distill" / "gen2.jsonl").exists()

    # A third generation with --distill-epochs 0 tells the starting point apart: a generation that
    # started from the previous one (E2, which RL moved away from the base) would differ; from the
    # BASE model with no SFT step, E3_sft is the base, bit for bit. And its SFT set is ALL distilled
    # data so far: gen1 + gen2, not gen2 alone.
    assert weights_differ(speaker, rd / "models" / "E2") > 0
    p = ok(run("--resume", rd, "--generations", 3, "--distill-epochs", 0))
    lines = metrics(rd)
    assert [(m["iteration"], m["generation"]) for m in lines] == [(0, 1), (1, 2), (2, 3)]
    n1, n2 = (len((rd / "distill" / f"gen{g}.jsonl").read_text().splitlines()) for g in (1, 2))
    assert n1 > 0 and n2 > 0, "each generation must distill something for this check to mean anything"
    assert lines[2]["distill/samples"] == n1 + n2 and lines[2]["distill/steps"] == 0
    assert weights_differ(speaker, rd / "models" / "E3_sft") == 0.0
    assert (rd / "models" / "E3" / "config.json").exists() and (rd / "distill" / "gen3.jsonl").exists()


def test_eval_only_reports_diversity(tmp_path):
    rd = tmp_path / "eval"
    # `--episodes`: the alias of --eval-episodes
    p = ok(run("--eval-only", "--vms", 2, "--model", "tiny", "--episodes", 3, "--steps", 2, "--run-name", rd, *FAST))
    report = json.loads((rd / "eval.json").read_text())
    assert report["same_screen_hash_bits"] == 2

    def screens(hashes):  # a screen is new when its hash is more than 2 bits from every earlier new one
        leaders = []
        for h in (int(x, 16) for x in hashes):
            if all((h ^ g).bit_count() > report["same_screen_hash_bits"] for g in leaders):
                leaders.append(h)
        return len(leaders)
    for who in ("policy", "random"):
        s = report[who]["summary"]
        assert s["episodes"] == 3 and len(report[who]["episodes"]) == 3
        # s_0 + 2 after-screens per episode: 1..3 distinct, by hash and by features
        assert 1 <= s["distinct_screens"] <= 3 and 1 <= s["distinct_screens_feat"] <= 3
        episodes = report[who]["episodes"]
        # the summary is the mean of the episodes' own numbers...
        for k in ("distinct_screens", "distinct_screens_feat", "diversity", "windows"):
            assert s[k] == pytest.approx(sum(e[k] for e in episodes) / 3), (who, k)
        # ...and screens are counted from the hashes saved, within an episode and across all of them
        assert s["distinct_screens_all"] == screens([h for e in episodes for h in e["hashes"]])
        for e in episodes:
            assert len(e["hashes"]) == 3 and e["windows"] == len(e["window_titles"])
            assert e["distinct_screens"] == screens(e["hashes"])
            assert (e["diversity"] == 0.0) == (e["distinct_screens"] == 1)  # no pair, no diversity
    assert report["random"]["summary"]["format"] == 1.0  # random actions are always well formed
    for head in ("screens/ep", "feat scr/ep", "screens all", "diversity", "windows/ep"):
        assert head in p.stdout
    assert "policy" in p.stdout and "random" in p.stdout


def test_eval_counts_windows_screens_and_diversity(vm_desktop, tmp_path):
    """In process, on the session's real desktop: a scripted chooser that opens the terminal (a
    double-click on its icon) and a still one that only moves the mouse, through run_eval."""
    from actions import Action, Parsed
    from vm.desktop import desktop_icons

    def chooser(first: Action):
        def choose(looks):
            calls.append(len(looks))
            pointers.append([o.cursor for o in looks])
            act = first if len(calls) % 3 == 1 else Action("move", x=700, y=400)  # 3 steps per episode
            return [T.answer_text(act) for _ in looks]
        return choose
    calls, pointers = [], []
    x, y = desktop_icons()["Terminal"]
    choosers = {"opener": chooser(Action("double_click", x=x, y=y)), "still": chooser(Action("move", x=600, y=300))}
    pool = VMPool([vm_desktop.url], token=vm_desktop.secret, timeout=30)
    try:
        report = T.evaluate(pool, choosers, str(tmp_path), T.Args(steps=3, settle="1.0", eval_episodes=1), {})
    finally:
        pool.reset()
        pool.close()
    opener, still = report["opener"]["episodes"][0], report["still"]["episodes"][0]
    # The pointer each step starts from (DragTo drags from it): the centre after the reset, then
    # wherever the previous action left the mouse.
    assert pointers[:3] == [[(640, 360)], [(x, y)], [(700, 400)]], pointers
    assert opener["windows"] >= 1 and any("xterm" in t for t in opener["window_titles"]), opener
    assert opener["apps"] == ["terminal"] * opener["windows"] and still["apps"] == []  # by WM_CLASS (env.app_of)
    assert opener["distinct_screens"] >= 2 and opener["diversity"] > 0.1
    # Nothing opened, the screen never changed: one screen, no diversity, no window.
    assert (still["windows"], still["distinct_screens"], still["diversity"]) == (0, 1, 0.0), still
    assert json.loads((tmp_path / "eval.json").read_text())["opener"]["summary"]["windows"] == opener["windows"]
    # What each step did is in eval.json (screen pixels), and every episode is saved as a trajectory
    # view.py reads: the double-click on the icon, then the two moves, with the screens they saw.
    assert [a["action"] for a in opener["actions"]] == [
        {"type": "double_click", "x": x, "y": y}, {"type": "move", "x": 700, "y": 400}, {"type": "move", "x": 700, "y": 400}]
    assert opener["round"] == 0 and all(a["valid"] and a["screen"] == [1280, 720] for a in opener["actions"])
    import view
    trajs = view.load_run(str(tmp_path / "opener"))["trajectories"]
    steps = trajs[0][0]["steps"]
    assert [s["action"] for s in steps] == [a["action"] for a in opener["actions"]]
    assert all((tmp_path / "opener" / "trajectories" / "it000000" / s["screenshot"]).exists() for s in steps)
    assert len(view.load_run(str(tmp_path / "still"))["trajectories"][0][0]["steps"]) == 3


def test_the_windows_term_reads_the_window_lists_the_rollout_recorded(vm_desktop):
    """`--rewards all,windows` in small: the rollout records the window list before and after each
    step (only when a term reads it), and step_rewards() hands it to rewards.py's windows term. A
    double-click on the terminal icon, then a mouse move, on the session's real desktop."""
    from actions import Action, Parsed
    from vm.desktop import desktop_icons
    x, y = desktop_icons()["Terminal"]
    acts = [Action("double_click", x=x, y=y), Action("move", x=700, y=400)]

    def choose(looks):
        return [T.answer_text(acts[o.step], "open the terminal") for o in looks]
    pool = VMPool([vm_desktop.url], token=vm_desktop.secret, timeout=30)
    try:
        plain, _ = T.play_steps(pool, {0}, choose, 1, "watch", reset=True)
        buffer, _ = T.play_steps(pool, {0}, choose, 2, "watch", reset=True, windows=True)
    finally:
        pool.reset()
        pool.close()
    assert plain[0].windows_before is None and plain[0].windows_after is None  # not asked: no GET /windows
    assert buffer[1].windows_before == buffer[0].windows_after  # one step's after is the next one's before
    opened = [len(set(s.windows_after) - set(s.windows_before)) for s in buffer]
    assert sum(opened) >= 1, opened  # the terminal's window
    # each window a step opened, by app (WM_CLASS): the double-click opened the terminal, the move nothing
    assert buffer[0].opened == ["terminal"] * opened[0] and buffer[1].opened == ["terminal"] * opened[1]
    assert plain[0].opened is None
    line = logs.step_line(buffer[0])
    assert line["opened"] == buffer[0].opened and "opened" not in logs.step_line(plain[0])
    m = logs.app_counts([buffer[0].opened + buffer[1].opened], 2)
    assert m == {"windows/opened_per_step": sum(opened) / 2, "apps/distinct_per_episode": 1.0,
                 "apps/terminal": sum(opened)}
    assert logs.app_counts([], 2) == {}  # not recorded: no apps/* metrics
    learner = trainer(R.parse_reward_flags("none,windows"))
    r, m = scored(learner, buffer)
    assert r.windows.tolist() == opened and r.total.tolist() == opened and m["wm/loss"] is None
    assert torch.count_nonzero(r.image_immediate) == 0  # off: logged as 0


def test_console_line_reads_the_table():
    m = {"iteration": 3, "generation": 1, "vms": 2, "steps": 4, "reward/total": 1.5, "reward/format": 0.75,
         "reward/image_immediate": 0.1, "reward/image_sequence": 0.2, "reward/image_world_model": 0.0,
         "reward/windows": 2.0, "wm/loss": None, "actor/kl": 0.0123, "actor/clip_low": 0.0, "actor/clip_high": 0.0,
         "time/iteration": 5.0}
    line = logs.explore_line(m, R.parse_reward_flags("none,image,immediate,sequence,windows"), beta=0.04)
    # the terms on, grouped by their first word, "-" for the group's term that is off; no text/intent
    assert "format 0.75 image 0.100/0.200/- windows 2.000 | wm - | kl 0.0123 clip 0.00/0.00" in line, line
    assert "text" not in line and "intent" not in line
    paper = logs.explore_line(m, R.parse_reward_flags("all"), beta=0.04)
    assert "image 0.100/0.200/0.000 text -/-/- intent -/-/- |" in paper and "windows" not in paper  # "-": not logged
    # --beta 0 computes no KL: the console says so instead of printing a measured-looking 0.0000
    assert "kl n/a clip" in logs.explore_line({**m, "actor/kl": 0.0}, R.parse_reward_flags("all"), beta=0.0)
    assert "kl n/a clip" in logs.explore_line({**m, "actor/kl": None}, R.parse_reward_flags("all"), beta=0.04)


def test_advantages_over_the_buffer_grpo_and_dr_grpo():
    """The rewards of a buffer, then the advantages over the whole buffer (one group): GRPO's (r - mean) / std, or Dr. GRPO's r - mean with --no-scale-rewards
    (grpo.group_advantages' numbers by hand are in tests/test_grpo.py). Image immediate only; the
    4th step is malformed and earns 0."""
    from actions import Action, Parsed
    a = Action("click", x=1, y=1)
    dark, light = Image.new("RGB", (64, 36), (20, 20, 20)), Image.new("RGB", (64, 36), (20, 20, 20))
    light.paste((230, 230, 230), (0, 0, 32, 36))  # the left half lit: a changed screen
    befores, afters = [dark] * 4, [light, dark, light, light]
    buffer = [T.Step(vm, 0, b, c, "", Parsed(a, "") if vm < 3 else None) for vm, (b, c) in enumerate(zip(befores, afters))]
    learner = trainer(R.parse_reward_flags("none,image,immediate"))
    r, _ = scored(learner, buffer)
    want_r = (1 - R.cosine(R.screen_features(befores), R.screen_features(afters))) * torch.tensor([1.0, 1, 1, 0])
    assert torch.allclose(r.total, want_r, atol=1e-6) and r.total[0] > 0.5 and r.total[1] == 0
    for scale in (True, False):
        adv = grpo.group_advantages(r.total, scale=scale)  # the one group iteration() forms
        centred = want_r - want_r.mean()  # (4,)
        assert torch.allclose(adv, centred / (want_r.std() + 1e-6) if scale else centred, atol=1e-5)


@pytest.mark.parametrize("argv, says", [
    (["--bogus", "1"], "unrecognized arguments"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--rewards", "all,no_such_term"], "Unknown reward component"),
    (["--vms", "http://127.0.0.1:{port}", "--model", "tiny"], "None of the 1 VM(s) answered"),
    (["--vms", "1", "--model", "/no/such/model"], "No model folder at '/no/such/model'"),  # found after the run folder
])
def test_user_errors_end_in_one_sentence(argv, says, tmp_path):
    argv = [a.format(port=free_port()) for a in argv] + ["--run-name", str(tmp_path / "x")]
    p = run(*argv, timeout=120)
    assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x").exists()  # nothing half-made left behind


# -----------------------------------------------------------------------------------------------
# A desktop that fails mid-iteration drops out, without blaming the model; the other goes on
# (real desktops, real HTTP)


def test_a_desktop_whose_x_server_dies_drops_out_and_its_step_is_not_the_models():
    pool = VMPool(2, timeout=10)
    try:
        base, seen, killed = T.random_policy(random.Random(0)), [], []

        def choose(looks):
            seen.extend((o.vm, o.step) for o in looks)
            if not killed and any((o.vm, o.step) == (1, 1) for o in looks):  # before its action lands
                killed.append(kill_x_server(pool.local[1].proc.pid))
            return base(looks)
        buffer, out = T.play_steps(pool, {0, 1}, choose, 3, "0.1", reset=True)
        # Its server answered 503 ("X server died"): the step is dropped, not charged to the model as
        # a format failure (every random action is well formed, and none is marked refused).
        assert [(s.vm, s.step) for s in buffer] == [(0, 0), (1, 0), (0, 1), (0, 2)]
        assert all(s.parsed is not None and s.error is None for s in buffer)
        assert [(f.vm, "503" in f.error) for f in out.failures] == [(1, True)]
        assert killed and (1, 2) not in seen and all(s.after.size == (1280, 720) for s in buffer)
        # The next reset iteration revives it (a health check fails: a restart) in its own thread.
        old = pool.local[1].proc.pid
        buffer, out = T.play_steps(pool, {0, 1}, choose, 3, "0.1", reset=True)
        assert out.failures == [] and pool.local[1].proc.pid != old
        assert sorted((s.vm, s.step) for s in buffer) == [(vm, t) for vm in (0, 1) for t in range(3)]
    finally:
        pool.close()


def test_score_rewards_curiosity_before_the_world_model_learns():
    """The rewards of 8 desktops that made the same first move (one start screen after a reset): by
    default curiosity is the world model's guess from before this buffer, and only then does the
    model learn; --wm-train-first scores with the model after it learned (the release's order)."""
    import copy

    from actions import Action, Parsed
    before = Image.new("RGB", (1280, 720), (40, 40, 40))
    after = before.copy()
    after.paste((230, 230, 230), (300, 200, 900, 600))  # a window opened
    act = Action("double_click", x=100, y=100)
    buffer = [T.Step(vm, 0, before, after, "", Parsed(act, "open it")) for vm in range(8)]
    flags = R.parse_reward_flags("none,image,world_model")
    s, s2 = R.screen_features([before]), R.screen_features([after])  # (1, D) each
    for train_first in (False, True):
        torch.manual_seed(0)
        wm = R.WorldModel(hidden=32)
        opt = T.adamw(wm.parameters(), 1e-2)
        untrained = copy.deepcopy(wm)
        learner = trainer(flags, wm, opt)
        r, m = scored(learner, buffer, T.Args(wm_train_first=train_first))
        assert m["wm/loss"] > 0 and any(not torch.equal(a, b) for a, b in zip(wm.parameters(), untrained.parameters()))
        scorer = wm if train_first else untrained  # the model whose guess curiosity must be
        want = 1 - R.cosine(s2, R.predict_next(scorer, s, [act])[0])  # (1,)
        assert torch.allclose(r.image_world_model, want.expand(8), atol=1e-5), (train_first, r.image_world_model, want)
        assert torch.allclose(r.total, r.image_world_model)
    assert rundir.parse_args(T.Args, ["--wm-train-first"], T.PROG)[0].wm_train_first and not T.Args().wm_train_first


def test_actor_lr_schedule_by_hand():
    # 10 iterations, first update at iteration 2 -> 8 updates (u = 0..7); warm-up 2: u = 0 -> 1/2,
    # u = 1 -> 2/2; then linear over n - warmup = 6: f = (u - 2) / 6 -> 1, 5/6, 4/6, 3/6, 2/6, 1/6.
    a = T.Args(iterations=10, lr=0.6, lr_warmup=2, lr_schedule="linear", update_actor_delay=2)
    want = [0.6, 0.6, 0.3, 0.6, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]  # iterations 0, 1: no update, lr as given
    assert [round(T.lr_at(i, a), 9) for i in range(10)] == want
    # cosine, no warm-up, 4 updates: f = 0, 1/4, 2/4, 3/4 -> (1 + cos(pi f)) / 2 = 1, 0.8536, 0.5, 0.1464
    a = T.Args(iterations=4, lr=1.0, lr_schedule="cosine", update_actor_delay=0)
    assert [round(T.lr_at(i, a), 4) for i in range(4)] == [1.0, 0.8536, 0.5, 0.1464]
    # Two generations of 4, delay 1: generation 1 updates at 1, 2, 3 (warm-up 1, then f = 0, 1/2);
    # generation 2 (its own optimizer) updates at 4..7 from its start (warm-up 1, then f = 0, 1/3, 2/3).
    a = T.Args(iterations=4, generations=2, lr=1.0, lr_warmup=1, lr_schedule="linear", update_actor_delay=1)
    assert [round(T.lr_at(i, a), 4) for i in range(8)] == [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.6667, 0.3333]
    assert T.lr_at(3, T.Args(iterations=4, lr=2e-5)) == 2e-5  # the default: the paper's constant lr


def test_optimizers_are_the_releases_adamw():
    p = torch.nn.Parameter(torch.zeros(3))
    g = T.adamw([p], 4e-5).param_groups[0]
    assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 and g["weight_decay"] == 0.01 and g["lr"] == 4e-5


# -----------------------------------------------------------------------------------------------
# The script's own formulas, by hand


def test_distinct_screens_greedy_clustering():
    # Rows (unit): a = (1, 0), b = (0.96, 0.28) [cos(a, b) = 0.96], c = (0, 1) [cos(a, c) = 0,
    # cos(b, c) = 0.28], a again. Threshold 0.95: a leads, b joins a (0.96 >= 0.95), c is new,
    # a joins a -> 2 screens. Threshold 0.97: b is new too -> 3.
    f = torch.tensor([[1.0, 0.0], [0.96, 0.28], [0.0, 1.0], [1.0, 0.0]])  # (4, 2)
    assert R.distinct_screens(f, 0.95) == 2
    assert R.distinct_screens(f, 0.97) == 3
    assert R.distinct_screens(f[:1], 0.95) == 1


def test_dhash_and_hash_clustering():
    # A 9 x 8 image whose every row gets brighter to the right: all 64 bits are 1. Reverse the top
    # row: its 8 bits (the highest) become 0 -> 0x00ffffffffffffff.
    ramp = np.tile(np.arange(9, dtype=np.uint8) * 20, (8, 1))  # (8, 9)
    assert R.dhash(Image.fromarray(ramp)) == 2 ** 64 - 1
    flipped = ramp.copy()
    flipped[0] = flipped[0][::-1]
    assert R.dhash(Image.fromarray(flipped)) == 0x00FFFFFFFFFFFFFF
    # A flat screen has no brighter neighbour anywhere: 0. Any size is box-averaged to 9 x 8 first.
    assert R.dhash(Image.new("RGB", (1280, 720), (40, 80, 120))) == 0
    # Hashes 0b0000, 0b0011 (2 bits from the first), 0b0111 (3 from the first), 0b1111 (4 from the
    # first, 1 from the third). max_bits 2: 0 leads, 0b0011 joins it, 0b0111 is new (3 > 2), 0b1111
    # joins 0b0111 (1 bit) -> leaders [0, 2]. max_bits 0: every hash is its own screen.
    assert R.hash_leaders([0b0000, 0b0011, 0b0111, 0b1111], 2) == [0, 2]
    assert R.hash_leaders([0b0000, 0b0011, 0b0111, 0b1111], 0) == [0, 1, 2, 3]
    assert R.hash_leaders([5, 5, 5], 0) == [0] and R.hash_leaders([], 2) == []


def test_pairwise_diversity():
    # Rows (1, 0), (0, 1), (0.6, 0.8): cosines 0, 0.6, 0.8 -> 1 - cos = 1, 0.4, 0.2 -> mean 1.6 / 3
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])  # (3, 2)
    assert abs(R.pairwise_diversity(f) - 1.6 / 3) < 1e-6
    assert R.pairwise_diversity(f[:1]) == 0.0 and R.pairwise_diversity(f[:0]) == 0.0  # no pair
    assert abs(R.pairwise_diversity(f[:2]) - 1.0) < 1e-6


def test_episodes_flag_is_an_alias():
    assert rundir.parse_args(T.Args, ["--episodes", "7"], T.PROG)[0].eval_episodes == 7
    assert rundir.parse_args(T.Args, ["--eval-episodes", "5"], T.PROG)[0].eval_episodes == 5


def test_top_steps_keeps_the_best_fraction_of_each_iteration():
    # Iteration 0 (an early one: curiosity still high), 10 steps, ids 0-9: top 0.3 -> ceil(3.0) = 3:
    # 3.0 (id 0), 2.9 (id 5), 2.8 (id 2).
    # Iteration 1, ids 10-12: ceil(0.9) = 1 -> 1.2 (id 11).
    # Iteration 2, ids 13-15: ceil(0.9) = 1 -> 0.5 (id 13; id 15 ties and comes later).
    # A ranking pooled over the 16 steps would keep ceil(4.8) = 5, all from iteration 0
    # (ids 0, 5, 2, 1, 8): its rewards are on a larger scale, not better for their time.
    rewards = [[3.0, 2.5, 2.8, 1.0, 0.5, 2.9, 0.7, 0.1, 2.0, 1.5], [0.4, 1.2, 0.9], [0.5, 0.1, 0.5]]
    steps, i = [], 0
    for it, rs in enumerate(rewards):
        for r in rs:
            steps.append({"reward": r, "id": i, "iteration": it})
            i += 1
    assert [s["id"] for s in top_steps(steps, 0.3)] == [0, 5, 2, 11, 13]
    assert len(top_steps(steps, 1.0)) == 16 and top_steps([], 0.3) == []
    assert [s["id"] for s in top_steps(steps, 0.01)] == [0, 11, 13]  # ceil keeps one of each iteration
