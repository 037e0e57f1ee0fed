"""Crash and resume: SIGKILL at every step of a checkpoint save, and at random moments of real runs.

Run: python -m pytest -q tests/test_crash_resume.py        (~2.5 min on 2 cores)

1. ckpt.save_checkpoint killed (a real SIGKILL, in a forked child) before each of its file system
   operations in turn (every rename, rmtree, unlink, rmdir, fsync, open, torch.save), from a normal
   run folder and from one an earlier kill left with only `ckpt.old` and a half-written
   `ckpt.tmp-*`: a complete checkpoint (old or new) is always found, never a folder without
   COMPLETE, and the next save leaves exactly one `ckpt` behind.
2. The kill between an iteration's checkpoint and its metrics line: the line comes back on resume.
3. train_explore.py and train_arpo.py killed with SIGKILL at three seeded random moments each, then
   resumed to the end: after every kill the run folder holds only complete checkpoints; at the
   end the metrics file has every iteration exactly once, the iteration counter and the
   optimizers' step counters continue (they equal what an unbroken run would count, so the
   optimizer states and the world model came back), and ARPO's replay buffer after a resume still
   holds what the last checkpoint held.
4. A trainer killed with SIGKILL takes its local desktops (vm_server.py + Xvfb + apps) with it.

The long version (more kills, local desktops, figures) is `python bench/crash_resume.py`.
"""
from __future__ import annotations

import builtins
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from plumbing import ckpt, rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import proc_alive, proc_children, proc_descendants  # noqa: E402


# ------------------------------------------------------------------------------------------------
# 1. save_checkpoint, killed before each file system operation

_OPS = [(os, "rename"), (os, "makedirs"), (os, "fsync"), (os, "unlink"), (os, "rmdir"), (os, "open"),
        (builtins, "open"), (torch, "save")]


def save_killed_at(run: str, state: dict, kill_at: int | None, metrics=None) -> tuple[bool, int]:
    """save_checkpoint in a forked child that SIGKILLs itself right before its kill_at-th file
    system operation (None: never). -> (was it killed, operations counted)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: count, die at kill_at, report the count if it lives
        os.close(r)
        count = [0]

        def wrap(fn):
            def op(*a, **k):
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*a, **k)
            return op
        for mod, name in _OPS:
            setattr(mod, name, wrap(getattr(mod, name)))
        try:
            ckpt.save_checkpoint(run, state, **({} if metrics is None else {"metrics": metrics}))
            os.write(w, str(count[0]).encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = os.read(r, 64)
    os.close(r)
    return os.WIFSIGNALED(status), int(out or 0)


def check_folder(run: str, allowed: set[int]) -> int:
    """The checkpoint a resume would load is complete and one of `allowed`; returns its iteration."""
    path = ckpt.latest_checkpoint(run)
    assert path is not None, f"no complete checkpoint left: {sorted(os.listdir(run))}"
    assert os.path.exists(os.path.join(path, "COMPLETE"))
    state, _ = ckpt.load_checkpoint(run)
    it = state["next_iteration"]
    assert it in allowed and open(os.path.join(path, "COMPLETE")).read() == str(it)
    assert state["blob"].shape == (64, 64) and float(state["blob"][0, 0]) == it
    return it


def make_state(it: int) -> dict:
    return {"next_iteration": it, "blob": torch.full((64, 64), float(it))}


def prepare(run: str, start: str) -> str:
    """A run folder with checkpoint 1, as a normal run has it or as a kill between the two renames
    of a save leaves it (only ckpt.old, and the killed save's half-written ckpt.tmp-*)."""
    os.makedirs(run)
    ckpt.save_checkpoint(run, make_state(1))
    if start != "normal":
        os.rename(os.path.join(run, "ckpt"), os.path.join(run, "ckpt.old"))
        os.makedirs(os.path.join(run, "ckpt.tmp-99999"))
        open(os.path.join(run, "ckpt.tmp-99999", "state.pt"), "wb").write(b"half")
    return run


def test_rng_state_round_trip_and_old_checkpoints():
    # What a resume restores: the next draws of every generator equal the ones the run would have
    # made. On a GPU machine the CUDA generators are in the state too (sampling uses them).
    import numpy as np
    if torch.cuda.is_available():
        torch.cuda.init()  # a GPU run has CUDA in use by the time it checkpoints
    state = ckpt.rng_state()
    assert ("cuda" in state) and (state["cuda"] is None) == (not torch.cuda.is_initialized())
    draws = (random.random(), np.random.rand(), torch.rand(3).tolist(),
             torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() else None)
    random.random(), np.random.rand(), torch.rand(3)  # the run moves on...
    ckpt.set_rng_state(state)                        # ...and is killed and resumed
    assert draws == (random.random(), np.random.rand(), torch.rand(3).tolist(),
                     torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() else None)
    old = {k: v for k, v in state.items() if k != "cuda"}  # a checkpoint without CUDA's RNG state
    ckpt.set_rng_state(old)
    assert random.random() == draws[0]


@pytest.mark.parametrize("start", ["normal", "after_a_kill_between_the_renames"])
def test_save_checkpoint_killed_at_every_operation(tmp_path, start):
    _, total = save_killed_at(prepare(str(tmp_path / "probe"), start), make_state(2), None)
    assert total >= 8
    outcomes = {}
    for k in range(1, total + 2):
        run = prepare(str(tmp_path / f"run{k}"), start)
        killed, _ = save_killed_at(run, make_state(2), k)
        assert killed == (k <= total)
        outcomes[k] = check_folder(run, {1, 2})
        # the resume: the next save in place, then exactly one complete checkpoint and no leftovers
        ckpt.save_checkpoint(run, make_state(3))
        assert check_folder(run, {3}) == 3
        assert sorted(n for n in os.listdir(run) if n.startswith("ckpt")) == ["ckpt"], os.listdir(run)
    assert outcomes[1] == 1 and outcomes[total + 1] == 2  # both ends reached: the windows were all visited
    print(f"{start}: killed before each of {total} operations, a complete checkpoint found every time")


def test_a_kill_between_checkpoint_and_metrics_line_loses_no_line(tmp_path):
    run = str(tmp_path)
    for it in range(4):
        ckpt.save_checkpoint(run, make_state(it), metrics={"iteration": it, "x": it})
        rundir.log_metrics(run, {"iteration": it, "x": it})
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"iteration": 4, "x"')  # and a torn line from a kill in the middle of a write
    # iteration 4: its checkpoint lands, then the kill, before log_metrics
    killed, _ = save_killed_at(run, make_state(4), None, metrics={"iteration": 4, "x": 4})
    assert not killed
    ckpt.trim_metrics(run, 5)  # what the resume does
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["iteration"] for m in lines] == [0, 1, 2, 3, 4] and lines[4]["x"] == 4
    ckpt.trim_metrics(run, 5)  # twice is once
    assert [json.loads(x)["iteration"] for x in open(os.path.join(run, "metrics.jsonl"))] == [0, 1, 2, 3, 4]
    ckpt.trim_metrics(run, 3)  # an older checkpoint's resume drops what it does not cover
    assert [json.loads(x)["iteration"] for x in open(os.path.join(run, "metrics.jsonl"))] == [0, 1, 2]


def test_a_resume_removes_the_trajectories_of_iterations_it_will_not_keep(tmp_path):
    # A kill after the last checkpoint: the killed attempt's it000007/ is never redone.
    run = str(tmp_path)
    for it in (5, 6, 7, 12):
        os.makedirs(os.path.join(run, "trajectories", f"it{it:06d}"))
    os.makedirs(os.path.join(run, "trajectories", "notes"))  # not an iteration's: kept
    ckpt.trim_trajectories(run, 7)
    assert sorted(os.listdir(os.path.join(run, "trajectories"))) == ["it000005", "it000006", "notes"]
    ckpt.trim_trajectories(str(tmp_path / "no-run"), 0)  # no trajectories folder: nothing to do


# ------------------------------------------------------------------------------------------------
# 3. The train scripts, killed at random moments and resumed (2 shared desktops, remote mode)

TOKEN = "crash-resume-token"


@pytest.fixture(scope="module")
def desktops():
    from conftest import start_vm_server
    vms = [start_vm_server(secret=TOKEN) for _ in range(2)]  # each its own token, derived from TOKEN and its URL
    yield [v.url for v in vms]
    for v in vms:
        v.stop()


@pytest.fixture(scope="module")
def speaker(tmp_path_factory):
    from test_train_explore import speaking_tiny  # the tiny model, SFT'd to answer in the format
    return speaking_tiny(str(tmp_path_factory.mktemp("speaker") / "model"))


def start(script: str, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, VM_TOKEN=TOKEN)  # not --token: a resume must find the VMs the same way
    # Output to a file (p.log), not a pipe read only at the end: a full pipe would stall the trainer.
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, script), *argv], cwd=ROOT, env=env,
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    p.log = log
    return p


def output(p: subprocess.Popen) -> str:
    p.wait(timeout=60)
    p.log.seek(0)
    return p.log.read()


def snapshot(run: str, live: bool = False) -> dict | None:
    """The checkpoint a resume would load (asserted complete), or None before the first one.
    live=True: the trainer is running and may swap checkpoints while we read; retry until one
    read sees the same checkpoint from start to end."""
    for _ in range(50 if live else 1):
        try:
            path = ckpt.latest_checkpoint(run)
            if path is None:
                assert live or not os.path.isdir(os.path.join(run, "ckpt"))
                return None
            if not live and os.path.isdir(os.path.join(run, "ckpt")):  # `ckpt` is always complete
                assert os.path.exists(os.path.join(run, "ckpt", "COMPLETE")), os.listdir(os.path.join(run, "ckpt"))
            stamp = open(os.path.join(path, "COMPLETE")).read()
            state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
            if stamp == str(state["next_iteration"]) == open(os.path.join(path, "COMPLETE")).read():
                return state
            assert live, (stamp, state["next_iteration"])
        except (OSError, RuntimeError, EOFError):
            if not live:
                raise
        time.sleep(0.05)
    raise AssertionError("no stable checkpoint to read")


def opt_steps(sd: dict) -> int:
    return int(max(float(v["step"]) for v in sd["state"].values())) if sd["state"] else 0


def read_stamp(run: str) -> str | None:
    """The newest checkpoint's COMPLETE stamp, or None. The trainer may be swapping ckpt -> ckpt.old
    between latest_checkpoint's look and this read (a CI run once caught it): then the next poll."""
    done = ckpt.latest_checkpoint(run)
    try:
        return open(os.path.join(done, "COMPLETE")).read() if done else None
    except FileNotFoundError:
        return None


def crash_and_resume(script: str, fresh: list[str], run: str, seed: int, kills: int, between=None,
                     before_kill=None) -> dict:
    """Run `script` to its end through `kills` SIGKILLs at seeded random moments, then a last run to
    the end. Each kill: after 0, 1 or 2 new checkpoints (0: anywhere in the first 8 s, startup
    included), then a uniform 0-1.2 s more, i.e. anywhere inside an iteration -- whatever the load
    on the machine. After each kill the run folder is checked; the resumed process's first new
    checkpoint is kept next to the one before the kill. between(run, checkpoint state) runs before
    each resume, before_kill(process) right before each kill. -> figures and (before, after) pairs."""
    rng, pairs, tried, survived, outputs = random.Random(seed), [], 0, 0, []
    for attempt in range(kills + 1):
        argv = ["--resume", run] if os.path.exists(os.path.join(run, "args.json")) else fresh
        before = snapshot(run)
        if between is not None and attempt:
            between(run, before)
        wait_its, delay = rng.choice([0, 1, 2]), rng.uniform(0, 1.2)
        delay = rng.uniform(0, 8) if wait_its == 0 else delay
        p = start(script, argv)
        t0, kill_at, first_new, deadline = time.time(), None, None, time.time() + 300
        while p.poll() is None and time.time() < deadline:
            stamp = read_stamp(run)
            if stamp is not None and stamp != str(before and before["next_iteration"]) and first_new is None:
                first_new = snapshot(run, live=True)
            if attempt < kills and kill_at is None:
                base = 0 if before is None else before["next_iteration"]
                if wait_its == 0 or (stamp is not None and int(stamp) - base >= wait_its):
                    kill_at = time.time() + delay
            if kill_at is not None and time.time() >= kill_at:
                if before_kill is not None:
                    before_kill(p)
                p.kill()
                tried += 1
                break
            time.sleep(0.02)
        out = output(p)
        outputs.append(out[-1500:])
        after = snapshot(run)  # the folder a resume would read: complete, or no checkpoint at all
        survived += attempt < kills and p.returncode == -signal.SIGKILL
        if before is not None and first_new is not None and first_new["next_iteration"] != before["next_iteration"]:
            pairs.append((before, first_new))
        assert p.returncode in (0, -signal.SIGKILL), out[-3000:]
        if attempt == kills:
            assert p.returncode == 0, out[-3000:]
        print(f"{script}: start {attempt}: {'killed' if p.returncode == -signal.SIGKILL else 'exit ' + str(p.returncode)} "
              f"after {time.time() - t0:.1f} s, checkpoint at {after['next_iteration'] if after else None}")
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    return {"tried": tried, "survived": survived, "pairs": pairs, "metrics": lines, "final": snapshot(run),
            "outputs": outputs}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_explore_survives_three_random_kills(desktops, speaker, tmp_path):
    n = 8
    run = str(tmp_path / "explore")
    fresh = ["--vms", desktops[0], "--model", speaker, "--iterations", n, "--steps", 2, "--max-pixels", 12544,
             "--max-new-tokens", 40, "--settle", 0.2, "--threads", 1, "--update-actor-delay", 0, "--reset-every", 0,
             "--rewards", "none,image,immediate,world_model", "--wm-epochs", 1, "--run-name", run]
    r = crash_and_resume("train_explore.py", [str(a) for a in fresh], run, seed=3, kills=3)
    print(f"train_explore.py: kills survived {r['survived']}/{r['tried']}")
    assert r["tried"] == 3 and r["survived"] == 3
    its = [m["iteration"] for m in r["metrics"]]
    assert its == list(range(n)), its  # every iteration exactly once, in order
    wm_trained = [m["wm/loss"] is not None for m in r["metrics"]]
    final = r["final"]
    assert final["next_iteration"] == n
    # One optimizer step per iteration (2 samples <= --mini-batch 16, actor from iteration 0) and one
    # world-model step per iteration with a valid step: the counters continue across every kill.
    assert opt_steps(final["optimizer"]) == n
    assert opt_steps(final["wm_opt"]) == sum(wm_trained)
    assert r["pairs"], "no kill fell after a checkpoint"
    for old, new in r["pairs"]:
        k, j = old["next_iteration"], new["next_iteration"]
        assert opt_steps(new["optimizer"]) - opt_steps(old["optimizer"]) == j - k
        dwm = opt_steps(new["wm_opt"]) - opt_steps(old["wm_opt"])
        assert dwm == sum(wm_trained[k:j])
        # The world model and the adapter went on from the checkpoint: Adam moves each weight by at
        # most ~lr per step (5 lr leaves room for its bias correction), a fresh start would move
        # them by their whole initial scale.
        assert max_diff(old["wm"], new["wm"]) <= 5 * 1e-3 * dwm + 1e-6
        assert max_diff(old["adapter"], new["adapter"]) <= 5 * 4e-5 * (j - k) + 1e-7


def test_arpo_survives_three_random_kills(desktops, tmp_path):
    # Long enough that every seeded kill lands inside the run: with 7 iterations a fast run once
    # ended before a kill drawn late in its window, and the kill missed.
    n = 30
    # A task the random tiny model always "solves": every episode is a success, so the replay
    # buffer fills (2 per iteration, 8 kept) and has something to lose in a crash.
    tasks = always_solved(tmp_path)
    run = str(tmp_path / "arpo")
    # --mini-batch 2: the whole group in one optimizer step, so optimizer steps count iterations below
    fresh = ["--vms", ",".join(desktops), "--group-size", 2, "--model", "tiny", "--iterations", n, "--max-steps", 2,
             "--max-pixels", 12544, "--max-new-tokens", 8, "--tasks", tasks, "--settle", 0.1, "--run-name", run,
             "--mini-batch", 2]

    def plant(run, before):  # a killed attempt's trajectory file of the iteration about to be redone
        nxt = before["next_iteration"] if before else 0
        os.makedirs(os.path.join(run, "trajectories", f"it{nxt:06d}"), exist_ok=True)
        open(os.path.join(run, "trajectories", f"it{nxt:06d}", "vm07.jsonl"), "w").write("{}\n")

    r = crash_and_resume("train_arpo.py", [str(a) for a in fresh], run, seed=4, kills=3, between=plant)
    print(f"train_arpo.py: kills survived {r['survived']}/{r['tried']}")
    assert r["tried"] == 3 and r["survived"] == 3
    assert [m["iteration"] for m in r["metrics"]] == list(range(n))
    final = r["final"]
    assert final["next_iteration"] == n and opt_steps(final["optimizer"]) == n
    assert not any(os.path.exists(os.path.join(run, "trajectories", d, "vm07.jsonl"))
                   for d in os.listdir(os.path.join(run, "trajectories")))
    assert r["pairs"], "no kill fell after a checkpoint"

    def ids(state):
        return [(t["iteration"], t["vm"]) for t, _ in state["replay"]["data"].get("notes-there", [])]
    for old, new in r["pairs"]:
        assert opt_steps(new["optimizer"]) - opt_steps(old["optimizer"]) == new["next_iteration"] - old["next_iteration"]
        # the replay buffer went on from the checkpoint: what it held is still there, oldest first,
        # with only this run's new successes after it (and the oldest dropped past 8)
        added = [x for x in ids(new) if x[0] >= old["next_iteration"]]
        kept = ids(new)[:len(ids(new)) - len(added)]
        assert added and len(kept) == min(len(ids(old)), 8 - len(added))
        assert kept == ids(old)[len(ids(old)) - len(kept):], (ids(old), ids(new))


# ------------------------------------------------------------------------------------------------
# 4. A trainer killed with SIGKILL leaves no desktop behind


def test_a_killed_trainer_takes_its_local_desktops_along(tmp_path):
    run = str(tmp_path / "orphans")
    p = start("train_explore.py", ["--vms", "1", "--model", "tiny", "--iterations", "10000", "--steps", "1",
                                   "--max-pixels", "12544", "--max-new-tokens", "8", "--threads", "1",
                                   "--settle", "0.1", "--reset-every", "0", "--run-name", run])
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(run, "metrics.jsonl")) and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert p.poll() is None, output(p)[-2000:]
        servers = [c for c in proc_children(p.pid) if b"vm_server.py" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(servers) == 1
        desktop = servers + [d for s in servers for d in proc_descendants(s)]  # the server, bwrap, Xvfb, the session
        assert len(desktop) >= 4
        homes = {v[5:] for d in desktop for v in open(f"/proc/{d}/environ", "rb").read().decode(errors="replace").split("\0")
                 if v.startswith("HOME=") and "/vm_server-" in v}  # the desktop's own temp HOME
    finally:
        p.kill()
        p.wait()
    deadline = time.time() + 15
    while any(map(proc_alive, desktop)) and time.time() < deadline:
        time.sleep(0.2)
    left = [d for d in desktop if proc_alive(d)]
    for d in left:  # do not leak them into the rest of the test run, whatever happened
        os.kill(d, signal.SIGKILL)
    assert not left, f"{len(left)} desktop processes outlived their trainer"
    assert len(homes) == 1 and not os.path.exists(os.path.dirname(homes.pop()))  # a clean exit: its temp HOME went too


def test_the_vm_token_never_reaches_the_run_folder(tmp_path):
    """args.json and checkpoints get copied and shared (view.py renders args.json into HTML): the
    --token that controls the VMs must not be in them. A resume takes it again from --token/VM_TOKEN."""
    from train_arpo import Args
    run = rundir.make_run_dir(str(tmp_path / "r"), Args(token="s3cret-token"))
    ckpt.save_checkpoint(run, {"next_iteration": 0, "args": {"token": "s3cret-token", "lr": 1.0}})
    for root, _, files in os.walk(run):
        for f in files:
            assert b"s3cret-token" not in open(os.path.join(root, f), "rb").read(), f
    assert json.load(open(os.path.join(run, "args.json")))["token"] == ""
    assert ckpt.load_checkpoint(run)[0]["args"] == {"token": "", "lr": 1.0}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem for the run folder needs root")
def test_a_full_disk_stops_the_run_in_one_sentence_and_resume_continues(desktops, tmp_path):
    """The run folder on a filesystem of its own, 10 MB (a tmpfs; another program or a huge run
    fills a real disk the same way): the trainer stops with one sentence once a write finds it
    full, after its last complete checkpoint; given room again, `--resume` continues from it, and
    every iteration is logged exactly once."""
    import ctypes
    small = tmp_path / "small"
    small.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(b"tmpfs", str(small).encode(), b"tmpfs", 0, b"size=10m") == 0, ctypes.get_errno()
    try:
        tasks = always_solved(tmp_path)
        run = str(small / "arpo")
        argv = ["--vms", ",".join(desktops), "--group-size", 2, "--model", "tiny", "--iterations", 40, "--max-steps", 2,
                "--max-pixels", 12544, "--max-new-tokens", 8, "--tasks", tasks, "--settle", 0.1, "--run-name", run]
        p = start("train_arpo.py", [str(a) for a in argv])
        out = output_within(p, 600)
        assert p.returncode != 0, out[-2000:]
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"train_arpo.py: the disk of {run} is full") and "--resume" in last, out[-2000:]
        assert "Traceback" not in out, out[-3000:]
        done = json.loads(open(os.path.join(run, "ckpt", "COMPLETE")).read() or "0")  # the last complete one
        assert done >= 1 and f"iteration {done}" in last
        # room again: the resume continues from that checkpoint, to the end
        assert libc.mount(b"tmpfs", str(small).encode(), b"tmpfs", 32, b"size=200m") == 0, ctypes.get_errno()  # MS_REMOUNT
        p = start("train_arpo.py", ["--resume", run, "--iterations", str(done + 2)])
        out = output_within(p, 600)
        assert p.returncode == 0, out[-3000:]
        assert f"resumed {run} at iteration {done}" in out
        its = [json.loads(line)["iteration"] for line in open(os.path.join(run, "metrics.jsonl"))]
        assert its == list(range(done + 2)), its
    finally:
        libc.umount2(str(small).encode(), 2)


def always_solved(folder):
    """A task folder with one task every episode solves (notes.txt is in every fresh HOME)."""
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / "notes.json").write_text(json.dumps({
        "id": "notes-there", "instruction": "Look at the notes.", "setup": [], "max_steps": 2,
        "evaluator": {"conj": "and", "checks": [{"type": "file_exists", "path": "notes.txt"}]}}))
    return tasks


def output_within(p: subprocess.Popen, seconds: float) -> str:
    p.wait(timeout=seconds)
    p.log.seek(0)
    return p.log.read()
