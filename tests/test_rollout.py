"""Tests for rollout.py, the stepper both trainers play their episodes with: no lockstep.

Run: python -m pytest -q tests/test_rollout.py        (~1 min on 2 cores)

The desktops here are real HTTP servers on loopback (`LoopbackVM`, below): they speak the part of
vm_server.py's protocol an episode uses (health, reset, setup, screenshot, windows, action,
evaluate) and their /action can be held until an event, kept silent, trickled byte by byte, or
answered with 500 (the VM failed) or 400 (the action is refused), on purpose. A held /action makes
the order of events certain instead of timed: a lockstep stepper would wait for the held desktop
and never reach the event that releases it (the hold then runs out, and the test says so).
- a desktop held mid-step holds nobody: the others' episodes finish first;
- more jobs than desktops: a freed desktop takes the next job (and resets for it), while another
  is still busy;
- a silent desktop's job is retried on another desktop (or dropped, retries=0), nobody waits for it
  past its timeout, and a call that trickles past its deadline is given up on (the watchdog); a
  desktop that cannot be revived leaves the run and its job goes elsewhere without a try spent;
- generation batches every observation that is waiting, in job order, and waits out no gather
  window when every busy desktop is waiting for an answer;
- blame: a 500 from /action drops ARPO's episode (env_failures, no format penalty) and
  ScreenExplorer's step; a 400 is the model's (a format failure); --settle parses.
Real desktops whose X server is killed mid-episode are in tests/test_train_arpo.py and
tests/test_train_explore.py; train_arpo.iteration with a killed and a frozen desktop in
tests/test_faults.py.
"""
from __future__ import annotations

import io
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import torch
from PIL import Image

import rollout
import train_arpo as A
import train_explore as X
import env
from env import VMPool
from model import load_policy
from env import Task

from conftest import wait_for

HOLD = 30.0  # seconds a held /action waits at most for its release (a lockstep stepper would never release it)


# ------------------------------------------------------------------------------------------------
# A real HTTP server on loopback that speaks enough of vm_server.py's protocol


class LoopbackVM:
    """One desktop stand-in on 127.0.0.1. `action`: "ok", "hold" (wait for `release`, at most HOLD s),
    "silent" (never answer until the test ends), "trickle" (a body one byte per 0.2 s), "fail" (500)
    or "refuse" (400); `health`: its status. The screen is a small PNG that changes with each action."""

    def __init__(self, action: str = "ok", health: int = 200):
        self.action, self.health = action, health
        self.release, self.stop = threading.Event(), threading.Event()
        self.calls: list[str] = []
        self.actions = 0
        self.waited_out = False  # a held action was never released (it ran out of HOLD)
        self.busy = threading.Event()  # set while a silent / trickling action is still in progress
        vm = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as requests.Session expects

            def log_message(self, *a):  # quiet
                pass

            def answer(self, status: int, body, ctype: str = "application/json", headers=()):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def screen(self) -> bytes:
                buf = io.BytesIO()
                Image.new("RGB", (64, 48), (vm.actions * 40 % 256, 90, 120)).save(buf, format="PNG")
                return buf.getvalue()

            def do_GET(self):
                path = urlsplit(self.path).path
                vm.calls.append(path)
                if path == "/health":
                    return self.answer(vm.health, {"ok": True, "screen": [64, 48]} if vm.health == 200
                                       else {"error": "this desktop's X server died"})
                if path == "/windows":
                    return self.answer(200, {"windows": []})
                return self.answer(200, self.screen(), "image/png")

            def do_POST(self):
                url = urlsplit(self.path)
                vm.calls.append(url.path)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if url.path == "/evaluate":
                    return self.answer(200, {"score": 0.0, "results": []})
                if url.path != "/action":
                    return self.answer(200, {"ok": True})
                if vm.action == "hold":
                    vm.waited_out = vm.waited_out or not vm.release.wait(HOLD)
                elif vm.action == "silent":
                    vm.busy.set()
                    vm.stop.wait(HOLD)
                    return
                elif vm.action == "trickle":  # every byte well within the client's read timeout
                    vm.busy.set()
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    for _ in range(100):
                        if vm.stop.wait(0.2):
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    return
                elif vm.action == "fail":
                    return self.answer(500, {"error": "the VM failed: XError: display gone"})
                elif vm.action == "refuse":
                    return self.answer(400, {"error": "unknown key name(s) ['hyper']"})
                vm.actions += 1
                settled = {"seconds": 0.0, "until": "fixed", "first_change": None}
                if "screenshot=png" in url.query:  # the settled screen in the same answer (?settle=...)
                    return self.answer(200, self.screen(), "image/png", [("X-Settle", json.dumps(settled))])
                self.answer(200, {"ok": True, "settle": settled})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, path: str) -> int:
        return self.calls.count(path)

    def close(self):
        self.release.set()
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def loopback():
    """loopback(*kinds, timeout=30) -> (VMPool over new LoopbackVMs, the LoopbackVMs); closed after."""
    made = []

    def make(*kinds, timeout: float = 30.0):
        vms = [LoopbackVM(**k) if isinstance(k, dict) else LoopbackVM(k) for k in kinds]
        pool = VMPool([vm.url for vm in vms], token="t", timeout=timeout)
        made.append((pool, vms))
        return pool, vms
    yield make
    for pool, vms in made:
        pool.close()
        for vm in vms:
            vm.close()


def moves(steps: int, done: list | None = None, after=None):
    """An episode: reset, then `steps` x (yield (vm, t) -> a move, a fixed settle of 0, the screen).
    Returns the desktop it ran on; appends it to `done` and calls after(done) once finished."""
    def episode(desk: rollout.Desktop):
        desk.reset()
        desk.screenshot()
        for t in range(steps):
            yield (desk.vm, t)
            desk.act({"type": "move", "x": 1, "y": 1}, 0.0)
        if done is not None:
            done.append(desk.vm)
            after(done)
        return desk.vm
    return episode


def recorder():
    """A policy_fn that answers None to everything and records every batch it got."""
    batches = []

    def fn(observations):
        batches.append(list(observations))
        return [None] * len(observations)
    return fn, batches


# ------------------------------------------------------------------------------------------------
# No lockstep


def test_a_held_desktop_holds_nobody(loopback):
    pool, (fast0, fast1, held) = loopback("ok", "ok", "hold")
    done = []
    # The held desktop's first action waits until both others finished all their 3 steps.
    release = lambda d: set(d) >= {0, 1} and held.release.set()  # noqa: E731
    fn, batches = recorder()
    out = rollout.play(pool, [moves(3, done, release)] * 3, fn)
    assert not held.waited_out, "the held desktop held the others (lockstep)"
    assert sorted(done[:2]) == [0, 1] and done[2] == 2 and out.results == [0, 1, 2]
    assert out.failures == [] and fast0.actions == fast1.actions == held.actions == 3
    # each action answered with its settled screen and the server's X-Settle, in one round trip
    assert len(out.settles) == 9 and all(s["until"] == "fixed" for s in out.settles)
    assert fast0.count("/screenshot") == 1  # only the episode's first look: every later screen came with its action
    # every desktop's observations reached the policy, each exactly once per step
    assert sorted(o for b in batches for o in b) == [(vm, t) for vm in range(3) for t in range(3)]


def test_more_jobs_than_desktops_reuse_freed_desktops(loopback):
    pool, (fast, held) = loopback("ok", "hold")
    done = []
    # Desktop 1's first action waits until desktop 0 finished four episodes: jobs 0, 2, 3, 4.
    release = lambda d: d.count(0) == 4 and held.release.set()  # noqa: E731
    fn, _ = recorder()
    out = rollout.play(pool, [moves(2, done, release)] * 5, fn)
    assert not held.waited_out, "a freed desktop waited for the busy one (waves)"
    assert out.results == [0, 1, 0, 0, 0] and done == [0, 0, 0, 0, 1]
    assert fast.count("/reset") == 4 and held.count("/reset") == 1  # a reset per job, in its desktop's thread
    assert out.times["time/rollout"] > 0 and out.times["time/env"] > 0 and out.times["time/reset"] > 0


# ------------------------------------------------------------------------------------------------
# Dying desktops: retried or dropped, nobody waits past the timeout


@pytest.mark.parametrize("retries", [1, 0])
def test_a_silent_desktops_job_is_retried_or_dropped_and_nobody_waits_for_it(loopback, retries):
    pool, (ok, silent) = loopback("ok", "silent", timeout=1.0)
    fn, _ = recorder()
    out = rollout.play(pool, [moves(2)] * 2, fn, retries=retries)
    assert silent.busy.is_set() and not silent.stop.is_set()  # its /action still hangs: nobody waited for it
    assert [(f.vm, "did not answer within 1 s" in f.error) for f in out.failures] == [(1, True)]
    assert not pool.alive[1]  # marked down: the next job there revives it first
    if retries:
        assert out.results == [0, 0]  # played again on the other desktop
    else:
        assert out.results[0] == 0 and isinstance(out.results[1], rollout.Lost) and out.results[1].vm == 1


def test_a_call_past_its_deadline_is_given_up_on(loopback, monkeypatch):
    # The trickling desktop sends its answer one byte every 0.2 s: the read timeout (1 s) never
    # fires, the watchdog does, at timeout + GRACE.
    monkeypatch.setattr(rollout, "GRACE", 0.5)
    pool, (ok, slow) = loopback("ok", "trickle", timeout=1.0)
    fn, _ = recorder()
    t0 = time.monotonic()
    out = rollout.play(pool, [moves(2)] * 2, fn, retries=1)
    assert slow.busy.is_set() and not slow.stop.is_set()  # still trickling when the run was over
    assert out.results == [0, 0] and [f.vm for f in out.failures] == [1]
    assert "did not finish a call within 1 s" in out.failures[0].error and not pool.alive[1]
    assert time.monotonic() - t0 < 15  # the trickle alone would take 20 s


def test_a_desktop_that_cannot_be_revived_leaves_the_run(loopback):
    pool, (ok, dead) = loopback("ok", {"health": 503})
    fn, _ = recorder()
    out = rollout.play(pool, [moves(1)] * 3, fn, retries=0)
    assert out.results == [0, 0, 0] and out.failures == []  # its job went elsewhere, no try spent
    assert dead.count("/reset") == 0 and not pool.alive[1] and "503" in pool.why_down[1]


def test_a_job_no_desktop_is_left_for_says_why_they_are_down(loopback):
    """The one desktop fails its health check: the job is lost, and its error says why (the message
    alone once hid a CI failure's cause: a /health refused during a reset)."""
    pool, (dead,) = loopback({"health": 503})
    fn, _ = recorder()
    out = rollout.play(pool, [moves(1)], fn, retries=0)
    assert isinstance(out.results[0], rollout.Lost) and out.results[0].vm is None
    assert out.results[0].error.startswith("no desktop was left to play it (") and "503" in out.results[0].error


def test_a_bug_in_an_episode_is_raised_not_blamed_on_the_environment(loopback):
    pool, _ = loopback("ok")

    def broken(desk):
        yield 1
        raise KeyError("a bug")
    with pytest.raises(KeyError, match="a bug"):
        rollout.play(pool, [broken], lambda obs: [None] * len(obs))


# ------------------------------------------------------------------------------------------------
# Batching


def test_a_reset_started_when_an_episode_ends_is_taken_by_the_next_one(loopback):
    """reset_ahead: an episode that ends starts its desktop's next /reset in the background (it then
    runs while the learner updates); the next episode's reset() takes that answer, no second /reset."""
    pool, (vm,) = loopback("ok")

    def first(desk):
        desk.reset()
        yield "look"
        desk.reset_ahead()
        return "first"
    fn, _ = recorder()
    assert rollout.play(pool, [first], fn).results == ["first"]
    # nobody asks for it, yet the desktop is reset: the run is over, the "update" could run now
    wait_for(lambda: vm.count("/reset") == 2, "the reset started ahead", timeout=10, every=0.01)
    out = rollout.play(pool, [moves(1)], fn)
    assert out.results == [0] and vm.count("/reset") == 2  # taken, not done again
    out = rollout.play(pool, [moves(1)], fn)  # nothing pending now: a reset of its own
    assert vm.count("/reset") == 3


def test_generation_batches_every_waiting_observation_in_job_order(loopback):
    pool, _ = loopback("ok", "ok", "ok", "ok")
    fn, batches = recorder()
    # A window of 10 s would be waited out at every step if the stepper did not see that every
    # busy desktop was already waiting for its answer.
    out = rollout.play(pool, [moves(3)] * 4, fn, gather=10.0)
    assert [len(b) for b in batches] == [4, 4, 4] and out.batches == [4, 4, 4]
    assert [b for b in batches] == [[(vm, t) for vm in range(4)] for t in range(3)]
    assert out.times["time/rollout"] < 10
    assert out.times["time/generation"] >= 0 and out.times["time/vm_wait"] > 0


# ------------------------------------------------------------------------------------------------
# Blame: the environment's failures are the environment's; a refused action is the model's

TASK = Task("look", "Look at the screen.", [], {"conj": "and", "checks": [{"type": "file_exists", "path": "x"}]},
            max_steps=2)


def test_arpo_a_500_drops_the_episode_and_a_400_is_a_format_failure(loopback):
    pool, _ = loopback("fail", "refuse")
    args = A.Args(vms="2", group_size=2, model="tiny", max_steps=2, max_pixels=12544, max_new_tokens=8, settle="0",
                  lr=1e-3)
    policy = load_policy("tiny", seed=0, max_pixels=12544)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
    click = lambda obs: ["Thought: Click it.\nAction: click(start_box='(5,5)')"] * len(obs)  # noqa: E731
    tr = A.Trainer(args, pool, policy, opt, None, click, None, [TASK])
    m, eps = A.iteration(tr, 0, lambda n: [TASK.id] * n)
    failed, refused = eps
    # VM 0 answered 500: the environment failed; the episode is dropped, nobody pays a penalty for it
    assert (failed.end, failed.vm) == ("dropped", 0) and "500" in failed.error and failed.format_ok == [True]
    # VM 1 refused the action (400): the model's answer was not a valid action after all
    assert (refused.end, refused.format_ok, refused.reward) == ("format", [False], -0.5)
    assert "400" in refused.actions[0]["refused"]
    assert (m["episodes"], m["dropped"], m["env_failures"]) == (1, 1, 1) and list(m["env_errors"]) == ["0"]
    assert [b["vm"] for b in m["batch"]] == [1]  # only the model's own failure is trained on
    assert m["vm_wait_share"] == pytest.approx(m["time/vm_wait"] / m["time/iteration"])
    assert "settle/seconds" not in m  # no action ran: nothing settled


def test_explore_a_500_drops_the_step_and_a_400_is_a_format_failure(loopback):
    pool, (failing, refusing) = loopback("fail", "refuse")
    buffer, out = X.play_steps(pool, {0, 1}, X.random_policy(random.Random(0)), 3, "0", reset=True)
    # desktop 0's first action failed: no step of it (not even as a format failure), one failure
    assert [(f.vm, "500" in f.error) for f in out.failures] == [(0, True)]
    assert [(s.vm, s.step) for s in buffer] == [(1, 0), (1, 1), (1, 2)]
    # desktop 1 refused every action: format failures (nothing ran), the answer and the refusal kept
    assert all(not s.format_ok and s.parsed is not None and "400" in s.error for s in buffer)


def test_settle_metrics_by_hand():
    settles = [{"seconds": 0.2, "until": "quiet"}, {"seconds": 1.0, "until": "cap"}, {"seconds": 0.3, "until": "nochange"}]
    # mean seconds (0.2 + 1.0 + 0.3) / 3 = 0.5; one of three hit the cap
    assert rollout.settle_metrics(settles) == pytest.approx({"settle/seconds": 0.5, "settle/capped": 1 / 3})
    assert rollout.settle_metrics([]) == {}


def test_settle_parses():
    assert [env.parse_settle(v) for v in ("watch", "WATCH", "0.5", 2, 0, "10")] == ["watch", "watch", 0.5, 2.0,
                                                                                          0.0, 10.0]
    assert [env.parse_settle(v) for v in ("soon", "-1", 11, None, "nan")] == [None] * 5


def test_who_is_to_blame_by_status():
    from env import VMError
    assert [VMError("x", s).refused for s in (400, 404, 413, 422)] == [True] * 4
    assert [VMError("x", s).refused for s in (None, 401, 403, 408, 500, 503)] == [False] * 6
