"""explore_episode.py: ScreenExplorer's episode on one desktop, and a rollout of every desktop.

    from explore_episode import play, policy_chooser
    buffer, out = play(pool, {0, 1}, policy_chooser(policy, 128, 1.0, 1.0), steps=10, settle="watch", reset=True)
    python -m pytest -q tests/test_train_explore.py                  # its tests (real desktops)

An episode is a generator that reads like a gym loop (`explore`): the screen -> the chooser's answer
(`yield`; rollout.py batches the waiting desktops' screens into one policy call) -> the action, and
the settled screen back in the same round trip -> a Step into the iteration's buffer, --steps times.
A chooser maps the waiting desktops' Looks to answers: the policy (`policy_chooser`, one batched
generate) or uniformly random actions (`random_chooser`, the eval's baseline). train_explore.py
trains on these steps; explore_eval.py measures what episodes reach. Shapes in a buffer: N =
desktops x steps (fewer where a desktop failed).

Where this departs from the release (niuzaisheng/ScreenExplorer): no lockstep (the release stepped
every desktop together), so sampled tokens are not reproducible across runs; a desktop that fails
(no answer, a 5xx, garbage) ends its episode without the step it failed in, the environment's
failure, never the model's (only an action the VM refuses, 4xx, is a format failure); the window
list is read after each step only when asked (a reward term or the eval needs it: one GET /windows
per step).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import partial

from PIL import Image

import rollout
from actions import Action, Parsed, cursor_after, parse_action
from chat import explore_messages
from env import VMError, VMPool
from model import generate
from env import parse_settle


@dataclass
class Step:
    """One step of one desktop: what the model saw, said and did, and what came of it."""
    vm: int
    t: int
    before: Image.Image  # the screenshot the model saw (screen pixels)
    after: Image.Image  # the screen once it settled after the action (--settle)
    text: str  # the model's answer (or the random baseline's action string)
    parsed: object  # actions.Parsed, or None: a format failure, nothing was executed
    gen: object = None  # model.Generation (prompt + sampled ids), None for the random baseline
    error: str | None = None  # the VM rejected the action (4xx): counts as a format failure
    windows_before: dict | None = None  # {X window id: title} open before the step (when asked for)
    windows_after: dict | None = None  # ... and after it


def step_line(s: Step) -> dict:
    """What one step did, as a line of a trajectory file (training's and the eval's): the answer,
    the action it ran (screen pixels; None = a format failure, nothing ran), the VM's refusal if any."""
    return {"step": s.t, "intent": s.parsed.thought if s.parsed else None,
            "action": s.parsed.action.to_dict() if s.parsed else None, "valid": s.parsed is not None,
            "error": s.error, "text": s.text, "screen": list(s.before.size)}


@dataclass
class Look:
    """What a chooser gets of one desktop at one step: the screen, and where the mouse is (DragTo
    drags from there)."""
    vm: int
    t: int
    image: Image.Image
    cursor: tuple


def policy_chooser(policy, max_new_tokens: int, temperature: float, top_p: float):
    """list[Look] -> [(text, Parsed | None, Generation)] with ONE batched generate for all of them."""
    def choose(looks):
        gens = generate(policy, [explore_messages(o.image) for o in looks], max_new_tokens, temperature, top_p)
        # Coordinates are in the resized image the model saw; parse_action maps them to the screen.
        return [(g.text, parse_action(g.text, "explore", o.image.size, g.prompt.image_sizes[0], cursor=o.cursor), g)
                for g, o in zip(gens, looks)]
    return choose


def random_chooser(rng: random.Random):
    """The eval baseline: uniformly random pointer actions anywhere on the screen."""
    kinds = ("click", "double_click", "right_click", "move", "scroll")

    def choose(looks):
        out = []
        for o in looks:
            kind = rng.choice(kinds)
            act = Action(kind, x=rng.randrange(o.image.width), y=rng.randrange(o.image.height),
                         direction=rng.choice(("up", "down")) if kind == "scroll" else None)
            out.append((json.dumps(act.to_dict()), Parsed(act, ""), None))
        return out
    return choose


def explore(desk: rollout.Desktop, steps: int, settle, out: list, reset: bool, windows: bool = False,
            reset_after: bool = False):
    """One desktop's episode (a generator rollout.run steps in the desktop's thread): the screen ->
    the chooser's answer (`yield`) -> the action, the settled screen back -> a Step into `out` (the
    iteration's buffer), `steps` times. A malformed answer executes nothing (the screen is looked at
    again); a refused action (4xx) is a format failure too; any other VM failure ends the episode
    without the step it happened in: the environment failed, not the model. `windows`: record the
    window list before and after every step (Step.windows_before/_after; one GET /windows a step).
    `reset_after`: the desktop's next episode begins with a reset; start it now, in the background."""
    if reset:
        desk.reset()
    before = desk.screenshot()
    open_before = {w["id"]: w["title"] for w in desk.windows()} if windows else None
    # The mouse, for DragTo: /reset leaves it at the centre (training resets every --reset-every
    # iterations, the eval before each episode; between resets this is an approximation).
    cursor = (before.width // 2, before.height // 2)
    for t in range(steps):
        text, parsed, gen = yield Look(desk.vm, t, before, cursor)
        error = None
        try:
            after = desk.act(parsed.action, settle) if parsed else desk.screenshot()
        except VMError as e:
            if not e.refused:
                raise
            error, after = str(e), desk.screenshot()  # the VM refused the action (bad key name, ...)
        open_after = {w["id"]: w["title"] for w in desk.windows()} if windows else None
        # The step is kept even when malformed: its reward is 0, and below the buffer's mean that is
        # a negative advantage, which is how GRPO teaches the format.
        out.append(Step(desk.vm, t, before, after, text, None if error else parsed, gen, error, open_before, open_after))
        if error is None:
            cursor = cursor_after(parsed.action if parsed else None, cursor)
        before, open_before = after, open_after  # the after-screen is the next step's before-screen
    if reset_after:
        desk.reset_ahead()


def play(pool: VMPool, vms: set, choose, steps: int, settle, reset: bool, reset_after: bool = False,
         windows: bool = False) -> tuple[list[Step], rollout.Rollout]:
    """`steps` steps on each of `vms`, every desktop on its own, its episode pinned to it (it goes on
    from its own screen); reset first if `reset`; start the next iteration's reset when done if
    `reset_after`; `settle`: --settle's value; `windows`: record the window lists (explore).
    -> (the steps in time order (t, then vm), the Rollout: times, batch sizes, the desktops that failed)."""
    buffer: list[Step] = []
    episodes = [partial(explore, steps=steps, settle=parse_settle(settle), out=buffer, reset=reset,
                        windows=windows, reset_after=reset_after) for _ in vms]
    out = rollout.run(pool, episodes, choose, on=sorted(vms), desktops=sorted(vms), desc="rollout")
    for f in out.failures:
        print(f"vm {f.vm} dropped out: {f.error}", flush=True)
    return sorted(buffer, key=lambda s: (s.t, s.vm)), out
