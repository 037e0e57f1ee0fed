"""rollout.py: the stepper both trainers play their episodes with. No lockstep: each desktop steps on its own.

    out = rollout.play(pool, [episode, episode, ...], policy_fn, retries=1)
    out.results[k]          # what episode k returned, or a rollout.Lost (the environment failed it)
    out.times, out.batches  # time/* (below) and the size of every policy_fn call
    out.settles             # how every action settled (the server's X-Settle; settle_metrics sums it up)

An episode is a plain generator function of one desktop, run in that desktop's own thread. It reads
top to bottom like a gym loop; `yield` hands an observation to the policy and receives its answer:

    def episode(desk):                                # desk: a Desktop (one VM, below)
        desk.reset()
        screen = desk.screenshot()
        for t in range(10):
            answer = yield screen                     # batched with other desktops' observations
            screen = desk.act(parse(answer), "watch")  # act, let the screen settle, the settled screen
        return what_happened

The method's logic (what an observation holds, how an answer is parsed, when an episode ends, how
it is scored) stays in the trainer; this file only moves observations and answers:
  - Jobs: each free desktop takes the next job, so with more jobs than desktops (evaluation, task
    selection) a desktop that finishes one starts the next at once, its reset overlapping the others'
    steps. `on[k]` pins job k to one desktop (ScreenExplorer continues each desktop's own screen).
  - Batching: whatever observations are waiting go into ONE policy_fn(list[observation]) ->
    list[answer] call, in the main thread (torch stays there; the desktops' threads only do HTTP,
    decode screenshots and run the episode's Python). After the first observation arrives the
    stepper waits up to `gather` seconds for more, and not at all once every busy desktop is waiting
    for an answer. A batch formed while the policy was busy goes out as soon as it is free.
  - Environment failures: a VMError raised out of an episode (no answer, a 5xx, garbage) is the
    environment's failure, never the model's: the job is played again on another desktop (up to
    `retries` times) or dropped, and listed in `failures`. An episode that wants to keep what it did
    raises EnvFailure(error, partial) instead. A refused request (4xx, `refused`) is the sender's
    fault; what that means is the method's business, so the episode handles it itself.
  - Dead and slow desktops: before each job the desktop is revived (VMPool.revive: a health check, a
    dead local desktop restarted in this desktop's thread). One that cannot be revived leaves the
    run (its job goes to another). A call that hangs past its timeout (+ GRACE) is given up on: the
    VM is marked down, its job is lost (or retried), and its thread is left to finish on its own.

Timing (`out.times`, seconds; both trainers log them as metrics under these names):
  time/rollout     the run's wall time
  time/generation  inside policy_fn (the main thread computing)
  time/vm_wait     the main thread waiting with nothing to compute: no observation was ready, or it
                   held some back for the gather window. The learner's idle time; over an iteration's
                   wall time it is the trainers' `vm_wait_share`. (In a lockstep loop it equals the
                   VM phases' wall time, so the two are comparable.)
  time/reset, time/env, time/evaluate
                   desktop-seconds per desktop: the mean, over the desktops that played, of their
                   time in revive/reset/setup, act/settle/screenshot/windows, evaluate. They overlap
                   generation and one another, so they do not add up to the wall time.

`settle_metrics(out.settles)`: settle/seconds (mean seconds the screen got after an action) and
settle/capped (the share of watched actions that gave up at the server's cap).

Tested by tests/test_rollout.py (real HTTP servers on loopback, real desktops); measured by
bench/arpo_iter.py. Where this departs from the papers: ARPO's rollout (and ScreenExplorer's release)
steps every environment in lockstep, one batched generate per step after all of them answered. Here
which observations share a batch depends on timing, so a run's sampled tokens are not reproducible
across runs (task order, groups, seeds of everything else still are).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from PIL import Image

from plumbing import progress
from env import VMError, VMPool

# Ours, untuned: GATHER is short next to a step's generate (about a second on a GPU), long next to
# the gap between desktops that finished together; GRACE covers a VM's own retries.
GATHER = 0.05  # seconds a batch waits for more observations after its first one (see run)
GRACE = 5.0    # seconds past a call's own timeout before the stepper gives up on it

# ------------------------------------------------------------------------------------------------
# When an episode is the environment's failure


class EnvFailure(Exception):
    """Raised out of an episode: the environment failed it. `partial` is what the episode had done
    (it comes back in Lost.partial); a bare VMError out of an episode means the same, with none."""

    def __init__(self, error: str, partial=None):
        super().__init__(error)
        self.partial = partial


@dataclass
class Lost:
    """A job the environment failed, in the results in place of its return value, and in failures."""
    error: str
    vm: int | None  # the desktop it failed on (None: no desktop was left to play it)
    partial: object = None


# ------------------------------------------------------------------------------------------------
# One desktop as an episode sees it


class Desktop:
    """VM `vm` of the pool, driven from its own thread. Every call has the pool's timeout, marks the
    VM down if it never answers (VMPool.call), raises VMError, and adds its seconds to `times`."""

    def __init__(self, pool: VMPool, vm: int):
        self.pool, self.vm = pool, vm  # vm: the pool's index, what every call goes to
        self.id = pool.first + vm      # the VM's number in the run (under torchrun among all ranks'): what episodes record
        self.times = {"reset": 0.0, "env": 0.0, "evaluate": 0.0}
        self.settles: list[dict] = []  # the server's X-Settle of every action: seconds, until (quiet, cap, ...)
        self.deadline: float | None = None  # while a call runs: when the stepper stops waiting for it

    def _call(self, phase: str, fn_name: str, *args, **kwargs):
        t0 = time.monotonic()
        self.deadline = t0 + self.pool.timeout + GRACE
        try:
            return self.pool.call(self.vm, fn_name, *args, timeout=self.pool.timeout, **kwargs)
        finally:
            self.deadline = None
            self.times[phase] += time.monotonic() - t0

    def reset(self) -> dict:
        """POST /reset; if the desktop's last episode started one when it ended (reset_ahead), that
        one's answer, after waiting for what is left of it (one that failed is done again, now)."""
        ahead = self.pool.take_ahead(self.vm)
        if ahead is not None:
            t0 = time.monotonic()
            self.deadline = t0 + self.pool.timeout + GRACE
            try:
                return ahead.result()
            except VMError:
                pass
            finally:
                self.deadline = None
                self.times["reset"] += time.monotonic() - t0
        return self._call("reset", "reset")

    def reset_ahead(self) -> None:
        """Reset this desktop in the background now, for its next episode (which must begin with
        reset()): at the end of an episode, so the reset overlaps the learner's update and the other
        desktops' episodes (VMPool.reset_ahead)."""
        self.pool.reset_ahead(self.vm)

    def setup(self, steps: list[dict]) -> dict:
        return self._call("reset", "setup", steps)

    def screenshot(self) -> Image.Image:
        return self._call("env", "screenshot")

    def windows(self) -> list[dict]:
        return self._call("env", "windows")

    def evaluate(self, evaluator: dict) -> dict:
        return self._call("evaluate", "evaluate", evaluator)

    def act(self, action, settle: str | float, screenshot: bool = True) -> Image.Image | None:
        """Run `action`, let the screen settle on the server (`settle`: "watch" until it stops
        changing, with a cap; or seconds of a fixed sleep) and return the settled screen: ONE round
        trip (POST /action?settle=...&screenshot=png). How it settled goes into `settles`.
        screenshot=False: settle all the same, but answer None (an episode's last action: what
        follows is its evaluation, which needs the settled desktop, not a picture of it)."""
        out = self._call("env", "act", action, settle=settle, screenshot="png" if screenshot else False)
        self.settles.append(out.settle if screenshot else out.get("settle", {}))
        return out.image if screenshot else None


def settle_metrics(settles: list[dict]) -> dict:
    """settle/seconds: the mean seconds the screen got after an action (the watch's, or the fixed
    sleep); settle/capped: the share of watched actions that gave up at the cap (still changing)."""
    if not settles:
        return {}
    return {"settle/seconds": sum(s.get("seconds", 0.0) for s in settles) / len(settles),
            "settle/capped": sum(s.get("until") == "cap" for s in settles) / len(settles)}


def in_service(pool: VMPool) -> list[int]:
    """The desktops a plan can count on now: every local one (a dead one is restarted in its own
    thread when its next job starts) and every remote one that is up or answers /health again."""
    if pool.local is None:
        down = [i for i in range(pool.size) if not pool.alive[i]]
        if down:
            with ThreadPoolExecutor(len(down)) as ex:
                list(ex.map(pool.revive, down))
    return [i for i in range(pool.size) if pool.local is not None or pool.alive[i]]


# ------------------------------------------------------------------------------------------------
# The stepper


@dataclass
class Rollout:
    results: list                                  # per job: the episode's return value, or a Lost
    failures: list = field(default_factory=list)   # every environment failure (Lost), retried or not
    times: dict = field(default_factory=dict)      # time/* (the module docstring)
    batches: list = field(default_factory=list)    # the size of every policy_fn call
    settles: list = field(default_factory=list)    # how every action settled (the server's X-Settle)


@dataclass
class _Job:
    k: int                   # its index in the episodes given to play()
    tries: int = 0           # plays the environment failed so far
    avoid: int | None = None  # the desktop it last failed on
    ticket: int = -1         # which play of it a desktop's events belong to


_STOP = object()  # to a desktop's thread: stop (after the run, or when the main thread raises)


def _desktop_thread(desk: Desktop, inbox: queue.Queue, events: queue.Queue) -> None:
    """One desktop's loop: take a job, revive the desktop, play the episode, report; until _STOP.
    Everything that happens is an event (kind, vm, ticket, payload, time) for the main thread."""
    while True:
        msg = inbox.get()
        if msg is _STOP:
            return
        ticket, episode = msg

        def post(kind, payload=None):
            events.put((kind, desk.vm, ticket, payload, time.monotonic()))
        t0 = time.monotonic()
        alive = desk.pool.revive(desk.vm)  # a dead local desktop restarts here, overlapping the others
        desk.times["reset"] += time.monotonic() - t0
        if not alive:
            post("gone", f"{desk.pool.urls[desk.vm]} is down ({desk.pool.why_down[desk.vm]})")
            return
        try:
            gen = episode(desk)
            obs = next(gen)
            while True:
                post("obs", obs)
                answer = inbox.get()
                if answer is _STOP:
                    gen.close()
                    return
                obs = gen.send(answer)
        except StopIteration as e:
            post("done", e.value)
        except EnvFailure as e:
            post("lost", e)
        except VMError as e:
            post("lost", EnvFailure(str(e)))
        except BaseException as e:  # noqa: BLE001 -- a bug in the episode: the main thread re-raises it
            post("bug", e)
            return


def play(pool: VMPool, episodes: list, policy_fn, retries: int = 0, on: list | None = None,
        desktops: list[int] | None = None, gather: float = GATHER, desc: str = "episodes") -> Rollout:
    """Play every episode (a generator function of a Desktop) on the pool's desktops, each desktop
    stepping on its own; the module docstring has the rules. `on[k]`: the desktop job k must run on
    (None: any). `desktops`: the ones to use (default: every one). -> Rollout."""
    t_start = time.monotonic()
    use = sorted(set(range(pool.size) if desktops is None else desktops))
    desks = {i: Desktop(pool, i) for i in use}
    inbox = {i: queue.Queue() for i in use}
    events: queue.Queue = queue.Queue()
    for i in use:  # daemon threads: one stuck in a hung call never keeps the program alive
        threading.Thread(target=_desktop_thread, args=(desks[i], inbox[i], events), daemon=True,
                         name=f"desktop-{i}").start()
    out = Rollout(results=[None] * len(episodes))
    todo = deque(_Job(k) for k in range(len(episodes)))  # jobs not playing now, in the order to play them
    playing: dict[int, _Job] = {}     # desktop -> its job
    waiting: dict[int, tuple] = {}    # desktop -> (observation, when it came): waits for an answer
    gone: set[int] = set()            # desktops out of this run
    played: set[int] = set()
    tickets = iter(range(1 << 62))
    times = {"time/generation": 0.0, "time/vm_wait": 0.0}
    pb = progress.bar(len(episodes), desc)

    def pin(job):
        return on[job.k] if on is not None else None

    def fits(job, i) -> bool:
        if pin(job) is not None:
            return pin(job) == i
        # A job the environment failed goes to another desktop, unless no other is left.
        return job.avoid != i or not [j for j in use if j not in gone and j != i]

    def finish(job, result) -> None:  # a job is over: its result, a tick of the bar
        out.results[job.k] = result
        pb.update(1)

    def fail(i, job, err: EnvFailure | str) -> None:
        lost = Lost(str(err), i, getattr(err, "partial", None))
        out.failures.append(lost)
        if job.tries < retries and pin(job) is None:
            job.tries, job.avoid = job.tries + 1, i
            todo.appendleft(job)  # ahead of the fresh jobs: the run should not end waiting for it
        else:
            finish(job, lost)

    def assign() -> None:
        for i in use:
            if i in playing or i in gone:
                continue
            job = next((j for j in todo if fits(j, i)), None)
            if job is not None:
                todo.remove(job)
                job.ticket = next(tickets)
                playing[i] = job
                played.add(i)
                inbox[i].put((job.ticket, episodes[job.k]))
        # A job no desktop left can take (its pinned one is gone, or every one is) is lost.
        for job in [j for j in todo if not any(fits(j, i) for i in use if i not in gone)]:
            todo.remove(job)
            why = "; ".join(f"{pool.urls[i]}: {w}" for i, w in enumerate(pool.why_down) if w)  # revive's, mark_down's
            out.failures.append(Lost("no desktop was left to play it" + (f" ({why})" if why else ""), pin(job)))
            finish(job, out.failures[-1])

    def handle(kind, i, ticket, payload, when) -> None:
        job = playing.get(i)
        if job is None or job.ticket != ticket:
            return  # from a play the stepper gave up on
        if kind == "obs":
            waiting[i] = (payload, when)
            return
        del playing[i]
        if kind == "done":
            finish(job, payload)
        elif kind == "lost":
            fail(i, job, payload)
        elif kind == "gone":  # the desktop could not be revived: the job never started, no try spent
            gone.add(i)
            todo.appendleft(job)
        else:
            raise payload  # "bug": an exception that is not the environment's (the traceback is the episode's)

    try:
        assign()
        while todo or playing:
            # -- wait for what the desktops do (learner idle). With observations in hand, only until
            # the gather window closes; otherwise wake now and then for the watchdog.
            now = time.monotonic()
            wait = max(0.0, min(w for _, w in waiting.values()) + gather - now) if waiting else 0.5
            if waiting and len(waiting) == len(playing):
                wait = 0.0
            try:
                ev = events.get(timeout=wait) if wait > 0 else events.get_nowait()
                handle(*ev)
                while True:  # everything else that happened meanwhile
                    handle(*events.get_nowait())
            except queue.Empty:
                pass
            times["time/vm_wait"] += time.monotonic() - now
            # -- the watchdog: a call past its deadline is given up on; nobody waits for it
            for i, job in list(playing.items()):
                deadline = desks[i].deadline
                if deadline is not None and time.monotonic() > deadline:
                    why = f"{pool.urls[i]} did not finish a call within {pool.timeout:g} s (+{GRACE:g} s)"
                    pool.mark_down(i, why)
                    del playing[i]
                    waiting.pop(i, None)
                    gone.add(i)
                    fail(i, job, why)
            assign()
            # -- ONE policy call for every observation waiting, when all busy desktops wait or the
            # window closed (a desktop mid-action would hold the others for its whole step)
            if waiting and (len(waiting) == len(playing) or
                            time.monotonic() >= min(w for _, w in waiting.values()) + gather):
                vms = sorted(waiting, key=lambda i: playing[i].k)  # job order: the same batch, the same order
                t0 = time.monotonic()
                answers = policy_fn([waiting[i][0] for i in vms])
                times["time/generation"] += time.monotonic() - t0
                if len(answers) != len(vms):
                    raise ValueError(f"policy_fn answered {len(answers)} of {len(vms)} observations.")
                out.batches.append(len(vms))
                for i, answer in zip(vms, answers):
                    del waiting[i]
                    inbox[i].put(answer)
    finally:
        pb.close()
        for i in use:
            inbox[i].put(_STOP)
    per = {p: sum(desks[i].times[p] for i in played) / max(1, len(played)) for p in ("reset", "env", "evaluate")}
    out.times = {"time/rollout": time.monotonic() - t_start, **times, **{f"time/{p}": s for p, s in per.items()}}
    out.settles = [s for i in use for s in desks[i].settles]
    return out
