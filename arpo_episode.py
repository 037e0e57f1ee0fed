"""arpo_episode.py: one ARPO episode on one desktop (UI-TARS multi-turn, OSWorld's scoring), and many.

    from arpo_episode import play_all
    eps, out = play_all(pool, [task] * 8, policy_fn, args, groups=[0] * 8)   # one group of 8 rollouts
    python -m pytest -q tests/test_train_arpo.py                             # its tests (real desktops)

An episode is a generator that reads like a gym loop (`play`): reset, the task's setup, then
screenshot -> the policy's answer (`answer = yield observation`; rollout.py batches the waiting
desktops' observations into one policy call) -> parse the UI-TARS answer in the image the model saw
-> act (the settled screen comes back in the same round trip) until finished() / call_user() / an
unparseable answer / max steps; then the score, as OSWorld's DesktopEnv.evaluate (outcome_scores).
train_arpo.py trains on these episodes; arpo_eval.py evaluates and selects tasks with them. `args`
is train_arpo.py's Args (read here: max_steps, max_images, min_pixels, max_pixels, settle,
stop_on_format_error, format_penalty); a policy_fn is observations -> answers (model.Generations,
or text from a scripted stand-in, as the tests use).

Where this departs from ARPO (train_arpo.py's docstring has the whole list): a VM that fails (no
answer, a 5xx, garbage) drops its episode as the environment's failure, never a format failure of
the model; only an action the VM refuses (4xx) is the model's. The format penalty is paid once per
trajectory (ARPO's code), and an unparseable answer ends the episode unless
--no-stop-on-format-error.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import partial
from io import BytesIO

from PIL import Image

import rollout
from plumbing import rundir
from actions import parse_action, smart_resize
from chat import uitars_messages
from env import VMError, VMPool
from model import Generation
from env import parse_settle
from rollout import EnvFailure
from env import Task

# ------------------------------------------------------------------------------------------------
# Episodes: what one VM did on one task


@dataclass
class Episode:
    """One rollout of one task on one VM. Step i: screenshots[i] was seen, assistant[i] answered."""
    task: Task
    vm: int
    group: int = 0
    iteration: int = 0
    screenshots: list = field(default_factory=list)   # PIL images (PNG bytes once stored for replay)
    assistant: list = field(default_factory=list)     # per step: sampled token ids, or text (scripted)
    logprobs: list = field(default_factory=list)      # per step: the sampler's log-prob per id, or None (scripted)
    texts: list = field(default_factory=list)         # per step: the answer as text
    thoughts: list = field(default_factory=list)      # per step: the parsed Thought ("" if unparseable)
    actions: list = field(default_factory=list)       # per step: Action dict in screen pixels, or None
    format_ok: list = field(default_factory=list)     # per step: the answer parsed into an action the VM took
    end: str | None = None     # done | fail | format | max_steps | dropped (the VM failed)
    error: str | None = None   # why it was dropped
    score: float = 0.0         # evaluator score, hard protocol (the training signal)
    score_standard: float = 0.0  # standard protocol: running out of steps counts as FAIL
    reward: float = 0.0        # score - format penalty
    replayed: bool = False     # came from the replay buffer (an earlier iteration)
    job: int = -1              # its index in the list of jobs played together (play_all)

    @property
    def broken(self) -> bool:
        """An answer of it did not parse (or was refused): what the format penalty is paid for, once."""
        return not all(self.format_ok)


def to_record(ep: Episode, vm_offset: int = 0) -> dict:
    """A plain dict for the replay buffer and checkpoints: screenshots as PNG bytes (~10x smaller than
    pixels), the task as a dict, so unpickling never needs this module's classes."""
    def png(img):
        if isinstance(img, bytes):
            return img
        buf = BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    d = {f.name: getattr(ep, f.name) for f in fields(Episode)}
    # the VM by its number among all ranks' (`vm_offset`: this rank's first VM's); the task without
    # its scripted solution, which is the test suite's and never part of what the policy learns from
    task = {**asdict(ep.task), "solution": []}
    return {**d, "vm": vm_offset + ep.vm, "task": task, "screenshots": [png(s) for s in ep.screenshots]}


def from_record(d: dict) -> Episode:
    return Episode(**{**d, "task": Task(**d["task"])})


def as_image(x) -> Image.Image:
    """A stored screenshot (PNG bytes, from the replay buffer) or a live one, as a PIL image."""
    return Image.open(BytesIO(x)).convert("RGB") if isinstance(x, bytes) else x


@dataclass
class Observation:
    """What a policy gets for one VM at one step. The model reads `messages`; a scripted stand-in
    (tests) can read the task, the step and where the screen is, in the image the model would see."""
    task: Task
    vm: int
    step: int
    messages: list          # the UI-TARS prompt: instruction, screenshots, earlier answers
    screen: tuple           # (w, h) of the screenshot in screen pixels
    image_size: tuple       # (w, h) of the screenshot as the model sees it (coordinates live here)
    job: int = 0            # which of the episodes played together this is (a scripted policy plans by it)



# ------------------------------------------------------------------------------------------------
# One episode on one desktop (a generator rollout.run steps in the desktop's own thread), and many


def observe(e: Episode, img: Image.Image, args) -> Observation:
    """The prompt of the episode's next step: its screenshots so far, the last one `img`."""
    # The size the processor resizes this screenshot to: UI-TARS answers in those pixels.
    h, w = smart_resize(img.height, img.width, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    # The history: earlier answers as the sampled ids themselves, so this prompt and the training
    # sequence built from the same episode later hold the very same tokens.
    msgs = uitars_messages(e.task.instruction, e.screenshots, e.assistant, max_images=args.max_images)
    return Observation(e.task, e.vm, len(e.assistant), msgs, img.size, (w, h), e.job)


def record(e: Episode, o: Observation, out, args):
    """One answer into its episode: parsed in the image the model saw. -> the Action to run, or None."""
    if isinstance(out, Generation):  # the model: keep the sampled ids, parse in the image it saw
        text, content, seen, lps = out.text, list(out.completion_ids), out.prompt.image_sizes[-1], out.logprobs
    else:                            # a scripted stand-in: text, in o.image_size coordinates
        text, content, seen, lps = str(out), str(out), o.image_size, None
    parsed = parse_action(text, "uitars", o.screen, seen)
    e.texts.append(text)
    e.assistant.append(content)
    e.logprobs.append(None if lps is None else [float(x) for x in lps])
    e.thoughts.append(parsed.thought if parsed else "")
    e.actions.append(parsed.action.to_dict() if parsed else None)
    e.format_ok.append(parsed is not None)
    if parsed is None:
        e.end = "format" if args.stop_on_format_error else None  # ALGO: ARPO stops the episode
    elif parsed.action.type in ("done", "fail"):
        e.end = parsed.action.type  # finished() / call_user(): nothing to execute
    else:
        return parsed.action
    return None


def play(desk: rollout.Desktop, task: Task, args, group: int = 0, iteration: int = 0, job: int = 0):
    """One ARPO episode on one desktop, top to bottom: reset, the task's setup, then screenshot ->
    the policy's answer (`yield`, batched with other desktops' by rollout.run) -> parse (UI-TARS,
    coordinates mapped from the image the model saw to the screen) -> act (the settled screen comes
    back) until finished() / call_user() / an unparseable answer / max steps; then the score, as
    soon as the episode ends (as ARPO does). -> the Episode. A VM that fails at any point (no answer,
    5xx, garbage) drops it: EnvFailure with the Episode so far, the environment's fault, not the
    model's. Only a refused action (4xx) is the model's: a format failure."""
    settle = parse_settle(args.settle)
    e = Episode(task, desk.vm, group, iteration, job=job)
    try:
        desk.reset()
        desk.setup(task.setup)
        img = desk.screenshot()
        while e.end is None:
            e.screenshots.append(img)
            o = observe(e, img, args)
            answer = yield o
            action = record(e, o, answer, args)
            if action is not None:
                try:
                    img = desk.act(action, settle)  # a window takes a moment to map; the model should see it
                except VMError as err:
                    if not err.refused:
                        raise
                    # The VM refused the action (a key it does not know, say): the model's answer was
                    # not a valid action after all, so it counts as a format failure.
                    e.format_ok[-1] = False
                    e.actions[-1] = {**e.actions[-1], "refused": str(err)}
                    e.end = "format" if args.stop_on_format_error else None
                    action = None
            if e.end is None and len(e.assistant) >= min(args.max_steps, task.max_steps):
                e.end = "max_steps"
            if e.end is None and action is None:
                img = desk.screenshot()  # nothing ran, and the episode goes on: look again
        checks = None
        if not task.infeasible:  # ALGO: execution-based score (an infeasible task's is the client's)
            checks = desk.evaluate(task.evaluator)
            if not isinstance(checks, dict) or "score" not in checks:
                # No score is not a score of 0: training on it would punish the policy for a VM fault.
                raise VMError("the VM's /evaluate answered without a score")
        score_episode(e, checks["score"] if checks else None, args)
        desk.reset_ahead()  # the next episode here begins with a reset: it runs while the learner updates
    except VMError as err:
        e.end, e.error = "dropped", str(err)
        raise EnvFailure(str(err), partial=e) from None
    return e


def outcome_scores(infeasible: bool, actions: list, end: str | None, evaluator_score: float | None = None):
    """ALGO: (hard, standard) score of one finished episode, by OSWorld's `DesktopEnv.evaluate`:
    if the last action is FAIL (call_user()), an infeasible task scores 1 and a feasible one 0,
    whatever its checks say; otherwise an infeasible task scores 0 and a feasible one its
    evaluator's score. The two protocols differ only in what "the last action" is: the standard one
    replaces it by FAIL when the episode ran out of steps (end == "max_steps"), the hard one (ARPO's
    OSWorld-Hard, and ARPO's training environment) keeps what the agent did. So a timeout passes an
    infeasible task and fails a feasible one under standard only. An unparseable last answer is no
    FAIL (ARPO's environment turns it into DONE). actions: Action dicts per step (None: unparseable)."""
    def score(last):
        if infeasible:
            return 1.0 if last == "fail" else 0.0
        return 0.0 if last == "fail" else float(evaluator_score)
    last = actions[-1]["type"] if actions and actions[-1] else None
    return score(last), score("fail" if end == "max_steps" else last)


def score_episode(e: Episode, evaluator_score: float | None, args) -> None:
    """Fill score (hard), score_standard and reward of a finished episode, in place. Feasible tasks:
    the evaluator's checks on the VM, overruled by a last FAIL; infeasible ones (evaluator_score
    None): 1 iff the last action is `fail` (call_user()); outcome_scores has the whole rule."""
    e.score, e.score_standard = outcome_scores(e.task.infeasible, e.actions, e.end, evaluator_score)
    # ALGO: ARPO's trajectory reward: the task score, minus the format penalty once if any answer
    # did not parse (its code: eval_result + 0.5 * format_reward, format_reward = -1).
    e.reward = e.score - args.format_penalty * e.broken


def play_all(pool: VMPool, tasks: list[Task], policy_fn, args, groups: list[int] | None = None,
             iteration: int = 0, retries: int = 0, desc: str = "episodes",
             first_job: int = 0) -> tuple[list[Episode], rollout.Rollout]:
    """Play tasks[k] (repeats allowed; group groups[k]) on the pool's desktops, each stepping on its
    own (rollout.run: a freed desktop takes the next task, so more tasks than desktops are played
    in turns; one the environment failed is played again elsewhere up to `retries` times).
    Episode k is job number first_job + k (under torchrun: numbered among all ranks' jobs).
    -> (one Episode per task, in order: finished, or `dropped` with its error; the Rollout: times,
    batch sizes, environment failures)."""
    groups = groups or [0] * len(tasks)
    episodes = [partial(play, task=t, args=args, group=g, iteration=iteration, job=first_job + k)
                for k, (t, g) in enumerate(zip(tasks, groups))]
    out = rollout.run(pool, episodes, policy_fn, retries=retries, desc=desc)
    eps = [r if not isinstance(r, rollout.Lost) else
           r.partial or Episode(tasks[k], -1 if r.vm is None else r.vm, groups[k], iteration, end="dropped",
                                error=r.error, job=first_job + k) for k, r in enumerate(out.results)]
    return eps, out


def run_jobs(pool: VMPool, jobs: list[Task], policy_fn, args, first_job: int = 0) -> tuple[list, int]:
    """Play a list of tasks (repeats allowed), each lost to the environment played once more on
    another desktop. -> (the finished episodes, in job order; how many were lost)."""
    eps, _ = play_all(pool, jobs, policy_fn, args, retries=1, first_job=first_job)
    done = [e for e in eps if e.end != "dropped"]
    return done, len(eps) - len(done)


def save_episodes(run: str, it: int, eps: list, vm_offset: int = 0, clear: bool = True) -> None:
    """Each episode: every step's screenshot, thought, action, then a final line with the score and
    the desktop that played it (`vm`, numbered among all ranks': vm_offset is this rank's first).
    Episode e goes to trajectories/it<it>/vm<e.job>.jsonl: numbered by its job, not by its
    desktop, since a desktop may play several episodes of an iteration (fewer desktops than a
    group play it in turns)."""
    if clear:
        rundir.clear_trajectories(run, it)
    for e in eps:
        if e is None or not e.screenshots:
            continue
        # A dropped episode may have one screenshot more than answers (the VM died in between).
        n = len(e.texts)
        steps = [{"step": s, "task": e.task.id, "thought": e.thoughts[s] if s < n else "",
                  "text": e.texts[s] if s < n else "", "format_ok": e.format_ok[s] if s < n else None,
                  "action": e.actions[s] if s < n else None} for s in range(len(e.screenshots))]
        steps.append({"final": True, "task": e.task.id, "instruction": e.task.instruction, "group": e.group,
                      "end": e.end, "error": e.error, "score": e.score, "score_standard": e.score_standard,
                      "format_penalty": e.reward - e.score, "reward": e.reward, "vm": vm_offset + e.vm})
        rundir.save_trajectory(run, it, e.job, steps, list(e.screenshots) + [None])


