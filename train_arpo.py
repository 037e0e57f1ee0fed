"""ARPO: GRPO on multi-turn desktop tasks, with a replay buffer of successes (arXiv 2505.16282).

    python train_arpo.py --vms 16 --group-size 8 --tasks tasks/          # UI-TARS-1.5-7B, a GPU
    python train_arpo.py --vms 4 --group-size 2 --model tiny --iterations 2 --max-steps 3   # CPU
    python train_arpo.py --resume runs/<name>                             # continue a run
    python train_arpo.py --select-tasks 16 ...                            # ARPO's task selection first
    python train_arpo.py --eval-only --resume runs/<name>                 # standard + hard success rates

One iteration, top to bottom (`run_iteration`):
    pick tasks (desktops in service // group size) -> every group member is a job for rollout.py's
    stepper, and each desktop plays its job on its own (`play`, in its thread): reset, task setup,
      then screenshot -> the policy's answer -> parse the UI-TARS answer -> act (the settled screen
      comes back) until finished()/call_user()/an unparseable answer/max steps -> score, as OSWorld's
      DesktopEnv.evaluate: a last call_user() (FAIL) scores 1 on an infeasible task and 0 on a
      feasible one; otherwise 0, resp. the task's evaluator on the VM. Generation batches whatever
      observations are waiting (one policy call), so a slow desktop holds nobody ->
    replay: an all-failed group gets one member swapped for a stored success of the same task ->
    reward = score - format penalty -> advantages per group, broadcast to every assistant token ->
    GRPO update on whole trajectories (ARPO's schedule: the batch shuffled into two optimizer steps,
    dual clip, log-probs at the sampling temperature) -> store this iteration's successes -> log, checkpoint.
Tasks come in a seeded shuffled round robin. Every rollout goes through a `policy_fn(observations)
-> answers` (default: one batched model.generate), so a scripted policy can stand in (the tests do).
Output: runs/<name>/ with args.json, metrics.jsonl (one line per iteration), trajectories/, ckpt/.

Where this departs from ARPO (paper + its released code), on purpose:
1. Desktops are local Xvfb desktops (or remote `vm_server.py`s), not OSWorld's Ubuntu VMs; tasks are
   tasks/*.json with execution-based checks. A VM that fails (no answer, a 5xx, garbage) drops its
   episode as the environment's failure (the group goes on with fewer members; `env_failures` in the
   metrics) instead of stalling the run or costing the model a format penalty; only a refused
   action (4xx) is the model's. Evaluation and task selection play a lost episode once more.
2. No lockstep (rollout.py): each desktop steps on its own and generation batches the observations
   that are ready, so VM waits and generation overlap (`bench/arpo_iter.py` measures it); ARPO's
   workers are Ray actors stepped together, one batched generate per step. The sampled tokens of a
   run are therefore not reproducible across runs (batches depend on timing); the task order is.
   After an action the screen settles by the server's watch (--settle watch, the default: until
   it stops changing, with a cap) or, as ARPO/OSWorld, a fixed sleep (--settle 0.5).
3. The format penalty follows ARPO's code (reward = score + 0.5 * (-1 on an unparseable answer), and
   that answer ends the episode); `--format-penalty` sets the 0.5, `--no-stop-on-format-error` lets the
   episode go on (the penalty is still paid once per trajectory).
4. The replay buffer is saved in every checkpoint and restored on resume (ARPO's is lost). Injection
   replaces the lowest scorer of the failed group (grpo.ReplayBuffer); ARPO's paper says a random
   member, its code replaces the first. The members of a group that qualifies score about the same;
   the lowest keeps a rare partial success that the first or a random pick could throw away.
5. The update follows ARPO's verl config (examples/osworld_full_arpo.sh): its global_batch_size 8
   counts tasks and EasyR1 multiplies it by the 8 rollouts, so 16 tasks x 8 make two optimizer
   steps of 64 trajectories; `--mini-batch 0` does the same at any scale (half the batch per step),
   on a seeded shuffle of it (verl reorders the batch by length; ScreenExplorer's release shuffles).
   Dual clip c = 3.0, clip 0.2 / 0.3, no learning-rate warm-up (ARPO: lr_warmup_ratio 0.0). Every
   log-prob is scored at the sampling temperature, as verl does. HF generate on CPU / vLLM on a GPU,
   where the context length comes from --max-images, --max-pixels, --max-steps, --max-new-tokens
   (ARPO leaves vLLM at the model's own).
6. Training contexts: with max steps <= max images (the default 15/15, as ARPO) a trajectory is one
   sequence, exactly the context each step saw, as ARPO trains. With more steps (ARPO never has
   them) each later answer becomes its own sequence with the screenshots it saw (episode_samples),
   weighted so the trajectory still counts once.
7. Scoring is OSWorld's (outcome_scores). Evaluation: "standard" counts an episode that runs out of
   steps as ending in FAIL (so an infeasible task passes by timing out and a feasible one scores 0),
   "hard" does not (ARPO's OSWorld-Hard). Training rewards use the hard rule, as ARPO's training
   environment did.
8. Knobs ARPO does not have, for small models trained from scratch (bench/learning.py): a learning-rate
   warm-up and decay (--lr-warmup, --lr-schedule; ARPO: constant), several passes over each batch
   (--epochs; ARPO: one), and a sampling seed of its own (--sample-seed), so an evaluation draws fresh
   samples from a checkpoint while the task order stays the run's. Their defaults are ARPO's.
9. Left out: KL to a reference model (beta 0, as ARPO; `--beta` works with LoRA only). Logging:
   metrics.jsonl always, plus Weights & Biases (--wandb) and TensorBoard (--tensorboard) when asked
   for (progress.py).
10. More than one GPU (ARPO: verl's FSDP on 8-16 GPUs with Ray): `torchrun --nproc_per_node N
   train_arpo.py ...`; each rank plays its own groups on its slice of the VMs, the replay buffer
   and the task order are the same on every rank, and full fine-tuning is sharded with FSDP2
   (dist.py, README "More than one GPU").
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from io import BytesIO

import numpy as np
import torch
from PIL import Image
from transformers.utils import logging as hf_logging

import dist
import progress
import rollout
import rundir
from actions import MIN_PIXELS, parse_action, smart_resize
from chat import encode_chat, uitars_messages
from env import Task, TaskError, VMError, VMPool, load_tasks
from rollout import SETTLE_HELP, EnvFailure, parse_settle, refused
from grpo import ReplayBuffer, group_advantages, trajectory_sample, update_policy
from model import Generation, generate, load_policy, sync_weights

PROG = "train_arpo.py"

# ------------------------------------------------------------------------------------------------
# Args


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    # desktops and tasks
    vms: str = arg("16", "number of local desktops to launch, or comma-separated URLs of running vm_server.py")
    token: str = arg("", "secret each remote VM's token is derived from (default: $VM_TOKEN); local desktops make their own")
    vm_timeout: float = arg(60.0, "seconds one VM call may take before that VM drops out of the iteration")
    screen: str = arg("1280x720", "screen size of local desktops")
    tasks: str = arg("tasks/", "a task file or a folder of *.json task files")
    task_ids: str = arg("", "comma-separated task ids to use (default: every task)")
    group_size: int = arg(8, "rollouts per task = one GRPO group (ARPO: 8); tasks per iteration = live VMs // this")
    # policy
    model: str = arg("ByteDance-Seed/UI-TARS-1.5-7B",
                     "HF id or folder of a Qwen2.5-VL checkpoint; 'tiny' = random test model (CPU)")
    engine: str = arg("hf", "generation engine: hf (any device) or vllm (GPU, pip install vllm)")
    lora_rank: int = arg(0, "LoRA rank; 0 = full fine-tuning (ARPO)")
    lora_alpha: int = arg(16, "LoRA alpha")
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    max_pixels: int = arg(2116800, "max pixels of a screenshot as the model sees it (ARPO: 2116800)")
    min_pixels: int = arg(MIN_PIXELS, "min pixels of a screenshot as the model sees it")
    max_new_tokens: int = arg(256, "tokens one answer may take (Thought + Action)")
    # rollout
    iterations: int = arg(100, "training iterations (each: one rollout of every group + one update)")
    max_steps: int = arg(15, "steps per episode at most (ARPO: 15); a task's own max_steps may lower it")
    max_images: int = arg(15, "screenshots kept in the prompt (ARPO: 15); older ones stay as text")
    temperature: float = arg(1.0, "sampling temperature in training; the update scores log-probs at it too (ARPO: 1.0)")
    top_p: float = arg(1.0, "nucleus sampling in training")
    stop_on_format_error: bool = arg(True, "an unparseable answer ends the episode, as in ARPO's code")
    settle: str = arg("watch", "after each action: 'watch' (the server waits until the screen stops changing, "
                               "with a cap) or seconds of a fixed sleep (ARPO/OSWorld: 0.5)")
    # reward, loss, update
    format_penalty: float = arg(0.5, "reward -= this if any answer of the trajectory did not parse (ARPO: 0.5 * 1)")
    lr: float = arg(1e-6, "AdamW learning rate (ARPO: 1e-6)")
    lr_warmup: int = arg(0, "iterations of linear learning-rate warm-up from lr / N (ARPO: none)")
    lr_schedule: str = arg("constant", "learning rate after the warm-up: constant (ARPO), linear or cosine "
                                       "(decay towards 0 at --iterations)")
    epochs: int = arg(1, "passes of the optimizer over each iteration's batch (old log-probs fixed first)")
    eps_low: float = arg(0.2, "lower clip range of the ratio")
    eps_high: float = arg(0.3, "upper clip range of the ratio (clip-higher; ARPO: 0.3)")
    beta: float = arg(0.0, "KL coefficient to the starting policy (ARPO: 0; needs --lora-rank)")
    loss_agg: str = arg("seq-mean-token-mean", "loss aggregation: seq-mean-token-mean or token-mean")
    micro_batch: int = arg(1, "sequences per forward/backward (memory knob only)")
    mini_batch: int = arg(0, "sequences per optimizer step; 0 = ARPO's schedule: the batch in two steps "
                             "(ARPO: 16 tasks x 8 rollouts, 8 tasks x 8 per step)")
    dual_clip: float = arg(3.0, "dual-clip c: a negative advantage's loss is capped at c * |A| (ARPO: 3.0; 0 = off)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    # replay buffer and task selection
    replay: bool = arg(True, "ARPO's replay buffer of successes (--no-replay: the GRPO ablation)")
    replay_capacity: int = arg(8, "stored successes per task (ARPO: 8)")
    success_threshold: float = arg(0.1, "a trajectory is a success if its score is above this (ARPO: 0.1)")
    select_tasks: int = arg(0, "before training, K rollouts per task; keep the tasks solved at least once (ARPO: 16)")
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
    seed: int = arg(0, "seed of task order, the update's shuffle, the replay buffer and the tiny model's weights")
    # Task order (pick_tasks), the replay buffer and the tiny model's weights have Randoms of their
    # own seeded by --seed; sampling draws from torch's generator. So an eval can take fresh samples
    # of a checkpoint, and two runs can share a task order and differ in their samples.
    sample_seed: int = arg(-1, "seed of sampling answers (training and --eval-only); -1 = --seed")
    wandb: bool = arg(False, "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names the project)")
    tensorboard: bool = arg(False, "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)")


def check_args(args: Args) -> None:
    """Errors a user can cause, each as one sentence."""
    import vllm_engine  # plain Python until an engine is built (vLLM itself is imported there)
    rundir.check([
        (args.group_size < 1, "--group-size must be at least 1 (ARPO uses 8)"),
        (args.engine not in ("hf", "vllm"), "--engine must be hf or vllm"),
        (args.loss_agg not in ("seq-mean-token-mean", "token-mean"), "--loss-agg must be seq-mean-token-mean or token-mean"),
        (args.beta != 0 and args.lora_rank == 0, "--beta > 0 needs a reference policy: add --lora-rank 64 (the "
                                                  "adapter-free model is the reference), or keep --beta 0 as ARPO does"),
        (args.dual_clip != 0 and not args.dual_clip > 1, "--dual-clip must be above 1 (ARPO uses 3.0), or 0 to switch it off"),
        (args.mini_batch < 0 or args.micro_batch < 1, "--mini-batch must be 0 (ARPO's two steps per iteration) or "
                                                      "more, and --micro-batch at least 1"),
        (min(args.max_steps, args.max_images, args.max_new_tokens, args.eval_episodes, args.ckpt_every) < 1,
         "--max-steps, --max-images, --max-new-tokens, --eval-episodes and --ckpt-every must be at least 1"),
        (args.lr_schedule not in ("constant", "linear", "cosine"), "--lr-schedule must be constant, linear or cosine"),
        (args.lr_warmup < 0 or args.epochs < 1, "--lr-warmup must be 0 or more and --epochs at least 1"),
        (screen_size(args) is None, "--screen must be WIDTHxHEIGHT, e.g. 1280x720"),
        (parse_settle(args.settle) is None, SETTLE_HELP),
        *vllm_engine.flag_errors(args.engine, args.temperature, args.eval_temperature),
    ], PROG)


def screen_size(args: Args) -> tuple[int, int] | None:
    w, _, h = args.screen.lower().partition("x")
    return (int(w), int(h)) if w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0 else None


def resolve_args(argv=None) -> tuple:
    """The command line; on --resume, the run's saved args with the flags given now on top.
    -> (args, (checkpoint state, folder) or None, the flags given now)."""
    args, given = rundir.parse_args(Args, argv, PROG)
    args, ckpt = rundir.resume_args(Args, args, given, PROG, marker="group_size")
    check_args(args)
    return args, ckpt, given


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


def to_record(ep: Episode, first: int = 0) -> dict:
    """A plain dict for the replay buffer and checkpoints: screenshots as PNG bytes (~10x smaller than
    pixels), the task as a dict, so unpickling never needs this module's classes."""
    def png(img):
        if isinstance(img, bytes):
            return img
        buf = BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    d = {f.name: getattr(ep, f.name) for f in fields(Episode)}
    # the VM by its number among all ranks' (`first`: this rank's first VM's)
    return {**d, "vm": first + ep.vm, "task": asdict(ep.task), "screenshots": [png(s) for s in ep.screenshots]}


def from_record(d: dict) -> Episode:
    return Episode(**{**d, "task": Task(**d["task"])})


def _image(x) -> Image.Image:
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


def model_policy(policy, args: Args, temperature: float):
    """The default policy_fn: one batched generate over all observations -> Generations."""
    def policy_fn(observations: list[Observation]) -> list[Generation]:
        return generate(policy, [o.messages for o in observations], max_new_tokens=args.max_new_tokens,
                        temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0)
    return policy_fn


# ------------------------------------------------------------------------------------------------
# One episode on one desktop (a generator rollout.run steps in the desktop's own thread), and many


def observe(e: Episode, img: Image.Image, args: Args) -> Observation:
    """The prompt of the episode's next step: its screenshots so far, the last one `img`."""
    # The size the processor resizes this screenshot to: UI-TARS answers in those pixels.
    h, w = smart_resize(img.height, img.width, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    # The history: earlier answers as the sampled ids themselves, so this prompt and the training
    # sequence built from the same episode later hold the very same tokens.
    msgs = uitars_messages(e.task.instruction, e.screenshots, e.assistant, max_images=args.max_images)
    return Observation(e.task, e.vm, len(e.assistant), msgs, img.size, (w, h), e.job)


def record(e: Episode, o: Observation, out, args: Args):
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


def play(desk: rollout.Desktop, task: Task, args: Args, group: int = 0, iteration: int = 0, job: int = 0):
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
                    if not refused(err):
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


def score_episode(e: Episode, evaluator_score: float | None, args: Args) -> None:
    """Fill score (hard), score_standard and reward of a finished episode, in place. Feasible tasks:
    the evaluator's checks on the VM, overruled by a last FAIL; infeasible ones (evaluator_score
    None): 1 iff the last action is `fail` (call_user()); outcome_scores has the whole rule."""
    e.score, e.score_standard = outcome_scores(e.task.infeasible, e.actions, e.end, evaluator_score)
    # ALGO: ARPO's trajectory reward: the task score, minus the format penalty once if any answer
    # did not parse (its code: eval_result + 0.5 * format_reward, format_reward = -1).
    e.reward = e.score - args.format_penalty * (not all(e.format_ok))


def play_all(pool: VMPool, tasks: list[Task], policy_fn, args: Args, groups: list[int] | None = None,
             iteration: int = 0, retries: int = 0, desc: str = "episodes") -> tuple[list[Episode], rollout.Rollout]:
    """Play tasks[k] (repeats allowed; group groups[k]) on the pool's desktops, each stepping on its
    own (rollout.run: a freed desktop takes the next task; one the environment failed is played
    again elsewhere up to `retries` times). -> (one Episode per task, in order: finished, or
    `dropped` with its error; the Rollout: times, batch sizes, environment failures)."""
    groups = groups or [0] * len(tasks)
    episodes = [partial(play, task=t, args=args, group=g, iteration=iteration, job=k)
                for k, (t, g) in enumerate(zip(tasks, groups))]
    out = rollout.run(pool, episodes, policy_fn, retries=retries, desc=desc)
    eps = [r if not isinstance(r, rollout.Lost) else
           r.partial or Episode(tasks[k], -1 if r.vm is None else r.vm, groups[k], iteration, end="dropped",
                                error=r.error, job=k) for k, r in enumerate(out.results)]
    return eps, out


def run_jobs(pool: VMPool, jobs: list[Task], policy_fn, args: Args) -> tuple[list, int]:
    """Play a list of tasks (repeats allowed), each lost to the environment played once more on
    another desktop. -> (the finished episodes, in job order; how many were lost)."""
    eps, _ = play_all(pool, jobs, policy_fn, args, retries=1)
    done = [e for e in eps if e.end != "dropped"]
    return done, len(eps) - len(done)

# ------------------------------------------------------------------------------------------------
# Task selection and evaluation


def run_shared_jobs(pool: VMPool, jobs: list, policy_fn, args: Args, first: int = 0, save=None) -> tuple[list, int]:
    """run_jobs on this rank's share of `jobs` (a contiguous slice; one process: all of them).
    save(episode), if given, runs on the rank that played it. -> (every rank's episodes, as
    dicts in job order, VMs numbered among all ranks'; episodes lost to VM failures, all ranks')."""
    mine = dist.shard_range(len(jobs))
    eps, lost = run_jobs(pool, jobs[mine.start:mine.stop], policy_fn, args)
    rows = []
    for e in eps:
        e = replace(e, job=mine.start + e.job)
        if save is not None:
            save(e)
        rows.append({"task": e.task.id, "vm": first + e.vm, "job": e.job, "end": e.end, "steps": len(e.actions),
                     "score_standard": e.score_standard, "score_hard": e.score, "actions": e.actions,
                     "format_ok": e.format_ok, "texts": e.texts})
    rows = sorted((r for part in dist.gather(rows) for r in part), key=lambda r: r["job"])
    return rows, int(dist.all_sum([lost])[0])


def select_tasks(pool: VMPool, tasks: list, k: int, policy_fn, args: Args, first: int = 0) -> tuple[list, dict]:
    """ARPO's task selection: k rollouts per task with the starting policy; keep the tasks solved
    (score > success threshold) at least once. Returns (kept tasks, {task id: successes})."""
    eps, _ = run_shared_jobs(pool, [t for t in tasks for _ in range(k)], policy_fn, args, first)
    counts = {t.id: 0 for t in tasks}
    for e in eps:
        counts[e["task"]] += e["score_hard"] > args.success_threshold  # ALGO: "solved at least once"
    return [t for t in tasks if counts[t.id] > 0], counts


def evaluate_policy(pool: VMPool, tasks: list, policy_fn, args: Args, save_to: str | None = None,
                    first: int = 0) -> dict:
    """Success rate (mean score, as OSWorld reports it) per task and overall, under both protocols,
    and per episode what it did (details: every step's action, whether it parsed, the answer text).
    save_to: a folder that gets the episodes as a run's trajectories (view.py reads it), one
    "iteration" per task in the order given, one "vm" per rollout of it."""
    t0 = time.perf_counter()
    n = args.eval_episodes
    save = None if not save_to else (lambda e: save_episodes(save_to, e.job // n, [replace(e, vm=e.job % n)],
                                                             clear=False))
    eps, lost = run_shared_jobs(pool, [t for t in tasks for _ in range(n)], policy_fn, args, first, save)
    out = {"episodes": len(eps), "lost": lost, "episodes_per_task": n,
           "temperature": args.eval_temperature, "seconds": time.perf_counter() - t0}
    for proto, key in (("standard", "score_standard"), ("hard", "score_hard")):
        per_task = {}
        for t in tasks:
            s = [e[key] for e in eps if e["task"] == t.id]
            per_task[t.id] = sum(s) / len(s) if s else None
        all_s = [e[key] for e in eps]
        out[proto] = {"overall": sum(all_s) / len(all_s) if all_s else None, "per_task": per_task}
    out["details"] = eps
    steps = [ok for e in eps for ok in e["format_ok"]]
    out["format_rate"] = sum(steps) / len(steps) if steps else None  # share of answers that parsed
    return out


def eval_table(result: dict) -> str:
    fmt = lambda v: "  -  " if v is None else f"{v:5.2f}"  # noqa: E731
    rows = [f"{'task':32s} standard  hard"]
    for tid in result["standard"]["per_task"]:
        rows.append(f"{tid:32s} {fmt(result['standard']['per_task'][tid])}   {fmt(result['hard']['per_task'][tid])}")
    rows.append(f"{'overall':32s} {fmt(result['standard']['overall'])}   {fmt(result['hard']['overall'])}"
                f"   ({result['episodes']} episodes, {result['lost']} lost to VM failures)")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# One training iteration


@dataclass
class Trainer:
    """What an iteration needs; replay is None with --no-replay."""
    args: Args
    pool: VMPool
    policy: object
    optimizer: torch.optim.Optimizer
    replay: ReplayBuffer | None
    policy_fn: object
    run: str | None = None
    tasks: list = field(default_factory=list)  # the training task list (after --select-tasks)
    picker: dict = field(default_factory=lambda: {"epoch": 0, "pos": 0})  # pick_tasks' place in the order
    first: int = 0  # under torchrun: the number of this rank's first VM among all ranks' VMs


def plan_groups(live: list[int], group_size: int) -> list[list[int]]:
    """Live VMs -> groups of group_size (leftovers idle). Fewer live VMs than a group: one group."""
    n = len(live) // group_size
    if n == 0:  # a smaller group still gives GRPO a baseline; a lone VM gets replay or nothing
        return [live] if live else []
    return [live[g * group_size:(g + 1) * group_size] for g in range(n)]


def lr_at(it: int, args: Args) -> float:
    """The learning rate of iteration `it` (0-based): rundir.scheduled_lr over --iterations. ARPO
    keeps lr constant without warm-up; a small model trained from scratch at a high lr needs the
    decay to keep what it learned (at a constant lr 1e-3 the tiny model can learn a task to 0.92
    and lose it in the last iterations)."""
    return rundir.scheduled_lr(args.lr, it, args.iterations, args.lr_warmup, args.lr_schedule)


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


def episode_samples(policy, ep: Episode, args: Args, advantage: float = 0.0) -> list:
    """ALGO: a trajectory as training sequences, every answer in the context it was sampled in: the
    conversation re-encoded, the sampled answer ids verbatim, the sampler's log-probs alongside.

    With at most --max-images steps (ARPO: 15 and 15) that is ONE sequence, target_mask over every
    assistant turn, as ARPO trains. Past that, answer i saw only screenshots i-K+1..i (K = max
    images): the first K answers still share one sequence, and every later answer is a sequence of
    its own, its prompt exactly as sampled and only its answer a target. Each piece's weight is its
    share of the trajectory's target tokens, so under seq-mean-token-mean the pieces count as one
    sequence and the loss is the one the whole trajectory would give."""
    shots = [_image(s) for s in ep.screenshots]
    n, K = len(ep.assistant), args.max_images
    lps = ep.logprobs if len(ep.logprobs) == n and all(lp is not None for lp in ep.logprobs) else None
    im_start = policy.tokenizer.convert_tokens_to_ids("<|im_start|>")
    pieces = []
    for end in [min(n, K)] + list(range(K + 1, n + 1)):  # answers [0, end) in context; the last one or all targets
        msgs = uitars_messages(ep.task.instruction, shots[:end], ep.assistant[:end], max_images=K)
        enc = encode_chat(policy, msgs, add_generation_prompt=False)
        first = 0 if end <= K else end - 1  # the first answer this piece trains
        if first:  # earlier answers are context here: only the last assistant turn is a target
            last_turn = max(i for i, t in enumerate(enc.input_ids) if t == im_start)
            enc.target_mask = [0] * last_turn + enc.target_mask[last_turn:]
        old = [x for lp in lps[first:end] for x in lp] if lps is not None else None
        pieces.append(trajectory_sample(enc, ep.reward, ep.group, old))
    total = sum(sum(p.target_mask) for p in pieces)
    for p in pieces:
        p.advantage = advantage
        p.weight = sum(p.target_mask) / total if total else 1.0 / len(pieces)
    return pieces


def apply_replay(buffer: ReplayBuffer, members: list[Episode], group: int, first: int = 0) -> tuple[list, dict | None]:
    """ALGO: ARPO's replay. If the group failed alike (score std < 0.05 and mean < 0.2), one member
    is replaced by a stored success of the same task (stored in an EARLIER iteration: the buffer is
    filled only after this step). Returns the group's trajectories for the update + the injection."""
    # ARPO decides on the evaluator scores (not the rewards with their format penalty): a group
    # whose members all failed the task needs a success, however well-formed their answers were.
    new, _, injected = buffer.inject(members[0].task.id, members, [e.score for e in members])
    if not injected:
        return members, None
    k = next(i for i, (a, b) in enumerate(zip(members, new)) if a is not b)  # the replaced member
    # The stored success joins this group: its own reward, normalised against today's members. Its
    # sampler log-probs are an older policy's: dropped, so logp_gap compares like with like.
    ep = replace(from_record(new[k]), group=group, replayed=True, logprobs=[])
    return members[:k] + [ep] + members[k + 1:], {
        "task": ep.task.id, "group": group, "replaced_vm": first + members[k].vm, "from_iteration": ep.iteration,
        "from_vm": ep.vm, "score": ep.score, "reward": ep.reward}


def replay_groups(buffer: ReplayBuffer | None, fresh: list[Episode], task_ids: list[str], scores: dict,
                  first: int = 0):
    """Per group: replay (if on) and its stats. Returns (update batch, injections, group stats) of
    this rank's groups. `scores`: {group: its fresh members' scores} of EVERY group (under torchrun,
    of every rank): each rank keeps the same replay buffer, so every rank draws for every group."""
    batch, injections, stats = [], [], []
    for g, tid in enumerate(task_ids):
        members = [e for e in fresh if e.group == g]
        if not members:
            if buffer is not None and scores.get(g):  # another rank's group: the same draw as there
                buffer.inject(tid, [None] * len(scores[g]), scores[g])
            continue  # (or every VM of this group failed: nothing to learn from it)
        if buffer is not None:
            members, inj = apply_replay(buffer, members, g, first)
            injections += [inj] if inj else []
        batch += members
        r = torch.tensor([e.reward for e in members])  # (G,)
        # `scores` are this iteration's fresh rollouts only, so a success rate read from them is the
        # policy's; a replayed member's score is listed apart. `rewards` (and mean, std) are what the
        # update normalised, fresh and replayed members alike, labelled member by member in `members`.
        stats.append({"group": g, "task": tid, "n": len(members),
                      "scores": [e.score for e in members if not e.replayed],
                      "replayed_scores": [e.score for e in members if e.replayed],
                      "rewards": r.tolist(), "members": ["replayed" if e.replayed else "fresh" for e in members],
                      "mean": float(r.mean()), "std": float(r.std()) if len(r) > 1 else 0.0,
                      "replayed": any(e.replayed for e in members)})
    return batch, injections, stats


def flat_groups(groups: list, advantages: list[float]) -> int:
    """ARPO's "invalid groups", those with no learning signal: every advantage 0 (group_advantages
    gives that to equal rewards or a lone member). The update's own rule, so a group whose
    rewards differ by a hair counts as learning, as it does in the update (ARPO: std < 0.01)."""
    by_group: dict = {}
    for g, a in zip(groups, advantages):
        by_group.setdefault(g, []).append(a)
    return sum(all(a == 0 for a in advs) for advs in by_group.values())


UPDATE_KEYS = ("loss", "pg_loss", "kl", "clip_low", "clip_high", "clip_dual", "ratio_mean", "grad_norm", "tokens",
               "steps")


def iteration_metrics(it, task_ids, fresh: list[dict], failures: list, batch: list[dict], upd, times: dict,
                      batches: list[int], args: Args) -> dict:
    """One metrics.jsonl line: rewards, success, format, the update's numbers, the time split.
    fresh: every rank's finished episodes (outcome()); failures: every rank's environment failures
    as (VM, error); batch: every rank's trained trajectories; batches: every policy call's size.
    `dropped` episodes are the environment's failures (nothing is retried in training, so it equals
    `env_failures`); `env_errors` says what failed where. times: rundir.gather_times' (time/* as
    rollout.py's docstring says, vm_wait_share the share of the iteration the learner was idle)."""
    def mean(xs):
        return float(np.mean(xs)) if len(xs) else 0.0
    return {
        "iteration": it, "tasks": task_ids, "episodes": len(fresh), "dropped": len(failures),
        "env_failures": len(failures), **({"env_errors": {str(vm): err for vm, err in failures}} if failures else {}),
        "reward_mean": mean([e["reward"] for e in fresh]),
        "reward_std": float(np.std([e["reward"] for e in fresh])) if fresh else 0.0,
        "score_mean": mean([e["score"] for e in fresh]),
        "success_rate": mean([e["score"] > args.success_threshold for e in fresh]),
        "format_rate": mean([ok for e in fresh for ok in e["format_ok"]]),  # share of steps that parsed
        "steps_mean": mean([e["steps"] for e in fresh]),
        "batch": batch,
        **{f"actor/{k}": upd.get(k, 0.0) for k in UPDATE_KEYS},
        # trainer vs sampler log-probs of this iteration's sampled tokens (0 on the HF path; vLLM
        # numerics show here), over the micro-batches whose sequences all carry the sampler's numbers
        **({"actor/logp_gap": upd["logp_gap"]} if "logp_gap" in upd else {}),
        "rollout/batches": len(batches), "rollout/batch_mean": mean(batches),
        **times}


def outcome(e: Episode) -> dict:
    """What the metrics need of a finished episode (small enough to gather from every rank)."""
    return {"reward": e.reward, "score": e.score, "format_ok": e.format_ok, "steps": len(e.actions)}


def batch_rows(batch: list[Episode], adv: list[float], pieces: list, first: int) -> list[dict]:
    """metrics' "batch": each trained trajectory (VMs numbered among all ranks')."""
    return [{"task": e.task.id, "group": e.group, "vm": e.vm if e.replayed else first + e.vm, "replayed": e.replayed,
             "from_iteration": e.iteration, "reward": e.reward, "advantage": a,
             "target_tokens": int(sum(sum(p.target_mask) for p in ps)), "steps": len(e.actions),
             "sequences": len(ps)} for e, a, ps in zip(batch, adv, pieces)]


def replay_and_store(tr: Trainer, fresh: list[Episode], task_ids: list[str]) -> tuple:
    """ALGO: replay into all-failed groups, THEN store this iteration's successes. Under torchrun
    every rank keeps the same buffer: the groups' scores and the successes of every rank, in rank
    order. -> replay_groups' (batch, injections, group stats) of this rank's groups."""
    scores = {}
    for part in dist.gather({e.group: [x.score for x in fresh if x.group == e.group] for e in fresh}):
        scores.update(part)
    batch, injections, stats = replay_groups(tr.replay, fresh, task_ids, scores, tr.first)
    if tr.replay is not None:
        # ALGO: success = score > 0.1; PNG-encode only those
        mine = [(e.task.id, to_record(e, tr.first), e.score) for e in fresh if e.score > tr.replay.success_threshold]
        for tid, record, score in [x for part in dist.gather(mine) for x in part]:
            tr.replay.add(tid, record, score)
    return batch, injections, stats


def assign_tasks(tr: Trainer, pick) -> tuple[list[str], list[Task], list[int]]:
    """Split the desktops in service into groups and give each group the next task. -> (task id per
    group, every rank's; this rank's jobs: one task per group member; the group of each job)."""
    groups = plan_groups(rollout.in_service(tr.pool), tr.args.group_size)
    if not groups:
        raise SystemExit("No VM answered; check that the desktops run (see --vms).")
    # Under torchrun every rank draws the tasks of ALL groups (the same ids: the order is a function
    # of the seed) and plays its own, numbered after the earlier ranks' groups: a group never
    # straddles ranks.
    counts = dist.gather(len(groups))
    first = sum(counts[:dist.rank()])
    task_ids = pick(sum(counts))
    by_id = {t.id: t for t in tr.tasks}
    jobs, job_group = [], []
    for g, (vms, tid) in enumerate(zip(groups, task_ids[first:])):
        jobs += [by_id[tid]] * len(vms)
        job_group += [first + g] * len(vms)
    return task_ids, jobs, job_group


def update(tr: Trainer, batch: list[Episode], it: int) -> tuple:
    """ALGO: advantages per group of trajectories, broadcast to every assistant token, then the GRPO
    update in ARPO's schedule (two shuffled mini-batches by default, dual clip, log-probs at the
    sampling temperature). -> (advantage per trajectory, its training sequences, update metrics)."""
    args = tr.args
    adv = group_advantages([e.reward for e in batch], [e.group for e in batch]).tolist()  # (N,)
    pieces = [episode_samples(tr.policy, e, args, a) for e, a in zip(batch, adv)]
    samples = [p for ps in pieces for p in ps]
    if not samples and dist.size() == 1:
        return adv, pieces, {}
    n_all = int(dist.all_sum([len(samples)])[0])  # every rank's sequences
    mini = args.mini_batch or math.ceil(n_all / 2)  # ALGO: ARPO: 2 optimizer steps per batch
    with progress.bar(len(samples) * args.epochs, "update") as pb:
        upd = update_policy(tr.policy, tr.optimizer, samples, micro_batch_size=args.micro_batch,
                            eps_low=args.eps_low, eps_high=args.eps_high, beta=args.beta,
                            max_grad_norm=args.max_grad_norm, agg=args.loss_agg, mini_batch_size=mini,
                            epochs=args.epochs, on_micro_batch=pb.update, temperature=args.temperature,
                            dual_clip=args.dual_clip or None,
                            shuffle=random.Random(f"{args.seed}-update-{it}"))  # the same on a resume
    sync_weights(tr.policy)  # vLLM generates with the new weights from the next step on
    return adv, pieces, upd


def run_iteration(tr: Trainer, it: int, pick) -> tuple[dict, list[Episode]]:
    """One ARPO iteration; pick(n) -> n task ids. Returns (metrics, this rank's episodes)."""
    args, pool, times = tr.args, tr.pool, {}
    t0 = time.perf_counter()
    lr = rundir.set_lr(tr.optimizer, lr_at(it, args))
    # -- one task per group; every group member is a job (dead remote VMs re-checked meanwhile)
    with rundir.timed(times, "vm_wait"):
        task_ids, jobs, job_group = assign_tasks(tr, pick)
    # -- the rollout: each desktop resets, sets up, plays and scores its episode on its own
    with dist.unsharded(tr.policy.model):  # FSDP2: each rank decodes alone, with whole weights
        eps, out = play_all(pool, jobs, tr.policy_fn, args, job_group, it, desc="rollout")
    for k, v in out.times.items():
        times[k] = times.get(k, 0.0) + v
    fresh = [e for e in eps if e.end != "dropped"]
    # -- ALGO: replay into all-failed groups, THEN store this iteration's successes
    batch, injections, group_stats = replay_and_store(tr, fresh, task_ids)
    # -- ALGO: group advantages and the GRPO update
    with rundir.timed(times, "update"):
        adv, pieces, upd = update(tr, batch, it)
    times["time/iteration"] = time.perf_counter() - t0
    # -- every rank's numbers into one line
    mine = {"fresh": [outcome(e) for e in fresh], "batch": batch_rows(batch, adv, pieces, tr.first),
            "groups": group_stats, "injections": injections, "batches": out.batches, "settles": out.settles,
            "failures": [(tr.first + f.vm if f.vm is not None else None, f.error) for f in out.failures]}
    parts = dist.gather(mine)
    every = {k: [x for p in parts for x in p[k]] for k in ("fresh", "batch", "groups", "injections", "batches",
                                                           "failures", "settles")}
    m = iteration_metrics(it, task_ids, every["fresh"], every["failures"], every["batch"], upd,
                          rundir.gather_times(times), every["batches"], args)
    m.update({"actor/lr": lr, "groups": every["groups"], "replay_injections": every["injections"],
              "n_injections": len(every["injections"]), "replay_size": len(tr.replay) if tr.replay is not None else 0,
              **rollout.settle_metrics(every["settles"]),
              "zero_std_groups": flat_groups([b["group"] for b in every["batch"]], [b["advantage"] for b in every["batch"]])})
    return m, eps


def save_episodes(run: str, it: int, eps: list, first: int = 0, clear: bool = True) -> None:
    """Each VM's episode: every step's screenshot, thought, action, then a final line with the score.
    VMs are numbered among all ranks' (`first`: this rank's first VM's)."""
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
                      "format_penalty": e.reward - e.score, "reward": e.reward})
        rundir.save_trajectory(run, it, first + e.vm, steps, list(e.screenshots) + [None])


def summary_line(m: dict) -> str:
    return (f"it {m['iteration']:4d} | tasks {','.join(m['tasks'])[:40]:40s} | reward {m['reward_mean']:+.2f}"
            f"±{m['reward_std']:.2f} | success {m['success_rate']:.2f} | format {m['format_rate']:.2f} | "
            f"replay +{m['n_injections']}{''.join(' ' + i['task'] for i in m['replay_injections'])} "
            f"({m['replay_size']} stored) | flat groups {m['zero_std_groups']}/{len(m['groups'])} | "
            f"kl {m['actor/kl']:.4f} clip {m['actor/clip_low']:.2f}/{m['actor/clip_high']:.2f}/"
            f"{m['actor/clip_dual']:.2f} ({m['actor/steps']:.0f} steps) | {m['time/iteration']:.1f}s (gen "
            f"{m['time/generation']:.1f} in {m['rollout/batches']} batches, upd {m['time/update']:.1f}, VM wait "
            f"{100 * m['vm_wait_share']:.0f}%; per desktop: reset {m['time/reset']:.1f} env {m['time/env']:.1f} "
            f"eval {m['time/evaluate']:.1f})" + (f" | env failures {m['env_failures']}" if m["env_failures"] else ""))


# ------------------------------------------------------------------------------------------------
# Setup: tasks, policy, checkpoints


def load_task_list(args: Args, ids: list[str] | None = None) -> list[Task]:
    try:
        tasks = load_tasks(args.tasks)
    except TaskError as e:
        raise SystemExit(str(e))
    want = ids if ids is not None else [s.strip() for s in args.task_ids.split(",") if s.strip()]
    if want:
        by_id = {t.id: t for t in tasks}
        missing = [i for i in want if i not in by_id]
        if missing:
            raise SystemExit(f"unknown task id(s) {missing} in {args.tasks}; check --task-ids.")
        tasks = [by_id[i] for i in want]
    return tasks


def make_policy(args: Args, ckpt: tuple[dict, str] | None):
    """The starting policy, or the one a checkpoint holds (rundir.restore_policy)."""
    def load(name):
        return load_policy(name, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed,
                           gradient_checkpointing=args.gradient_checkpointing, min_pixels=args.min_pixels,
                           max_pixels=args.max_pixels)
    policy = load(args.model) if ckpt is None else rundir.restore_policy(*ckpt, load)
    dist.spread(policy.model, shard=args.lora_rank == 0)  # torchrun: rank 0's weights; full FT: FSDP2
    if args.engine == "vllm":  # GPU only: prompts of --max-images screenshots and every answer of an episode
        import vllm_engine
        vllm_engine.attach(policy, args.max_images, args.max_steps * (args.max_new_tokens + 6))
    return policy


def eval_only(pool: VMPool, tasks: list, policy, args: Args, run: str, iteration: int, first: int = 0) -> None:
    """--eval-only: eval_it<N>.json (or --eval-out) and the episodes beside it in eval_it<N>/
    (`python view.py runs/<name>/eval_it<N>` shows what was clicked)."""
    out = args.eval_out or os.path.join(run, f"eval_it{iteration:06d}.json")
    root, ext = os.path.splitext(out)
    folder = root if ext else out + "_episodes"  # never the JSON's own path
    if dist.is_main():
        shutil.rmtree(folder, ignore_errors=True)  # a second eval of the same checkpoint replaces the first
    dist.barrier()
    with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
        result = evaluate_policy(pool, tasks, model_policy(policy, args, args.eval_temperature), args,
                                 save_to=folder if args.save_trajectories else None, first=first)
    result.update(model=args.model, run=run, iteration=iteration, protocols={
        "standard": "an episode that runs out of steps counts its last action as FAIL (OSWorld)",
        "hard": "the last action is what the agent did (OSWorld-Hard in ARPO)"})
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(eval_table(result))
        print(f"eval written to {out}")


def setup(args: Args, pool: VMPool, policy, run: str, ckpt, tasks: list, first: int = 0) -> tuple[Trainer, int]:
    """The optimizer, the replay buffer and the task order, fresh (after --select-tasks) or from the
    checkpoint. -> (Trainer, the first iteration to run)."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)  # ARPO: AdamW, wd 0.01
    replay = ReplayBuffer(args.replay_capacity, args.success_threshold, seed=args.seed) if args.replay else None
    picker, start = {"epoch": 0, "pos": 0}, 0
    if ckpt is not None:
        if replay is not None and ckpt[0]["replay"] is not None:
            replay.load_state_dict(ckpt[0]["replay"])  # ARPO's own code starts it empty again
        picker = dict(ckpt[0]["picker"])
        start = rundir.resume(run, ckpt, policy, optimizer)  # optimizer, metrics.jsonl and RNG states
        print(f"resumed {run} at iteration {start} ({len(replay or [])} stored successes)")
    dist.seed_ranks((args.seed if args.sample_seed < 0 else args.sample_seed) + start)  # torchrun: own samples
    if ckpt is None and args.select_tasks > 0:
        with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
            tasks = select_and_record(pool, tasks, model_policy(policy, args, args.temperature), args, run, first)
    policy_fn = model_policy(policy, args, args.temperature)
    return Trainer(args, pool, policy, optimizer, replay, policy_fn, run, tasks, picker, first), start


def checkpoint(tr: Trainer, next_it: int, metrics: dict | None = None) -> None:
    """rundir.save plus ARPO's own state: the replay buffer, the task order, the task list."""
    rundir.save(tr.run, tr.policy, tr.optimizer, next_it, tr.args, metrics, picker=dict(tr.picker),
                tasks=[t.id for t in tr.tasks], replay=tr.replay.state_dict() if tr.replay is not None else None)


def train(tr: Trainer, start: int) -> None:
    """The loop: one iteration, then trajectories, checkpoint, metrics line, console line."""
    args, run, ids = tr.args, tr.run, [t.id for t in tr.tasks]
    trackers = rundir.open_trackers(run, args)
    for it in progress.track(range(start, args.iterations), "iterations"):
        m, eps = run_iteration(tr, it, lambda n: pick_tasks(ids, tr.picker, n, args.seed))
        t0 = time.perf_counter()
        if args.save_trajectories:
            save_episodes(run, it, eps, tr.first)
        if (it + 1) % args.ckpt_every == 0 or it + 1 == args.iterations:
            checkpoint(tr, it + 1, m)
        m["time/save"] = time.perf_counter() - t0
        rundir.end_iteration(run, trackers, m, summary_line(m))
    progress.close(trackers)


def main(argv=None) -> None:
    dist.init()  # torchrun: join the other ranks (one process: nothing)
    dist.mute_others()
    args, ckpt, given = resolve_args(argv)
    hf_logging.disable_progress_bar()  # one summary line per iteration; load/save bars are noise here
    rundir.seed_all(args.seed, args.sample_seed)
    # A resumed run trains on the task list it trained on (after --select-tasks), unless told otherwise.
    # The tasks before the run folder: a bad --tasks or --task-ids leaves nothing behind.
    resumed_ids = ckpt[0]["tasks"] if ckpt is not None and not args.eval_only and "task_ids" not in given else None
    tasks = load_task_list(args, resumed_ids)
    run = args.resume or rundir.run_path(args.runs_dir, args.run_name)
    with rundir.new_run(run):  # a bad --model or --vms: one sentence, and no half-made run folder
        if not (args.eval_only and args.resume):  # evaluating a run: its args.json stays the training args
            rundir.make_run_dir(run, args, resume=bool(args.resume))
        policy = make_policy(args, ckpt)
        pool, _, _, first = rundir.open_desktops(args.vms, args.token, args.vm_timeout, screen_size(args))
    try:
        if args.eval_only:
            return eval_only(pool, tasks, policy, args, run, rundir.next_iteration(ckpt[0]) if ckpt else 0, first)
        train(*setup(args, pool, policy, run, ckpt, tasks, first))
    finally:
        pool.close()


def select_and_record(pool: VMPool, tasks: list, policy_fn, args: Args, run: str, first: int = 0) -> list:
    """--select-tasks K: run the selection with the starting policy, write selected_tasks.json."""
    path = os.path.join(run, "selected_tasks.json")
    if os.path.exists(path):  # killed after selecting, before the first checkpoint: reuse it
        with open(path) as f:
            keep = json.load(f)["selected"]
        kept = [t for t in tasks if t.id in keep]
    else:
        print(f"task selection: {args.select_tasks} rollouts of each of {len(tasks)} tasks ...", flush=True)
        kept, counts = select_tasks(pool, tasks, args.select_tasks, policy_fn, args, first)
        if dist.is_main():
            with open(path, "w") as f:
                json.dump({"k": args.select_tasks, "success_threshold": args.success_threshold,
                           "successes": counts, "selected": [t.id for t in kept]}, f, indent=2)
        print(f"task selection kept {len(kept)}/{len(tasks)} tasks: {[t.id for t in kept]} (written to {path})")
    if not kept:
        raise SystemExit(f"no task was solved even once in {args.select_tasks} tries; raise --select-tasks, "
                         "use an easier task set, or train without --select-tasks.")
    return kept


if __name__ == "__main__":
    main()
