"""ARPO: GRPO on multi-turn desktop tasks, with a replay buffer of successes (arXiv 2505.16282).

    python train_arpo.py --vms 16 --group-size 8 --tasks tasks/          # UI-TARS-1.5-7B, a GPU
    python train_arpo.py --vms 2 --group-size 4 --model tiny-uitars --iterations 3 --max-steps 1   # CPU
    python train_arpo.py --resume runs/<name>                             # continue a run
    python train_arpo.py --select-tasks 16 ...                            # ARPO's task selection first
    python train_arpo.py --eval-only --resume runs/<name>                 # standard + hard success rates
    python train_arpo.py --vms osworld:docker:8 --osworld-tasks META.json # OSWorld's VMs and tasks (docs/osworld.md)

One iteration (`iteration`, which `main`'s loop `train` calls): one task per group of
--group-size rollouts -> every rollout an `episode` on a desktop of its own (reset, the task's
setup, then screenshot -> the policy's answer -> the UI-TARS action, until finished() /
call_user() / an unparseable answer / max steps -> OSWorld's score), each desktop playing on its
own while one batched generate answers whatever is waiting (rollout.play) -> `replay`: a group that
failed alike gets a stored success of its task -> this iteration's successes stored ->
`advantages`: one per trajectory against its group -> `episode_samples`: every assistant token of
a trajectory gets its advantage -> `update`: GRPO (grpo.update_policy) -> log, checkpoint. The
file reads in that order; after `main` come what the loop calls by name: the flags (`Args`, with
ARPO's defaults: the format penalty on the reward, two optimizer steps, an unparseable answer ends
the episode), their checks, task selection, evaluation, loading. The policy is any
`policy_fn(observations) -> answers` (default: model_policy), so a scripted one can stand in.

Where this departs from ARPO (its paper and released code), on purpose:
1. Desktops are local Xvfb desktops or remote `vm_server.py`s; tasks, tasks/*.json; or OSWorld's
   own VMs and task files (--vms osworld:..., --osworld-tasks; osworld_env.py). A VM that fails
   drops its episode as the environment's failure; only an action the VM refuses is the model's.
2. No lockstep (rollout.py): sampled tokens are not reproducible across runs (the task order is).
   The screen settles by the server's watch (--settle watch) or a fixed sleep (ARPO: --settle 0.5).
3. The format penalty is ARPO's code's (score - 0.5 once if an answer did not parse or was refused,
   and that answer ends the episode); --format-penalty-on advantage pays it after the group's
   scores are normalised (`advantages` says why).
4. The replay buffer is saved in every checkpoint, and an injection replaces the group's lowest
   scorer (grpo.ReplayBuffer says why).
5. The update is ARPO's verl config at any scale: --optimizer-steps 2, shuffled (verl reorders by
   length), dual clip 3.0, clip 0.2 / 0.3, every log-prob scored at the sampling temperature.
6. Past --max-images steps (ARPO never has them) each later answer trains on its own, with the
   screenshots it saw (`episode_samples`).
7. Evaluation reports OSWorld's "standard" rule (a timeout counts as FAIL) and "hard" (ARPO's
   OSWorld-Hard, and training's).
8. Knobs ARPO does not have, off by default: --lr-warmup, --lr-schedule, --epochs, --sample-seed,
   --no-scale-rewards (Dr. GRPO), --beta (KL to the start). A group is always --group-size
   rollouts (fewer desktops play it in turns). torchrun: each rank plays its own groups (docs/gpu.md).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from io import BytesIO

import torch
from PIL import Image
from transformers.utils import logging as hf_logging

import grpo
import rollout
from actions import MIN_PIXELS, parse_action, smart_resize
from env import SETTLE_HELP, Task, TaskError, VMError, VMPool, load_tasks, parse_settle, png_bytes
from model import PROMPTS, Answer, encode_chat, generate, load_policy, sync_weights, uitars_messages
from plumbing import ckpt, dist, logs, progress, rundir
from plumbing.rundir import arg
from qwen_vl import TURN_START
from vm.limits import parse as parse_limits

PROG = "train_arpo.py"


# ------------------------------------------------------------------------------------------------
# The episode: one task on one desktop, a generator rollout.play steps in the desktop's own thread


@dataclass
class Episode:
    """One rollout of one task on one VM. Step i: screenshots[i] was seen, answers[i] answered."""
    task: Task
    vm: int                    # the desktop that played it (numbered among all ranks')
    group: int = 0
    iteration: int = 0
    screenshots: list = field(default_factory=list)   # PIL images (PNG bytes once stored for replay)
    answers: list = field(default_factory=list)       # per step: the answer's sampled token ids, or text (scripted)
    logprobs: list = field(default_factory=list)      # per step: the sampler's log-prob per id, or None (scripted)
    texts: list = field(default_factory=list)         # per step: the answer as text
    thoughts: list = field(default_factory=list)      # per step: the parsed Thought ("" if unparseable)
    actions: list = field(default_factory=list)       # per step: Action dict in screen pixels, or None
    format_ok: list = field(default_factory=list)     # per step: the answer parsed into an action the VM took
    end: str | None = None     # done | fail | format | max_steps | dropped (the VM failed)
    error: str | None = None   # why it was dropped
    score: float = 0.0         # OSWorld's score, "hard" rule (outcome_scores): success, replay
    score_standard: float = 0.0  # the "standard" rule: running out of steps counts as FAIL
    reward: float = 0.0        # score - the format penalty (score_episode): what the group normalises
    replayed: bool = False     # came from the replay buffer (an earlier iteration)
    job: int = -1              # its index among the episodes played together (play_tasks)


@dataclass
class Observation:
    """What a policy gets for one episode at one step. The model reads `messages`; a scripted
    stand-in (tests) can read the task, the step and where the screen is, in the image the model sees."""
    task: Task
    vm: int
    step: int
    messages: list          # the UI-TARS prompt: instruction, screenshots, earlier answers
    screen: tuple           # (w, h) of the screenshot in screen pixels
    image_size: tuple       # (w, h) of the screenshot as the model sees it (coordinates live here)
    job: int = 0            # which of the episodes played together this is (a scripted policy plans by it)


def episode(desk: rollout.Desktop, task: Task, args, group: int = 0, iteration: int = 0, job: int = 0):
    """One ARPO episode on one desktop, top to bottom (a generator: `answer = yield observation`
    hands the prompt to the policy, batched with the other desktops' by rollout.play). -> the
    Episode, scored as soon as it ends (as ARPO does). A VM that fails at any point (no answer, a
    5xx, garbage) drops it: rollout.EnvFailure, with the Episode so far, is the environment's fault;
    only an action the VM refuses (4xx) is the model's, a format failure."""
    settle = parse_settle(args.settle)
    e = Episode(task, desk.id, group, iteration, job=job)
    try:
        desk.reset()
        desk.setup(task.setup)
        img = desk.screenshot()
        while e.end is None:
            e.screenshots.append(img)
            o = observe(e, img, args)
            answer = yield o
            action = add_answer(e, o, answer, args)
            last = len(e.answers) >= min(args.max_steps, task.max_steps)  # no screen after it is ever seen
            if action is not None:
                try:
                    # A window takes a moment to map: the model should see it (the last action's
                    # screen is only evaluated, so it is settled but not sent).
                    img = desk.act(action, settle, screenshot=not last)
                except VMError as err:
                    if not err.refused:
                        raise
                    # The VM refused the action (a key it does not know, say): the model's answer was
                    # not a valid action after all, so it counts as a format failure.
                    e.format_ok[-1] = False
                    e.actions[-1] = {**e.actions[-1], "refused": str(err)}
                    e.end = "format" if args.stop_on_format_error else None  # ALGO: ARPO stops the episode
                    action = None
            if e.end is None and last:
                e.end = "max_steps"  # ALGO: the step budget (ARPO: 15)
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
        raise rollout.EnvFailure(str(err), partial=e) from None
    return e


def observe(e: Episode, img: Image.Image, args) -> Observation:
    """The prompt of the episode's next step: its screenshots so far, the last one `img`."""
    # The size the processor resizes this screenshot to: UI-TARS answers in those pixels.
    h, w = smart_resize(img.height, img.width, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    # The history: earlier answers as the sampled ids themselves, so this prompt and the training
    # sequence built from the same episode later hold the very same tokens.
    msgs = uitars_messages(e.task.instruction, e.screenshots, e.answers, max_images=args.max_images, prompt=args.prompt)
    return Observation(e.task, e.vm, len(e.answers), msgs, img.size, (w, h), e.job)


def add_answer(e: Episode, o: Observation, answer, args):
    """One answer into its episode, parsed in the image the model saw. -> the Action to run, or None."""
    if isinstance(answer, Answer):  # the model: keep the sampled ids, parse in the image it saw
        text, ids, seen, lps = answer.text, list(answer.ids), answer.prompt.image_sizes[-1], answer.logprobs
    else:                               # a scripted stand-in: text, in o.image_size coordinates
        text, ids, seen, lps = str(answer), str(answer), o.image_size, None
    parsed = parse_action(text, "uitars", o.screen, seen)
    e.texts.append(text)
    e.answers.append(ids)
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


def score_episode(e: Episode, evaluator_score: float | None, args) -> None:
    """Fill score (hard), score_standard and reward of a finished episode, in place: the scores by
    OSWorld's rule (outcome_scores), the reward ARPO's: the score minus the format penalty, once, if
    any answer did not parse or the VM refused its action (its code: eval_result + 0.5 *
    format_reward, format_reward = -1). The one place the penalty is computed; `advantages` decides
    where it is paid."""
    e.score, e.score_standard = outcome_scores(e.task.infeasible, e.actions, e.end, evaluator_score)
    e.reward = e.score - args.format_penalty * (not all(e.format_ok))  # ALGO: ARPO's trajectory reward


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


def play_tasks(pool: VMPool, tasks: list[Task], policy_fn, args, groups: list[int] | None = None,
               iteration: int = 0, retries: int = 0, first_job: int = 0,
               desc: str = "episodes") -> tuple[list[Episode], rollout.Rollout]:
    """Play tasks[k] (repeats allowed; group groups[k]) on the pool's desktops (rollout.play: a
    freed desktop takes the next task, so more tasks than desktops are played in turns; one the
    environment failed is played again elsewhere up to `retries` times). Episode k is job first_job
    + k. -> (one Episode per task, in order: finished, or `dropped` with its error; the Rollout).
    An episode the environment failed comes back as a rollout.Lost: what it had played (its
    `partial` Episode), or a dropped Episode on the VM it failed on (numbered in the run: pool.first
    is this rank's first VM's number)."""
    groups = groups or [0] * len(tasks)
    todo = [partial(episode, task=t, args=args, group=g, iteration=iteration, job=first_job + k)
            for k, (t, g) in enumerate(zip(tasks, groups))]
    out = rollout.play(pool, todo, policy_fn, retries=retries, desc=desc)
    return [r if not isinstance(r, rollout.Lost) else
            r.partial or Episode(tasks[k], -1 if r.vm is None else pool.first + r.vm, groups[k], iteration,
                                 end="dropped", error=r.error, job=first_job + k)
            for k, r in enumerate(out.results)], out


def model_policy(policy, args: Args, temperature: float):
    """The default policy_fn: one batched generate over all observations -> Answers."""
    def policy_fn(observations: list[Observation]) -> list[Answer]:
        return generate(policy, [o.messages for o in observations], max_new_tokens=args.max_new_tokens,
                        temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0)
    return policy_fn


# ------------------------------------------------------------------------------------------------
# The algorithm: tasks and groups, replay, advantages, the training sequences, the update


def n_groups(desktops: int, group_size: int, groups: int | None = None) -> int:
    """How many groups (tasks) an iteration plays on `desktops` desktops in service: `groups` if
    given (more jobs than desktops: a desktop whose episode ended takes the next), else one per
    group_size of them (leftovers idle), and at least one. A group is always group_size rollouts:
    fewer desktops than that play it in turns, so a lone desktop still trains; a group of one would
    not (its advantage is always 0, and replay would only swap its member for a stored success)."""
    if not desktops:
        return 0
    return groups or max(1, desktops // group_size)


def pick_tasks(ids: list[str], state: dict, n: int, seed: int) -> list[str]:
    """The next n task ids: round robin over a seeded shuffle of the list, reshuffled each pass.
    state = {"epoch": e, "pos": p} (mutated; it is all a checkpoint needs to continue the order)."""
    if not ids:
        raise ValueError("pick_tasks needs at least one task id.")
    out = []
    while len(out) < n:
        # The order of a pass is a function of (seed, pass): nothing but two ints to checkpoint.
        order = list(ids)
        random.Random(f"{seed}-{state['epoch']}").shuffle(order)
        take = order[state["pos"]:state["pos"] + n - len(out)]
        out += take
        state["pos"] += len(take)
        if state["pos"] >= len(order):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
    return out


def assign_tasks(tr: Trainer, pick, times: dict) -> tuple[list[str], list[Task], list[int], int]:
    """The next task of each group the desktops in service can play (n_groups), every group member a
    job. -> (every rank's task ids, one per group; this rank's jobs; the group of each job; the
    number of this rank's first job among all ranks'). Under torchrun every rank draws the same ids
    (the order is a function of the seed) and plays its own groups, numbered after the earlier
    ranks': a group never straddles ranks. Dead remote VMs are re-checked meanwhile."""
    a = tr.args
    with rundir.timed(times, "vm_wait"):
        desktops = len(rollout.in_service(tr.pool))
    if not desktops:
        raise SystemExit("No VM answered; check that the desktops run (see --vms).")
    mine, n_all = dist.share(n_groups(desktops, a.group_size, a.groups))  # this rank's groups among all ranks'
    task_ids = pick(n_all)
    by_id = {t.id: t for t in tr.tasks}
    jobs = [by_id[task_ids[g]] for g in mine for _ in range(a.group_size)]
    return task_ids, jobs, [g for g in mine for _ in range(a.group_size)], mine.start * a.group_size


def replay(replay_buffer: grpo.ReplayBuffer | None, fresh: list[Episode], task_ids: list[str],
           scores: list[tuple[int, float]]) -> tuple[list[Episode], list[dict]]:
    """ALGO: ARPO's replay. A group that failed alike (score std < 0.05 and mean < 0.2) gets one
    member replaced by a stored success of its task, which was stored in an EARLIER iteration (this
    one's successes are added after). Decided on the evaluator scores, not the rewards: a group
    whose members all failed the task needs a success, however well-formed their answers were.
    `scores`: (group, score) of the fresh episodes of EVERY group (under torchrun, of every rank:
    each rank keeps the same buffer, so every rank draws for every group, in order). -> (this rank's
    groups' episodes for the update, the injections)."""
    by_group: dict[int, list[float]] = {}
    for g, s in scores:
        by_group.setdefault(g, []).append(s)
    to_train, injections = [], []
    for g, tid in enumerate(task_ids):
        members = [e for e in fresh if e.group == g]  # (none: another rank's group, or every VM failed)
        if replay_buffer is not None and by_group.get(g):
            # Another rank's group is drawn for too (with stand-ins), so every rank's buffer draws alike.
            # -> the members with a stored success in place of member k (k None: none injected).
            new, _, k = replay_buffer.inject(tid, members or [None] * len(by_group[g]), by_group[g])
            if k is not None and members:
                # The stored success joins this group: its own reward, normalised against today's
                # members. Its sampler log-probs are an older policy's: dropped, and the logp_gap metric skips
                # the micro-batch it lands in (it compares like with like; metrics only).
                ep = replace(from_dict(new[k]), group=g, replayed=True, logprobs=[])  # (stored as plain data: to_dict)
                injections.append({"task": tid, "group": g, "replaced_vm": members[k].vm, "from_iteration": ep.iteration,
                                   "from_vm": ep.vm, "score": ep.score, "reward": ep.reward})
                members = members[:k] + [ep] + members[k + 1:]
        to_train += members
    return to_train, injections


def advantages(episodes: list[Episode], a: Args) -> list[float]:
    """ALGO: one advantage per trajectory, against its group. --format-penalty-on reward (ARPO): the
    group normalises the rewards (score - penalty on a broken one, score_episode). --format-penalty-on
    advantage: the group normalises the scores, and a broken trajectory alone loses its penalty
    afterwards. Why the second exists: in a group that failed the task alike, ARPO's way turns one
    broken answer into a positive advantage for every other member (scores [0, 0, 0, 0], one broken:
    rewards [0, 0, 0, -0.5] -> [+0.5, +0.5, +0.5, -1.5]), which reinforces whatever the failed
    members did; here that group gives [0, 0, 0, -0.5]: the format is still taught, and nothing a
    failure did is rewarded. Its cost: in that group the broken member's penalty is the only
    gradient, on every token of it, most of them tokens every well-formed answer shares too; a run
    whose policy had settled on one wrong answer (most groups flat) lost its format that way, for
    good (docs/log.md, 2026-12-06). ARPO's way gives the well-formed members what the broken one
    loses, so the tokens they share are held."""
    groups = [e.group for e in episodes]
    if a.format_penalty_on == "reward":
        return grpo.group_advantages([e.reward for e in episodes], groups, a.scale_rewards).tolist()  # (N,)
    adv = grpo.group_advantages([e.score for e in episodes], groups, a.scale_rewards)  # (N,)
    penalty = torch.tensor([e.score - e.reward for e in episodes])  # (N,) the format penalty, 0 if none
    return (adv - penalty).tolist()  # ALGO: the broken trajectory alone pays it, (N,)


def episode_samples(policy, ep: Episode, args, advantage: float = 0.0) -> list[grpo.Sample]:
    """ALGO: a trajectory as training sequences, every answer in the context it was sampled in: the
    conversation re-encoded, the sampled answer ids verbatim, the sampler's log-probs alongside.

    With at most --max-images steps (ARPO: 15 steps, 15 images) that is ONE sequence, target_mask over every
    assistant turn, as ARPO trains. Past that, answer i saw only screenshots i-K+1..i (K = max
    images): the first K answers still share one sequence, and every later answer is a sequence of
    its own, its prompt exactly as sampled and only its answer a target. Each piece's weight is its
    share of the trajectory's target tokens, so under seq-mean-token-mean the pieces count as one
    sequence and the loss is the one the whole trajectory would give."""
    shots = [as_image(s) for s in ep.screenshots]  # (a replayed episode's are PNG bytes)
    n, K = len(ep.answers), args.max_images
    lps = ep.logprobs if len(ep.logprobs) == n and all(lp is not None for lp in ep.logprobs) else None
    im_start = policy.tokenizer.convert_tokens_to_ids(TURN_START)  # a turn's first token
    pieces = []
    # Piece ends: the first min(n, K) answers together, then one piece per later answer.
    for end in [min(n, K)] + list(range(K + 1, n + 1)):  # answers [0, end) in context
        msgs = uitars_messages(ep.task.instruction, shots[:end], ep.answers[:end], max_images=K, prompt=args.prompt)
        enc = encode_chat(policy, msgs, add_generation_prompt=False)
        first_target = 0 if end <= K else end - 1  # the first answer this piece trains
        if first_target:  # earlier answers are context here: only the last assistant turn is a target
            last_turn = max(i for i, t in enumerate(enc.input_ids) if t == im_start)
            enc.target_mask = [0] * last_turn + enc.target_mask[last_turn:]  # ALGO: its last answer alone trains
        old = [x for lp in lps[first_target:end] for x in lp] if lps is not None else None
        pieces.append(grpo.trajectory_sample(enc, ep.reward, ep.group, old))
    total = sum(sum(p.target_mask) for p in pieces)
    for p in pieces:
        p.advantage = advantage  # ALGO: the trajectory's one advantage on every answer of it
        p.weight = sum(p.target_mask) / total if total else 1.0 / len(pieces)  # ALGO: the pieces count as one
    return pieces


def update(tr, samples: list[grpo.Sample], it: int, on_micro_batch=None) -> dict:
    """ALGO: the GRPO update in ARPO's schedule: the batch, shuffled (seeded, the same on a resume),
    in --optimizer-steps steps (or steps of --mini-batch samples), dual clip, log-probs at the sampling temperature (grpo.update_policy).
    -> its metrics ({} when no rank had a sample)."""
    a = tr.args
    return grpo.update_policy(tr.policy, tr.optimizer, samples, micro_batch_size=a.micro_batch, eps_low=a.eps_low,
                              eps_high=a.eps_high, beta=a.beta, ref_fn=tr.ref_fn, max_grad_norm=a.max_grad_norm,
                              agg=a.loss_agg, epochs=a.epochs, temperature=a.temperature, dual_clip=a.dual_clip,
                              mini_batch_size=a.mini_batch, optimizer_steps=a.optimizer_steps,
                              on_micro_batch=on_micro_batch, shuffle=random.Random(f"{a.seed}-update-{it}"))


def lr_at(it: int, a: Args) -> float:
    """The learning rate of iteration `it` (0-based): grpo.scheduled_lr over --iterations. ARPO
    keeps lr constant without warm-up (--lr-schedule constant); a decay keeps what a small model
    trained from scratch at a high lr learned from being lost again in the last iterations, at the
    price of the updates left after it (bench/learning.py uses each, and says why)."""
    return grpo.scheduled_lr(a.lr, it, a.iterations, a.lr_warmup, a.lr_schedule)


# ------------------------------------------------------------------------------------------------
# One iteration, and the loop


@dataclass
class Trainer:
    """The trainer's state: what the iterations use and update (the policy, its optimizer, the
    replay buffer (None with --no-replay), the task order) and what they run on."""
    args: Args
    pool: VMPool
    policy: object
    optimizer: torch.optim.Optimizer
    replay_buffer: grpo.ReplayBuffer | None
    policy_fn: object
    run: str | None = None
    tasks: list = field(default_factory=list)  # the training task list (after --select-tasks)
    picker: dict = field(default_factory=lambda: {"epoch": 0, "pos": 0})  # pick_tasks' place in the order
    ref_fn: object = None  # --beta with full fine-tuning: the frozen starting policy's log-probs


def iteration(tr: Trainer, it: int, pick) -> tuple[dict, list[Episode]]:
    """One ARPO iteration, top to bottom; pick(n) -> the next n task ids. -> (metrics, this rank's episodes)."""
    a, times, t0 = tr.args, {}, time.perf_counter()
    lr = grpo.set_lr(tr.optimizer, lr_at(it, a))
    task_ids, jobs, groups, first_job = assign_tasks(tr, pick, times)  # one task a group, --group-size jobs each
    # -- the rollout: each desktop resets, sets up, plays and scores its episode on its own
    with dist.unsharded(tr.policy.model):  # (FSDP2: each rank decodes alone, with whole weights)
        eps, out = play_tasks(tr.pool, jobs, tr.policy_fn, a, groups, it, first_job=first_job, desc="rollout")
    rundir.add_times(times, out.times)
    fresh = [e for e in eps if e.end != "dropped"]
    # -- replay into the groups that failed alike, THEN store this iteration's successes (under
    # torchrun every rank keeps the same buffer: it sees every rank's scores and successes)
    to_train, injections = replay(tr.replay_buffer, fresh, task_ids, dist.every([(e.group, e.score) for e in fresh]))
    if tr.replay_buffer is not None:
        won = [(e.task.id, to_dict(e), e.score) for e in fresh if e.score > tr.replay_buffer.success_threshold]
        for task_id, d, score in dist.every(won):
            tr.replay_buffer.add(task_id, d, score)  # ALGO: kept if a success (score > --success-threshold)
    # -- one advantage per trajectory, on every assistant token of it; the GRPO update
    adv = advantages(to_train, a)  # (N,)
    pieces = [episode_samples(tr.policy, e, a, x) for e, x in zip(to_train, adv)]  # each trajectory's sequences
    samples = [p for ps in pieces for p in ps]
    with rundir.timed(times, "update"), progress.bar(len(samples) * a.epochs, "update") as bar:
        upd = update(tr, samples, it, bar.update)
    if upd:
        with rundir.timed(times, "sync"):
            sync_weights(tr.policy)  # the generator samples the next rollout from the new weights
    times["time/iteration"] = time.perf_counter() - t0
    m = logs.arpo_metrics(it, task_ids, fresh, out, tr.pool.first, to_train, adv, pieces, upd, injections,
                          len(tr.replay_buffer or []), a.success_threshold, times)
    return {**m, "actor/lr": lr}, eps


def train(tr: Trainer, start: int) -> None:
    """The loop: one iteration, then trajectories, checkpoint, metrics line, console line."""
    args, run, ids = tr.args, tr.run, [t.id for t in tr.tasks]
    trackers = rundir.open_trackers(run, args)
    for it in progress.track(range(start, args.iterations), "iterations"):
        m, eps = iteration(tr, it, lambda n: pick_tasks(ids, tr.picker, n, args.seed))
        with rundir.timed(m, "save"):
            if args.save_trajectories:
                logs.save_episodes(run, it, eps)
            if (it + 1) % args.ckpt_every == 0 or it + 1 == args.iterations:
                checkpoint(tr, it + 1, m)
        rundir.end_iteration(run, trackers, m, logs.arpo_line(m, args.beta))
    progress.close(trackers)


def setup(args: Args, pool: VMPool, policy, run: str, state, tasks: list) -> tuple[Trainer, int]:
    """The trainer's state: AdamW (ARPO's: weight decay 0.01), the replay buffer and the task order,
    fresh (after --select-tasks) or from the checkpoint; the KL reference with --beta and full
    fine-tuning. -> (Trainer, the first iteration to run)."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)  # ARPO: AdamW, wd 0.01
    replay_buffer = grpo.ReplayBuffer(args.replay_capacity, args.success_threshold, seed=args.seed) if args.replay else None
    picker, start = {"epoch": 0, "pos": 0}, 0
    if state is not None:
        if replay_buffer is not None and state[0]["replay"] is not None:
            replay_buffer.load_state_dict(state[0]["replay"])  # ARPO's own code starts it empty again
        picker = dict(state[0]["picker"])
        start = ckpt.resume(run, state, policy, optimizer)  # optimizer, metrics.jsonl and RNG states
        print(f"resumed {run} at iteration {start} ({len(replay_buffer or [])} stored successes)")
    dist.seed_ranks((args.seed if args.sample_seed is None else args.sample_seed) + start)  # torchrun: own samples
    policy_fn = model_policy(policy, args, args.temperature)
    if state is None and args.select_tasks > 0:
        with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
            tasks = selected_tasks(pool, tasks, policy_fn, args, run)
    ref_fn = grpo.reference_fn(args.beta, args.lora_rank, lambda: load_policy(  # the run's start, also on a resume
        args.model, seed=args.seed, min_pixels=args.min_pixels, max_pixels=args.max_pixels))
    return Trainer(args, pool, policy, optimizer, replay_buffer, policy_fn, run, tasks, picker, ref_fn), start


def main(argv=None) -> None:
    dist.init()  # torchrun: join the other ranks (one process: nothing)
    dist.mute_others()
    args, state, given = resolve_args(argv)
    hf_logging.disable_progress_bar()  # one summary line per iteration; load/save bars are noise here
    rundir.cpu_threads(args.threads, torch.cuda.is_available())  # on a CPU, half the cores: the desktops need the rest
    rundir.seed_all(args.seed, args.sample_seed)
    # A resumed run trains on the task list it trained on (after --select-tasks), unless told otherwise.
    # The tasks before the run folder: a bad --tasks or --task-ids leaves nothing behind.
    resumed_ids = state[0]["tasks"] if state is not None and not args.eval_only and "task_ids" not in given else None
    tasks = load_task_list(args, resumed_ids)
    run = args.resume or rundir.run_path(args.runs_dir, args.run_name)
    with rundir.new_run(run):  # a bad --model or --vms: one sentence, and no half-made run folder
        if not (args.eval_only and args.resume):  # evaluating a run: its args.json stays the training args
            rundir.make_run_dir(run, args, resume=bool(args.resume))
        print(f"run folder: {run}; loading {args.model}", flush=True)
        policy = make_policy(args, state)
        print(f"starting {args.vms} desktop(s) ..." if args.vms.isdigit() else f"connecting to {args.vms} ...", flush=True)
        pool, _, _ = rundir.open_desktops(args.vms, args.token, args.vm_timeout, screen_size(args), args.desktop_limits,
                                          osworld_cache=args.osworld_cache)
    try:
        if args.eval_only:  # standard + hard success rates of the policy, into eval_it<N>.json
            with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
                logs.arpo_eval(lambda folder: evaluate(pool, tasks, model_policy(policy, args, args.eval_temperature),
                                                       args, save_to=folder), args, run,
                               ckpt.next_iteration(state[0]) if state else 0)
            return
        try:
            train(*setup(args, pool, policy, run, state, tasks))
        except OSError as e:  # the run folder's disk is full: one sentence, the last checkpoint stands
            ckpt.stop_if_disk_full(e, run, PROG)
    finally:
        pool.close()


# ------------------------------------------------------------------------------------------------
# After the loop: what it calls by name. An episode as stored (the replay buffer, checkpoints),
# the flags (with ARPO's defaults) and their checks, checkpoints, task selection and evaluation,
# loading a run's tasks and policy

def to_dict(e: Episode) -> dict:
    """An episode as plain data, for the replay buffer and checkpoints: screenshots as PNG bytes
    (much smaller than the pixels), the task as a dict without its scripted solution (the test
    suite's, never part of what the policy learns from); unpickling needs no class of ours."""
    d = {STORED_AS.get(f.name, f.name): getattr(e, f.name) for f in fields(Episode)}
    shots = [s if isinstance(s, bytes) else png_bytes(s) for s in e.screenshots]  # (as the VM sent them)
    return {**d, "task": {**asdict(e.task), "solution": []}, "screenshots": shots}


def from_dict(d: dict) -> Episode:
    d = {STORED_FIELD.get(k, k): v for k, v in d.items()}
    return Episode(**{**d, "task": Task(**d["task"])})


# Episode fields stored under an older name (checkpoints' replay buffers keep their keys, so runs
# written before the rename still resume): the answers were called "assistant".
STORED_AS = {"answers": "assistant"}
STORED_FIELD = {v: k for k, v in STORED_AS.items()}


def as_image(x) -> Image.Image:
    """A stored screenshot (PNG bytes, from the replay buffer) or a live one, as a PIL image."""
    return Image.open(BytesIO(x)).convert("RGB") if isinstance(x, bytes) else x


@dataclass
class Args:
    # desktops and tasks
    vms: str = arg("16", "number of local desktops to launch, or comma-separated URLs of running vm_server.py")
    token: str = arg("", "secret each remote VM's token is derived from (default: $VM_TOKEN); local desktops make their own")
    vm_timeout: float = arg(60.0, "seconds one VM call may take before that VM drops out of the iteration (ours: "
                                  "twice train_explore's 30, as a task's setup and evaluate run commands)")
    screen: str = arg("1280x720", "screen size of local desktops")
    desktop_limits: str = arg("", "each local desktop's bounds, e.g. memory=1g,pids=512,cpus=1,disk=256m,tmp=256m "
                                  "(the defaults; any subset; docs/vm.md); as root, a desktop cannot take more")
    tasks: str = arg("tasks/", "a task file or a folder of *.json task files")
    task_ids: str = arg("", "comma-separated task ids to use (default: every task)")
    osworld_tasks: str = arg("", "OSWorld's task list instead of --tasks: {domain: [id, ...]} (its test_all.json, "
                                 "ARPO's 128, your own); docs/osworld.md")
    osworld_examples: str = arg("", "OSWorld's examples folder, <domain>/<id>.json (default: examples/ beside the list)")
    osworld_cache: str = arg("cache", "OSWorld's download cache, a folder per VM (pre-seed it for an offline run)")
    prompt: str = arg("uitars", "the prompt and its layout: uitars (UI-TARS-1.5's) or arpo (ARPO's; the default "
                                "with --vms osworld:...)")
    group_size: int = arg(8, "rollouts per task = one GRPO group (ARPO: 8); fewer desktops than a group play it "
                             "in turns; 1 trains nothing (a group of one has advantage 0), a smoke test only")
    groups: int | None = arg(None, "tasks (groups) per iteration, played in turns on the desktops; under torchrun "
                                   "per rank (default: the desktops in service // --group-size, at least 1)")
    # policy
    model: str = arg("ByteDance-Seed/UI-TARS-1.5-7B",
                     "HF id or folder of a Qwen-VL checkpoint; 'tiny-uitars' = tiny, UI-TARS format taught (CPU); "
                     "'tiny' = random weights")
    engine: str = arg("hf", "generation engine: hf (any device) or vllm (GPU, pip install vllm)")
    lora_rank: int = arg(0, "LoRA rank; 0 = full fine-tuning (ARPO)")
    lora_alpha: int = arg(16, "LoRA alpha (ARPO trains the full model; 16 is ScreenExplorer's)")
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    threads: int | None = arg(None, "torch CPU threads (default: half the cores on a CPU run, since the desktops "
                                    "need the rest)")
    max_pixels: int = arg(2116800, "max pixels of a screenshot as the model sees it (ARPO: 2116800)")
    min_pixels: int = arg(MIN_PIXELS, "min pixels of a screenshot as the model sees it")
    max_new_tokens: int = arg(256, "tokens one answer may take (Thought + Action; ours, untuned: twice "
                                    "ScreenExplorer's 128 for UI-TARS's longer thoughts)")
    # rollout
    iterations: int = arg(100, "training iterations (each: one rollout of every group + one update)")
    max_steps: int = arg(15, "steps per episode at most (ARPO: 15); a task's own max_steps may lower it")
    max_images: int = arg(15, "screenshots kept in the prompt (ARPO: 15); older screenshots are dropped, "
                                "their answers stay")
    temperature: float = arg(1.0, "sampling temperature in training; the update scores log-probs at it too (ARPO: 1.0)")
    top_p: float = arg(1.0, "nucleus sampling in training")
    stop_on_format_error: bool = arg(True, "an unparseable answer ends the episode, as in ARPO's code")
    settle: str = arg("watch", "after each action: 'watch' (the server waits until the screen stops changing, "
                               "with a cap) or seconds of a fixed sleep (ARPO/OSWorld: 0.5)")
    # reward, loss, update
    format_penalty: float = arg(0.5, "reward -= this if any answer of the trajectory did not parse or was refused (ARPO: 0.5 * 1)")
    format_penalty_on: str = arg("reward", "where the format penalty is paid: reward (ARPO: the group normalises "
                                           "score - penalty) or advantage (the group normalises the scores, then the "
                                           "broken trajectory alone loses the penalty from its advantage)")
    lr: float = arg(1e-6, "AdamW learning rate (ARPO: 1e-6)")
    lr_warmup: int = arg(0, "iterations of linear learning-rate warm-up from lr / N (ARPO: none)")
    lr_schedule: str = arg("constant", "learning rate after the warm-up: constant (ARPO), linear or cosine "
                                       "(decay towards 0 at --iterations)")
    epochs: int = arg(1, "passes of the optimizer over each iteration's batch (old log-probs fixed first)")
    scale_rewards: bool = arg(True, "divide each group's advantages by its reward std (GRPO, ARPO); "
                              "--no-scale-rewards: Dr. GRPO, advantages = reward - group mean")
    eps_low: float = arg(0.2, "lower clip range of the ratio")
    eps_high: float = arg(0.3, "upper clip range of the ratio (clip-higher; ARPO: 0.3)")
    beta: float = arg(0.0, "KL coefficient to the starting policy (ARPO: 0; LoRA: the adapter off; full "
                           "fine-tuning: a frozen copy of --model)")
    loss_agg: str = arg("seq-mean-token-mean", "loss aggregation: seq-mean-token-mean or token-mean")
    micro_batch: int = arg(1, "sequences per forward/backward (memory knob only)")
    optimizer_steps: int = arg(2, "optimizer steps per iteration, the batch cut into that many mini-batches "
                                  "(ARPO: 2, i.e. 16 tasks x 8 rollouts in steps of 8 x 8)")
    mini_batch: int | None = arg(None, "sequences per optimizer step instead (default: set by --optimizer-steps)")
    dual_clip: float = arg(3.0, "dual-clip c: a negative advantage's loss is capped at c * |A| (ARPO: 3.0; inf = off)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    # replay buffer and task selection
    replay: bool = arg(True, "ARPO's replay buffer of successes (--no-replay: the GRPO ablation)")
    replay_capacity: int = arg(8, "stored successes per task (ARPO: 8)")
    success_threshold: float = arg(0.1, "a trajectory is a success if its score is above this (ARPO: 0.1)")
    select_tasks: int = arg(0, "before training, K rollouts per task; keep the tasks solved at least once "
                               "(ARPO: 16; 0: no selection)")
    # evaluation
    eval_only: bool = arg(False, "evaluate the policy (standard and hard protocols), do not train")
    eval_episodes: int = arg(1, "episodes per task in --eval-only")
    eval_temperature: float = arg(0.5, "sampling temperature of --eval-only (ARPO: 0.5)")
    eval_out: str = arg("", "where --eval-only writes its JSON (default: the run folder)")
    # run folder
    run_name: str = arg("", "run folder name under --runs-dir (default: a time stamp)")
    runs_dir: str = arg("runs", "where run folders go")
    resume: str = arg("", "a run folder to continue (flags given now override the saved ones)")
    ckpt_every: int = arg(1, "checkpoint every N iterations (and at the end)")
    save_trajectories: bool = arg(True, "write every episode's screenshots + steps into the run folder")
    seed: int = arg(0, "seed of the task order, the update's shuffle, the replay buffer and the tiny model's weights")
    sample_seed: int | None = arg(None, "seed of sampling answers (training and --eval-only; default: --seed), so "
                                        "an eval can draw fresh samples while the task order stays the run's")
    wandb: bool = arg(False, "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names the project)")
    tensorboard: bool = arg(False, "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)")


# Flag values of run folders written before these flags said what they mean (args.json, checkpoints).
OLD_VALUES = {"groups": {0: None}, "sample_seed": {-1: None}, "mini_batch": {0: None}, "dual_clip": {0: float("inf")}}


def check_args(args: Args) -> None:
    """Errors a user can cause, each as one sentence."""
    import vllm_engine  # plain Python until an engine is built (vLLM itself is imported there)
    rundir.check([
        (args.group_size < 1, "--group-size must be at least 1 (ARPO uses 8)"),
        (args.threads is not None and args.threads < 1, "--threads must be at least 1"),
        (args.groups is not None and args.groups < 1, "--groups must be at least 1"),
        (args.engine not in ("hf", "vllm"), "--engine must be hf or vllm"),
        (args.loss_agg not in ("seq-mean-token-mean", "token-mean"), "--loss-agg must be seq-mean-token-mean or token-mean"),
        (args.beta < 0, "--beta must be >= 0"),
        (args.format_penalty_on not in ("reward", "advantage"), "--format-penalty-on must be reward or advantage"),
        (args.engine == "vllm" and args.beta > 0 and args.lora_rank == 0, "--engine vllm with full fine-tuning and "
                                                                          "--beta > 0 would hold three model copies; use LoRA or --beta 0"),
        (not args.dual_clip > 1, "--dual-clip must be above 1 (ARPO uses 3.0), or inf to switch it off"),
        (args.optimizer_steps < 1 or (args.mini_batch is not None and args.mini_batch < 1) or args.micro_batch < 1,
         "--optimizer-steps, --mini-batch and --micro-batch must be at least 1"),
        (min(args.max_steps, args.max_images, args.max_new_tokens, args.eval_episodes, args.ckpt_every) < 1,
         "--max-steps, --max-images, --max-new-tokens, --eval-episodes and --ckpt-every must be at least 1"),
        (args.lr_schedule not in ("constant", "linear", "cosine"), "--lr-schedule must be constant, linear or cosine"),
        (args.lr_warmup < 0 or args.epochs < 1, "--lr-warmup must be 0 or more and --epochs at least 1"),
        (screen_size(args) is None, "--screen must be WIDTHxHEIGHT, e.g. 1280x720"),
        (parse_settle(args.settle) is None, SETTLE_HELP),
        (args.prompt not in PROMPTS, f"--prompt must be one of {', '.join(PROMPTS)}"),
        (args.vms.startswith("osworld:") and args.settle == "watch",
         "--settle watch needs the project's own desktops; OSWorld's VMs take seconds (ARPO: 0.5)"),
        *vllm_engine.flag_errors(args.engine, args.temperature, args.eval_temperature),
    ], PROG)
    try:
        parse_limits(args.desktop_limits)
    except ValueError as e:
        sys.exit(f"{PROG}: --desktop-limits: {e}.")


def screen_size(args: Args) -> tuple[int, int] | None:
    w, _, h = args.screen.lower().partition("x")
    return (int(w), int(h)) if w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0 else None


def resolve_args(argv=None) -> tuple:
    """The command line; on --resume, the run's saved args with the flags given now on top.
    -> (args, (checkpoint state, folder) or None, the flags given now)."""
    args, given = rundir.parse_args(Args, argv, PROG)
    args, state = ckpt.resume_args(Args, args, given, PROG, marker="group_size", old_values=OLD_VALUES)
    osworld = args.vms.startswith("osworld:")
    if osworld and state is None:  # ARPO's setting on OSWorld, where a flag does not say otherwise
        import osworld_env
        for name, value in (("screen", "x".join(map(str, osworld_env.SCREEN))), ("settle", str(osworld_env.SETTLE)),
                            ("vm_timeout", osworld_env.VM_TIMEOUT), ("prompt", "arpo")):
            if name not in given:
                setattr(args, name, value)
    check_args(args)
    return args, state, given


def checkpoint(tr: Trainer, next_it: int, metrics: dict | None = None) -> None:
    """ckpt.save plus ARPO's own state: the replay buffer, the task order, the task list."""
    ckpt.save(tr.run, tr.policy, tr.optimizer, next_it, tr.args, metrics, picker=dict(tr.picker),
              tasks=[t.id for t in tr.tasks], replay=tr.replay_buffer.state_dict() if tr.replay_buffer is not None else None)


def play_shared(pool: VMPool, tasks: list[Task], policy_fn, args, save=None) -> tuple[list[Episode], int]:
    """Play `tasks` (repeats allowed), each lost to the environment played once more on another
    desktop; under torchrun every rank plays a contiguous share of them. save(episode), if given,
    runs where it was played. -> (every rank's finished episodes, as dicts in job order; how many
    were lost, on all ranks)."""
    mine = dist.shard_range(len(tasks))
    eps, _ = play_tasks(pool, tasks[mine.start:mine.stop], policy_fn, args, retries=1, first_job=mine.start)
    done = [e for e in eps if e.end != "dropped"]
    for e in done if save is not None else []:
        save(e)
    rows = [{"task": e.task.id, "vm": e.vm, "job": e.job, "end": e.end, "steps": len(e.actions),
             "score_standard": e.score_standard, "score_hard": e.score, "actions": e.actions,
             "format_ok": e.format_ok, "texts": e.texts} for e in done]
    return sorted(dist.every(rows), key=lambda r: r["job"]), int(dist.all_sum([len(eps) - len(done)])[0])


def select_tasks(pool: VMPool, tasks: list[Task], k: int, policy_fn, args) -> tuple[list[Task], dict]:
    """ALGO: ARPO's task selection: k rollouts per task with the starting policy; keep the tasks
    solved (score > success threshold) at least once. -> (kept tasks, {task id: successes})."""
    eps, _ = play_shared(pool, [t for t in tasks for _ in range(k)], policy_fn, args)
    counts = {t.id: 0 for t in tasks}
    for e in eps:
        counts[e["task"]] += e["score_hard"] > args.success_threshold  # ALGO: "solved at least once"
    return [t for t in tasks if counts[t.id] > 0], counts


def evaluate(pool: VMPool, tasks: list[Task], policy_fn, args, save_to: str | None = None) -> dict:
    """Success rate (the mean score, as OSWorld reports it) per task and overall under both
    protocols, and per episode what it did. save_to: a folder that gets the episodes as a run's
    trajectories (view.py shows them), one "iteration" per task, one "vm" per episode of it."""
    t0 = time.perf_counter()
    n = args.eval_episodes
    save = None if not save_to else (lambda e: logs.save_episodes(save_to, e.job // n, [replace(e, job=e.job % n)],
                                                                  clear=False))
    eps, lost = play_shared(pool, [t for t in tasks for _ in range(n)], policy_fn, args, save)
    out = {"episodes": len(eps), "lost": lost, "episodes_per_task": n, "temperature": args.eval_temperature,
           "seconds": time.perf_counter() - t0}
    def mean(s):
        return sum(s) / len(s) if s else None
    domain = {t.id: t.domain for t in tasks}  # OSWorld's tasks have one: the mean per domain, as OSWorld reports
    for proto, key in (("standard", "score_standard"), ("hard", "score_hard")):
        out[proto] = {"overall": mean([e[key] for e in eps]),
                      "per_task": {t.id: mean([e[key] for e in eps if e["task"] == t.id]) for t in tasks}}
        if any(domain.values()):
            out[proto]["per_domain"] = {d: mean([e[key] for e in eps if domain[e["task"]] == d])
                                        for d in sorted(set(domain.values()) - {""})}
    out["details"] = eps
    steps = [ok for e in eps for ok in e["format_ok"]]
    out["format_rate"] = sum(steps) / len(steps) if steps else None  # answers that parsed and ran (format_ok)
    return out


def selected_tasks(pool: VMPool, tasks: list[Task], policy_fn, args: Args, run: str) -> list[Task]:
    """--select-tasks K: ARPO's selection with the starting policy, recorded in selected_tasks.json
    (and read back from it when a run was killed after selecting, before its first checkpoint)."""
    path = os.path.join(run, "selected_tasks.json")
    if os.path.exists(path):
        with open(path) as f:
            keep = json.load(f)["selected"]
        kept = [t for t in tasks if t.id in keep]
    else:
        print(f"task selection: {args.select_tasks} rollouts of each of {len(tasks)} tasks ...", flush=True)
        kept, counts = select_tasks(pool, tasks, args.select_tasks, policy_fn, args)
        if dist.is_main():
            with open(path, "w") as f:
                json.dump({"k": args.select_tasks, "success_threshold": args.success_threshold,
                           "successes": counts, "selected": [t.id for t in kept]}, f, indent=2)
        print(f"task selection kept {len(kept)}/{len(tasks)} tasks: {[t.id for t in kept]} (written to {path})")
    if not kept:
        raise SystemExit(f"no task was solved even once in {args.select_tasks} tries; raise --select-tasks, "
                         "use an easier task set, or train without --select-tasks.")
    return kept


def load_task_list(args: Args, ids: list[str] | None = None) -> list[Task]:
    try:
        if args.osworld_tasks:  # OSWorld's task files as they are (osworld_env.load_tasks)
            import osworld_env
            tasks = osworld_env.load_tasks(args.osworld_tasks, args.osworld_examples)
        else:
            tasks = load_tasks(args.tasks)
    except TaskError as e:
        raise SystemExit(str(e))
    want = ids if ids is not None else [s.strip() for s in args.task_ids.split(",") if s.strip()]
    if want:
        by_id = {t.id: t for t in tasks}
        missing = [i for i in want if i not in by_id]
        if missing:
            raise SystemExit(f"unknown task id(s) {missing} in {args.osworld_tasks or args.tasks}; check --task-ids.")
        tasks = [by_id[i] for i in want]
    return tasks


def make_policy(args: Args, state: tuple[dict, str] | None):
    """The starting policy, or the one a checkpoint holds (ckpt.restore_policy)."""
    def load(name):
        return load_policy(name, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed,
                           gradient_checkpointing=args.gradient_checkpointing, min_pixels=args.min_pixels,
                           max_pixels=args.max_pixels)
    policy = load(args.model) if state is None else ckpt.restore_policy(*state, load)
    dist.spread(policy.model, shard=args.lora_rank == 0)  # torchrun: rank 0's weights; full FT: FSDP2
    if args.engine == "vllm":  # GPU only: prompts of --max-images screenshots and every answer of an episode
        import vllm_engine
        vllm_engine.attach(policy, args.max_images, args.max_steps * (args.max_new_tokens + 6))
    return policy


if __name__ == "__main__":
    main()
