"""ARPO: GRPO on multi-turn desktop tasks, with a replay buffer of successes (arXiv 2505.16282).

    python train_arpo.py --vms 16 --group-size 8 --tasks tasks/          # UI-TARS-1.5-7B, a GPU
    python train_arpo.py --vms 4 --group-size 2 --model tiny --iterations 2 --max-steps 3   # CPU
    python train_arpo.py --resume runs/<name>                             # continue a run
    python train_arpo.py --select-tasks 16 ...                            # ARPO's task selection first
    python train_arpo.py --eval-only --resume runs/<name>                 # standard + hard success rates

One iteration, top to bottom (`run_iteration`):
    reset every VM -> pick tasks (live VMs // group size) -> task setup on each VM ->
    rollout: at each step ONE batched generate over all unfinished VMs, parse the UI-TARS answer,
      act, next screenshot; an episode ends at finished()/call_user()/an unparseable answer/max steps ->
    score, as OSWorld's DesktopEnv.evaluate: a last call_user() (FAIL) scores 1 on an infeasible
      task and 0 on a feasible one; otherwise 0, resp. the task's evaluator on the VM ->
    replay: an all-failed group gets one member swapped for a stored success of the same task ->
    reward = score - format penalty -> advantages per group, broadcast to every assistant token ->
    GRPO update on whole trajectories (ARPO's schedule: the batch shuffled into two optimizer steps,
    dual clip, log-probs at the sampling temperature) -> store this iteration's successes -> log, checkpoint.
Tasks come in a seeded shuffled round robin. Every rollout goes through a `policy_fn(observations)
-> answers` (default: one batched model.generate), so a scripted policy can stand in (the tests do).
Output: runs/<name>/ with args.json, metrics.jsonl (one line per iteration), trajectories/, ckpt/.

Where this departs from ARPO (paper + its released code), on purpose:
1. Desktops are local Xvfb desktops (or remote `vm_server.py`s), not OSWorld's Ubuntu VMs; tasks are
   tasks/*.json with execution-based checks. A VM that dies drops out of its group (the group goes on
   with fewer members) instead of stalling the run.
2. Rollouts step in lockstep: VM waits and generation do not overlap (`bench/arpo_iter.py` measures
   what that costs). ARPO's workers are Ray actors; its generation is batched the same way.
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
9. Left out: KL to a reference model (beta 0, as ARPO; `--beta` works with LoRA only), multi-GPU
   training (ARPO: FSDP over 8 GPUs; this script trains on one device). Logging: metrics.jsonl
   always, plus Weights & Biases (--wandb) and TensorBoard (--tensorboard) when asked for (progress.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from io import BytesIO

import numpy as np
import torch
from PIL import Image

import progress
import rundir
from actions import parse_action, smart_resize
from env import Task, TaskError, VMError, VMPool, load_tasks
from grpo import ReplayBuffer, group_advantages, trajectory_sample, update_policy
from chat import encode_chat, uitars_messages
from model import Generation, generate, load_policy, save_policy, sync_weights

# ------------------------------------------------------------------------------------------------
# Args


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    # desktops and tasks
    vms: str = arg("16", "number of local desktops to launch, or comma-separated URLs of running vm_server.py")
    token: str = arg("", "bearer token of remote VMs (default: $VM_TOKEN); local desktops make their own")
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
    min_pixels: int = arg(3136, "min pixels of a screenshot as the model sees it")
    max_new_tokens: int = arg(256, "tokens one answer may take (Thought + Action)")
    # rollout
    iterations: int = arg(100, "training iterations (each: one rollout of every group + one update)")
    max_steps: int = arg(15, "steps per episode at most (ARPO: 15); a task's own max_steps may lower it")
    max_images: int = arg(15, "screenshots kept in the prompt (ARPO: 15); older ones stay as text")
    temperature: float = arg(1.0, "sampling temperature in training; the update scores log-probs at it too (ARPO: 1.0)")
    top_p: float = arg(1.0, "nucleus sampling in training")
    stop_on_format_error: bool = arg(True, "an unparseable answer ends the episode, as in ARPO's code")
    settle: float = arg(0.5, "seconds the screen gets to settle after the actions (ARPO/OSWorld: 0.5)")
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
    eval_rollouts: int = arg(1, "rollouts per task in --eval-only")
    eval_temperature: float = arg(0.5, "sampling temperature of --eval-only (ARPO: 0.5)")
    eval_out: str = arg("", "where --eval-only writes its JSON (default: the run folder)")
    # run folder
    run_name: str = arg("", "run folder name under --runs-dir (default: a time stamp)")
    runs_dir: str = arg("runs", "where run folders go")
    resume: str = arg("", "a run folder to continue (flags given now override the saved ones)")
    ckpt_every: int = arg(1, "checkpoint every N iterations (and at the end)")
    save_trajectories: bool = arg(True, "write every episode's screenshots + steps into the run folder")
    seed: int = arg(0, "seed of task order, the update's shuffle, the replay buffer and the tiny model's weights")
    sample_seed: int = arg(-1, "seed of sampling answers (training and --eval-only); -1 = --seed")
    wandb: bool = arg(False, "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names the project)")
    tensorboard: bool = arg(False, "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)")


def one_sentence(msg: str):
    raise SystemExit(f"train_arpo.py: {msg}; see --help for the flags.")


def parse_args(argv=None) -> tuple[Args, dict]:
    """Args from the command line, plus the dict of flags actually given (they win over a resumed
    run's saved args). Booleans that default to True are switched off with --no-<name>."""
    def build(suppress: bool) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        for f in fields(Args):
            name = f.name.replace("_", "-")
            kw = {"help": f"{f.metadata['help']} (default: {f.default})", "dest": f.name,
                  "default": argparse.SUPPRESS if suppress else f.default}
            if f.type == "bool" and f.default:
                p.add_argument(f"--no-{name}", action="store_false", **kw)
            elif f.type == "bool":
                p.add_argument(f"--{name}", action="store_true", **kw)
            else:
                p.add_argument(f"--{name}", type={"int": int, "float": float}.get(f.type, str), **kw)
        p.error = one_sentence  # argparse's own error is a usage block and exit code 2
        return p
    args = Args(**vars(build(False).parse_args(argv)))
    return args, vars(build(True).parse_args(argv))


def check_args(args: Args) -> None:
    """Errors a user can cause, each as one sentence."""
    if args.group_size < 1:
        raise SystemExit("--group-size must be at least 1 (ARPO uses 8).")
    if args.engine not in ("hf", "vllm"):
        raise SystemExit("--engine must be hf or vllm.")
    if args.loss_agg not in ("seq-mean-token-mean", "token-mean"):
        raise SystemExit("--loss-agg must be seq-mean-token-mean or token-mean.")
    if args.beta != 0 and args.lora_rank == 0:
        raise SystemExit("--beta > 0 needs a reference policy: add --lora-rank 64 (the adapter-free model "
                         "is the reference), or keep --beta 0 as ARPO does.")
    if args.dual_clip != 0 and not args.dual_clip > 1:
        raise SystemExit("--dual-clip must be above 1 (ARPO uses 3.0), or 0 to switch it off.")
    if args.mini_batch < 0 or args.micro_batch < 1:
        raise SystemExit("--mini-batch must be 0 (ARPO's two steps per iteration) or more, and --micro-batch at least 1.")
    if min(args.max_steps, args.max_images, args.max_new_tokens, args.eval_rollouts, args.ckpt_every) < 1:
        raise SystemExit("--max-steps, --max-images, --max-new-tokens, --eval-rollouts and --ckpt-every "
                         "must be at least 1.")
    if args.lr_schedule not in ("constant", "linear", "cosine"):
        raise SystemExit("--lr-schedule must be constant, linear or cosine.")
    if args.lr_warmup < 0 or args.epochs < 1:
        raise SystemExit("--lr-warmup must be 0 or more and --epochs at least 1.")


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


def to_record(ep: Episode) -> dict:
    """A plain dict for the replay buffer and checkpoints: screenshots as PNG bytes (~10x smaller than
    pixels), the task as a dict, so unpickling never needs this module's classes."""
    def png(img):
        if isinstance(img, bytes):
            return img
        buf = BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    d = {f.name: getattr(ep, f.name) for f in fields(Episode)}
    return {**d, "task": asdict(ep.task), "screenshots": [png(s) for s in ep.screenshots]}


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


def model_policy(policy, args: Args, temperature: float):
    """The default policy_fn: one batched generate over all observations -> Generations."""
    def policy_fn(observations: list[Observation]) -> list[Generation]:
        return generate(policy, [o.messages for o in observations], max_new_tokens=args.max_new_tokens,
                        temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0)
    return policy_fn


@contextmanager
def timed(times: dict, key: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Desktops: reset, setup, rollout, score


def reset_vms(pool: VMPool) -> list[int]:
    """Reset every VM (dead local desktops are restarted); the indices of those that answered."""
    return [i for i, r in enumerate(pool.reset()) if r.ok]


def setup_vms(pool: VMPool, vm_tasks: list, timeout: float) -> tuple[list, dict]:
    """Run each VM's task setup in parallel. A VM whose setup fails gets no task this time."""
    res = pool.setup([t.setup if t is not None else None for t in vm_tasks], timeout=timeout)
    errors = {i: r.error for i, r in enumerate(res) if vm_tasks[i] is not None and not r.ok}
    return [None if i in errors else t for i, t in enumerate(vm_tasks)], errors


def _drop(ep: Episode, why: str) -> None:
    ep.end, ep.error = "dropped", why


def rollout(pool: VMPool, vm_tasks: list, policy_fn, args: Args, times: dict,
            groups: dict | None = None, iteration: int = 0) -> list:
    """Play vm_tasks[i] on VM i (None: idle), all VMs in lockstep, to the end of every episode.

    Each step: screenshots of the unfinished VMs -> ONE policy_fn call for all of them -> parse
    (UI-TARS style, coordinates mapped from the image the model saw to the screen) -> act. policy_fn
    returns model.Generations (their sampled token ids are kept verbatim for training) or plain
    texts. Returns one Episode per VM (None where idle); a VM that fails is `dropped`.
    """
    groups = groups or {}
    eps = [Episode(t, i, groups.get(i, 0), iteration) if t is not None else None for i, t in enumerate(vm_tasks)]
    pb = progress.bar(args.max_steps, "rollout")  # lockstep steps of the longest episode
    while True:
        # Lockstep: every step waits for the slowest VM and for the one generate call. Finished
        # VMs sit out (a None argument sends them nothing) instead of padding the batch.
        active = [i for i, e in enumerate(eps) if e is not None and e.end is None]
        if not active:
            pb.close()
            return eps
        with timed(times, "env"):
            shots = pool.map("screenshot", ["png" if i in active else None for i in range(pool.size)])
        obs, who = [], []
        for i in active:
            e = eps[i]
            if not shots[i].ok:
                _drop(e, shots[i].error)
                continue
            img = shots[i].value
            e.screenshots.append(img)
            # The size the processor resizes this screenshot to: UI-TARS answers in those pixels.
            h, w = smart_resize(img.height, img.width, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
            # The history: earlier answers as the sampled ids themselves, so this prompt and the
            # training sequence built from the same episode later hold the very same tokens.
            msgs = uitars_messages(e.task.instruction, e.screenshots, e.assistant, max_images=args.max_images)
            obs.append(Observation(e.task, i, len(e.assistant), msgs, img.size, (w, h)))
            who.append(i)
        if not obs:
            continue
        with timed(times, "generation"):
            outs = policy_fn(obs)
        actions = [None] * pool.size
        for i, o, out in zip(who, obs, outs):
            e = eps[i]
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
                actions[i] = parsed.action
        with timed(times, "env"):
            res = pool.act(actions) if any(a is not None for a in actions) else []
            if res and args.settle > 0:
                time.sleep(args.settle)  # a window takes a moment to map; the model should see it
        for i, r in enumerate(res):
            if actions[i] is None or r.ok:
                continue
            if not pool.alive[i]:
                _drop(eps[i], r.error)  # the VM stopped answering: its trajectory is lost
            else:
                # The VM refused the action (a key it does not know, say): the model's answer was
                # not a valid action after all, so it counts as a format failure.
                eps[i].format_ok[-1] = False
                eps[i].actions[-1] = {**eps[i].actions[-1], "refused": r.error}
                eps[i].end = "format" if args.stop_on_format_error else None
        for i in who:
            e = eps[i]
            if e.end is None and len(e.assistant) >= min(args.max_steps, e.task.max_steps):
                e.end = "max_steps"
        pb.update(1)


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


def score_episodes(pool: VMPool, eps: list, args: Args, timeout: float) -> None:
    """Fill score (hard), score_standard and reward of every finished episode, in place.

    Feasible tasks: the evaluator's checks on the VM (in parallel), overruled by a last FAIL.
    Infeasible tasks, client side: 1 iff the last action is `fail` (call_user()). Under the
    standard protocol an episode that ran out of steps counts its last action as FAIL
    (outcome_scores has the whole rule).
    """
    # All VMs are evaluated at once after the last episode ended; a finished VM's screen no longer
    # changes, so this scores the same as ARPO's evaluate-as-soon-as-done, in one round trip.
    evaluators = [e.task.evaluator if e is not None and e.end != "dropped" and not e.task.infeasible else None
                  for e in eps]
    res = pool.evaluate(evaluators, timeout=timeout) if any(evaluators) else [None] * len(eps)
    for i, e in enumerate(eps):
        if e is None or e.end == "dropped":
            continue
        if e.task.infeasible:
            e.score, e.score_standard = outcome_scores(True, e.actions, e.end)  # ALGO: OSWorld's infeasible rule
        elif res[i].ok and isinstance(res[i].value, dict) and "score" in res[i].value:
            # ALGO: execution-based score
            e.score, e.score_standard = outcome_scores(False, e.actions, e.end, res[i].value["score"])
        else:
            # No score is not a score of 0: training on it would punish the policy for a VM fault.
            _drop(e, res[i].error or "the VM's /evaluate answered without a score")
            continue
        # ALGO: ARPO's trajectory reward: the task score, minus the format penalty once if any answer
        # did not parse (its code: eval_result + 0.5 * format_reward, format_reward = -1).
        e.reward = e.score - args.format_penalty * (not all(e.format_ok))


def run_jobs(pool: VMPool, jobs: list, policy_fn, args: Args, times: dict) -> tuple[list, int]:
    """Play a list of tasks (repeats allowed) in waves of as many VMs as are alive: reset, setup,
    rollout, score. An episode lost to a failing VM is played once more. Returns (episodes, lost)."""
    queue, done, lost = [(t, 0) for t in jobs], [], 0
    pb = progress.bar(len(jobs), "episodes")
    while queue:
        with timed(times, "reset"):
            live = reset_vms(pool)
        if not live:
            raise SystemExit("No VM answered after a reset; check that the desktops run (see --vms).")
        wave, queue = queue[:len(live)], queue[len(live):]
        vm_tasks, tries = [None] * pool.size, {}
        for i, (t, n) in zip(live, wave):
            vm_tasks[i], tries[i] = t, n
        with timed(times, "reset"):
            vm_tasks, errors = setup_vms(pool, vm_tasks, args.vm_timeout)
        eps = rollout(pool, vm_tasks, policy_fn, args, times)
        with timed(times, "evaluate"):
            score_episodes(pool, eps, args, args.vm_timeout)
        failed = [(t, tries[i]) for i, t in zip(live, [w[0] for w in wave]) if i in errors]
        failed += [(e.task, tries[e.vm]) for e in eps if e is not None and e.end == "dropped"]
        done += [e for e in eps if e is not None and e.end != "dropped"]
        queue += [(t, n + 1) for t, n in failed if n < 1]
        lost += sum(n >= 1 for _, n in failed)
        pb.update(len(wave) - sum(n < 1 for _, n in failed))  # re-queued jobs are not finished yet
    pb.close()
    return done, lost


# ------------------------------------------------------------------------------------------------
# Task selection and evaluation


def select_tasks(pool: VMPool, tasks: list, k: int, policy_fn, args: Args) -> tuple[list, dict]:
    """ARPO's task selection: k rollouts per task with the starting policy; keep the tasks solved
    (score > success threshold) at least once. Returns (kept tasks, {task id: successes})."""
    eps, _ = run_jobs(pool, [t for t in tasks for _ in range(k)], policy_fn, args, {})
    counts = {t.id: 0 for t in tasks}
    for e in eps:
        counts[e.task.id] += e.score > args.success_threshold  # ALGO: "solved at least once"
    return [t for t in tasks if counts[t.id] > 0], counts


def evaluate_policy(pool: VMPool, tasks: list, policy_fn, args: Args, save_to: str | None = None) -> dict:
    """Success rate (mean score, as OSWorld reports it) per task and overall, under both protocols,
    and per episode what it did (details: every step's action, whether it parsed, the answer text).
    save_to: a folder that gets the episodes as a run's trajectories (view.py reads it), one
    "iteration" per task in the order given, one "vm" per rollout of it."""
    times = {}
    t0 = time.perf_counter()
    eps, lost = run_jobs(pool, [t for t in tasks for _ in range(args.eval_rollouts)], policy_fn, args, times)
    out = {"episodes": len(eps), "lost": lost, "rollouts_per_task": args.eval_rollouts,
           "temperature": args.eval_temperature, "seconds": time.perf_counter() - t0}
    for proto, key in (("standard", "score_standard"), ("hard", "score")):
        per_task = {}
        for t in tasks:
            s = [getattr(e, key) for e in eps if e.task.id == t.id]
            per_task[t.id] = sum(s) / len(s) if s else None
        all_s = [getattr(e, key) for e in eps]
        out[proto] = {"overall": sum(all_s) / len(all_s) if all_s else None, "per_task": per_task}
    out["details"] = [{"task": e.task.id, "vm": e.vm, "end": e.end, "steps": len(e.actions),
                       "score_standard": e.score_standard, "score_hard": e.score, "actions": e.actions,
                       "format_ok": e.format_ok, "texts": e.texts} for e in eps]
    steps = [ok for e in eps for ok in e.format_ok]
    out["format_rate"] = sum(steps) / len(steps) if steps else None  # share of answers that parsed
    if save_to:
        for k, t in enumerate(tasks):
            save_episodes(save_to, k, [replace(e, vm=n) for n, e in enumerate(x for x in eps if x.task.id == t.id)])
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


def plan_groups(live: list[int], group_size: int) -> list[list[int]]:
    """Live VMs -> groups of group_size (leftovers idle). Fewer live VMs than a group: one group."""
    n = len(live) // group_size
    if n == 0:  # a smaller group still gives GRPO a baseline; a lone VM gets replay or nothing
        return [live] if live else []
    return [live[g * group_size:(g + 1) * group_size] for g in range(n)]


def lr_at(it: int, args: Args) -> float:
    """The learning rate of iteration `it` (0-based): a linear warm-up over the first --lr-warmup
    iterations (lr * (it + 1) / warmup), then --lr-schedule over the rest, towards 0 at --iterations
    (never 0 itself: the last iteration still learns). A function of the iteration alone, so a
    resumed run continues the schedule where it stopped. ARPO keeps lr constant without warm-up;
    a small model trained from scratch at a high lr needs the decay to keep what it learned (at a
    constant lr 1e-3 the tiny model can learn a task to 0.92 and lose it in the last iterations)."""
    w = args.lr_warmup
    if it < w:
        return args.lr * (it + 1) / w
    if args.lr_schedule == "constant":
        return args.lr
    frac = (it - w) / max(1, args.iterations - w)  # 0 at the first iteration after the warm-up, < 1 at the last
    if args.lr_schedule == "linear":
        return args.lr * (1 - frac)
    return args.lr * 0.5 * (1 + math.cos(math.pi * frac))  # cosine


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


def apply_replay(buffer: ReplayBuffer, members: list[Episode], group: int) -> tuple[list, dict | None]:
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
        "task": ep.task.id, "group": group, "replaced_vm": members[k].vm, "from_iteration": ep.iteration,
        "from_vm": ep.vm, "score": ep.score, "reward": ep.reward}


def replay_groups(buffer: ReplayBuffer | None, fresh: list[Episode], task_ids: list[str]):
    """Per group: replay (if on) and its stats. Returns (update batch, injections, group stats)."""
    batch, injections, stats = [], [], []
    for g, tid in enumerate(task_ids):
        members = [e for e in fresh if e.group == g]
        if not members:
            continue  # every VM of this group failed: nothing to learn from it
        if buffer is not None:
            members, inj = apply_replay(buffer, members, g)
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


def iteration_metrics(it, task_ids, eps, fresh, batch, pieces, adv, upd, times, args: Args) -> dict:
    """One metrics.jsonl line: rewards, success, format, the update's numbers, the time split."""
    def mean(xs):
        return float(np.mean(xs)) if len(xs) else 0.0
    vm_time = times["reset"] + times["env"] + times["evaluate"]
    return {
        "iteration": it, "tasks": task_ids, "episodes": len(fresh),
        "dropped": len([e for e in eps if e is not None and e.end == "dropped"]),
        "reward_mean": mean([e.reward for e in fresh]),
        "reward_std": float(np.std([e.reward for e in fresh])) if fresh else 0.0,
        "score_mean": mean([e.score for e in fresh]),
        "success_rate": mean([e.score > args.success_threshold for e in fresh]),
        "format_rate": mean([ok for e in fresh for ok in e.format_ok]),  # share of steps that parsed
        "steps_mean": mean([len(e.actions) for e in fresh]),
        "batch": [{"task": e.task.id, "group": e.group, "vm": e.vm, "replayed": e.replayed,
                   "from_iteration": e.iteration, "reward": e.reward, "advantage": a,
                   "target_tokens": int(sum(sum(p.target_mask) for p in ps)), "steps": len(e.actions),
                   "sequences": len(ps)}
                  for e, a, ps in zip(batch, adv, pieces)],
        **{k: upd.get(k, 0.0) for k in ("loss", "pg_loss", "kl", "clip_low", "clip_high", "clip_dual",
                                        "ratio_mean", "grad_norm", "tokens", "steps")},
        # trainer vs sampler log-probs of this iteration's sampled tokens (0 on the HF path; vLLM
        # numerics show here), over the micro-batches whose sequences all carry the sampler's numbers
        **({"logp_gap": upd["logp_gap"]} if "logp_gap" in upd else {}),
        **{f"time_{k}": v for k, v in times.items()},
        "vm_wait_share": vm_time / times["total"] if times["total"] else 0.0}


def run_iteration(tr: Trainer, it: int, pick) -> tuple[dict, list[Episode]]:
    """One ARPO iteration; pick(n) -> n task ids. Returns (metrics, this iteration's episodes)."""
    args, pool = tr.args, tr.pool
    times = dict.fromkeys(("reset", "generation", "env", "evaluate", "update"), 0.0)
    t0 = time.perf_counter()
    lr = lr_at(it, args)
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    # -- reset, pick one task per group, setup
    with timed(times, "reset"):
        live = reset_vms(pool)
        groups = plan_groups(live, args.group_size)
        if not groups:
            raise SystemExit("No VM answered after a reset; check that the desktops run (see --vms).")
        task_ids = pick(len(groups))
        by_id = {t.id: t for t in tr.tasks}
        vm_tasks, vm_group = [None] * pool.size, {}
        for g, (vms, tid) in enumerate(zip(groups, task_ids)):
            for i in vms:
                vm_tasks[i], vm_group[i] = by_id[tid], g
        vm_tasks, setup_errors = setup_vms(pool, vm_tasks, args.vm_timeout)
    # -- rollout + score
    eps = rollout(pool, vm_tasks, tr.policy_fn, args, times, vm_group, it)
    with timed(times, "evaluate"):
        score_episodes(pool, eps, args, args.vm_timeout)
    fresh = [e for e in eps if e is not None and e.end != "dropped"]
    # -- ALGO: replay into all-failed groups, THEN store this iteration's successes
    batch, injections, group_stats = replay_groups(tr.replay, fresh, task_ids)
    if tr.replay is not None:
        for e in fresh:
            if e.score > tr.replay.success_threshold:  # ALGO: success = score > 0.1; PNG-encode only those
                tr.replay.add(e.task.id, to_record(e), e.score)
    # -- ALGO: advantages per group of trajectories, broadcast to every assistant token; the GRPO
    # update in ARPO's schedule (two shuffled mini-batches by default, dual clip, scored at the
    # sampling temperature)
    upd = {}
    with timed(times, "update"):
        adv = group_advantages([e.reward for e in batch], [e.group for e in batch]).tolist()  # (N,)
        pieces = [episode_samples(tr.policy, e, args, a) for e, a in zip(batch, adv)]
        samples = [p for ps in pieces for p in ps]
        if samples:
            mini = args.mini_batch or math.ceil(len(samples) / 2)  # ALGO: ARPO: 2 steps per batch
            with progress.bar(len(samples) * args.epochs, "update") as pb:
                upd = update_policy(tr.policy, tr.optimizer, samples, micro_batch_size=args.micro_batch,
                                    eps_low=args.eps_low, eps_high=args.eps_high, beta=args.beta,
                                    max_grad_norm=args.max_grad_norm, agg=args.loss_agg, mini_batch_size=mini,
                                    epochs=args.epochs, on_micro_batch=pb.update, temperature=args.temperature,
                                    dual_clip=args.dual_clip or None,
                                    shuffle=random.Random(f"{args.seed}-update-{it}"))  # the same on a resume
            sync_weights(tr.policy)  # vLLM generates with the new weights from the next step on
    times["total"] = time.perf_counter() - t0
    m = iteration_metrics(it, task_ids, eps, fresh, batch, pieces, adv, upd, times, args)
    m.update(lr=lr, groups=group_stats, replay_injections=injections, n_injections=len(injections),
             replay_size=len(tr.replay) if tr.replay is not None else 0,
             zero_std_groups=flat_groups([e.group for e in batch], adv))
    m["dropped"] += len(setup_errors)
    if setup_errors:
        m["setup_errors"] = {str(k): v for k, v in setup_errors.items()}
    return m, eps


def save_episodes(run: str, it: int, eps: list) -> None:
    """Each VM's episode: every step's screenshot, thought, action, then a final line with the score."""
    # An iteration redone after a kill (its trajectories were saved, its checkpoint was not) must not
    # leave the killed attempt's files beside the new ones (a VM that dropped out this time, say).
    shutil.rmtree(os.path.join(run, "trajectories", f"it{it:06d}"), ignore_errors=True)
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
        rundir.save_trajectory(run, it, e.vm, steps, list(e.screenshots) + [None])


def summary_line(m: dict) -> str:
    return (f"it {m['iteration']:4d} | tasks {','.join(m['tasks'])[:40]:40s} | reward {m['reward_mean']:+.2f}"
            f"±{m['reward_std']:.2f} | success {m['success_rate']:.2f} | format {m['format_rate']:.2f} | "
            f"replay +{m['n_injections']}{''.join(' ' + i['task'] for i in m['replay_injections'])} "
            f"({m['replay_size']} stored) | flat groups {m['zero_std_groups']}/{len(m['groups'])} | kl {m['kl']:.4f} clip "
            f"{m['clip_low']:.2f}/{m['clip_high']:.2f}/{m['clip_dual']:.2f} ({m['steps']:.0f} steps) | "
            f"{m['time_total']:.1f}s (reset {m['time_reset']:.1f} "
            f"gen {m['time_generation']:.1f} env {m['time_env']:.1f} eval {m['time_evaluate']:.1f} "
            f"upd {m['time_update']:.1f}; VM wait {100 * m['vm_wait_share']:.0f}%)")


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
    """The starting policy, or the one a checkpoint holds (full FT: its saved folder; LoRA: the base
    model plus the saved adapter weights)."""
    kw = dict(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed,
              gradient_checkpointing=args.gradient_checkpointing, min_pixels=args.min_pixels,
              max_pixels=args.max_pixels)
    if ckpt is not None and args.lora_rank == 0:
        policy = load_policy(os.path.join(ckpt[1], "policy"), **kw)
    else:
        policy = load_policy(args.model, **kw)
        if ckpt is not None:  # the adapter; strict=False because the frozen base is not in it
            try:
                bad = policy.model.load_state_dict(ckpt[0]["trainable"], strict=False).unexpected_keys
            except RuntimeError as e:  # shape mismatch: another rank
                bad = [str(e).strip().splitlines()[-1].strip()]
            if bad:
                raise SystemExit(f"the checkpoint's adapter does not fit this model ({bad[0][:150]}); "
                                 "resume with the --model and --lora-rank the run was started with.")
    if args.engine == "vllm":
        from vllm_engine import VLLMEngine, needed_model_len
        import tempfile  # vLLM loads weights from disk: the starting ones, or a fresh copy of ours
        fresh_copy = os.path.join(tempfile.mkdtemp(prefix="arpo-vllm-"), "w")
        path = args.model if os.path.isdir(args.model) and ckpt is None else fresh_copy
        try:  # the longest prompt of this run: --max-images screenshots, every answer of an episode
            length = needed_model_len(args.max_images, args.max_pixels, args.max_steps * (args.max_new_tokens + 6),
                                      limit=policy.model.config.text_config.max_position_embeddings)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        policy.engine = VLLMEngine(policy, path, max_model_len=length, max_images=args.max_images)
    return policy


def checkpoint(tr: Trainer, it: int, picker: dict, train_ids: list[str], metrics: dict | None = None) -> None:
    """Everything a resume needs, written atomically (rundir): `it` is the next iteration to run.
    `metrics`: the line of iteration it - 1, which a kill before its log_metrics would lose."""
    policy, args = tr.policy, tr.args
    state = {"iteration": it, "args": asdict(args), "optimizer": tr.optimizer.state_dict(),
             "replay": tr.replay.state_dict() if tr.replay is not None else None,
             "picker": dict(picker), "tasks": train_ids, "rng": rundir.rng_state(),
             # LoRA: the adapter (the only trained weights) goes into state.pt; full FT: policy/.
             "trainable": {n: p.detach().cpu() for n, p in policy.model.named_parameters()
                           if p.requires_grad} if policy.lora else None}
    write = None if policy.lora else (lambda folder: save_policy(policy, os.path.join(folder, "policy")))
    rundir.save_checkpoint(tr.run, state, write, metrics=metrics)


# ------------------------------------------------------------------------------------------------
# Main: setup, then the loop


def resolve_args(argv=None) -> tuple[Args, tuple | None, dict]:
    """The command line; on --resume, the run's saved args with the flags given now on top.
    Returns (args, (checkpoint state, folder) or None, the flags given now)."""
    args, given = parse_args(argv)
    ckpt = None
    if args.resume:
        ckpt = rundir.load_checkpoint(args.resume) if os.path.isdir(args.resume) else None
        if ckpt is None and (args.eval_only or not os.path.isdir(args.resume)):
            raise SystemExit(f"--resume {args.resume}: no checkpoint there; pass a run folder under {args.runs_dir}/.")
        saved = ckpt[0]["args"] if ckpt is not None else None
        if saved is None and os.path.exists(os.path.join(args.resume, "args.json")):
            with open(os.path.join(args.resume, "args.json")) as f:  # killed before its first checkpoint
                saved = json.load(f)
        # A train_explore.py run has args (vms, model, ...) too, but no tasks, picker or replay buffer.
        if (saved is not None and "group_size" not in saved) or (ckpt is not None and "picker" not in ckpt[0]):
            raise SystemExit(f"--resume {args.resume}: that is not a train_arpo.py run (train_explore.py's?); "
                             "resume it with the script that wrote it.")
        if saved is not None:
            args = Args(**{**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__}, **given})
    check_args(args)
    return args, ckpt, given


def start_vms(args: Args) -> VMPool:
    """The VMs, of which at least one answers /health (else one sentence, before any work is done)."""
    try:
        w, h = (int(v) for v in args.screen.lower().split("x"))
        pool = VMPool(args.vms, token=args.token or os.environ.get("VM_TOKEN") or None,
                      timeout=args.vm_timeout, screen=(w, h))
    except (ValueError, VMError) as e:
        raise SystemExit(f"cannot start the VMs ({e}); check --vms and --screen.")
    health = pool.map("health", timeout=min(10.0, args.vm_timeout))
    if not any(r.ok for r in health):
        pool.close()
        raise SystemExit(f"None of the {pool.size} VM(s) answered /health ({str(health[0].error).rstrip('.')}); "
                         "check --vms and --token.")
    return pool


def eval_only(pool: VMPool, tasks: list, policy, args: Args, run: str, iteration: int) -> None:
    """--eval-only: eval_it<N>.json (or --eval-out) and the episodes beside it in eval_it<N>/
    (`python view.py runs/<name>/eval_it<N>` shows what was clicked)."""
    out = args.eval_out or os.path.join(run, f"eval_it{iteration:06d}.json")
    root, ext = os.path.splitext(out)
    folder = root if ext else out + "_episodes"  # never the JSON's own path
    shutil.rmtree(folder, ignore_errors=True)  # a second eval of the same checkpoint replaces the first
    result = evaluate_policy(pool, tasks, model_policy(policy, args, args.eval_temperature), args,
                             save_to=folder if args.save_trajectories else None)
    result.update(model=args.model, run=run, iteration=iteration, protocols={
        "standard": "an episode that runs out of steps counts its last action as FAIL (OSWorld)",
        "hard": "the last action is what the agent did (OSWorld-Hard in ARPO)"})
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(eval_table(result))
    print(f"eval written to {out}")


def seed_all(args: Args) -> None:
    """Sampling draws from torch's generator, seeded by --sample-seed; task order (pick_tasks), the
    replay buffer and the tiny model's weights have Randoms of their own seeded by --seed. So an
    eval can take fresh samples of a checkpoint, and two runs can share a task order and differ
    in their samples, or the other way round."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed if args.sample_seed < 0 else args.sample_seed)


def main(argv=None) -> None:
    # -- setup (plumbing): args, seeds, run folder, tasks, policy, desktops
    args, ckpt, given = resolve_args(argv)
    try:  # one summary line per iteration; transformers' load/save progress bars are noise here
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    seed_all(args)
    # A resumed run trains on the task list it trained on (after --select-tasks), unless told otherwise.
    # The tasks before the run folder: a bad --tasks or --task-ids leaves nothing behind.
    resumed_ids = ckpt[0]["tasks"] if ckpt is not None and not args.eval_only and "task_ids" not in given else None
    tasks = load_task_list(args, resumed_ids)
    # Then the run folder: a name clash should fail before minutes of loading, not after.
    new_run = None  # a folder made just now: removed again if the policy or the VMs fail to start
    if args.eval_only and args.resume:
        run = args.resume  # evaluating a run: its args.json stays the training args
    else:
        name = args.run_name or time.strftime("%Y%m%d-%H%M%S")
        if not args.resume and not os.path.exists(os.path.join(args.runs_dir, name)):
            new_run = os.path.join(args.runs_dir, name)
        run = rundir.make_run_dir(args.runs_dir, name, args, resume=args.resume or None)
    try:
        policy = make_policy(args, ckpt)
        pool = start_vms(args)
    except BaseException:  # a bad --model or --vms: one sentence, and no half-made run folder
        if new_run:
            shutil.rmtree(new_run, ignore_errors=True)
        raise
    try:
        if args.eval_only:
            return eval_only(pool, tasks, policy, args, run, ckpt[0]["iteration"] if ckpt else 0)
        params = [p for p in policy.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)  # ARPO: AdamW, wd 0.01
        replay = ReplayBuffer(args.replay_capacity, args.success_threshold, seed=args.seed) if args.replay else None
        picker, start = {"epoch": 0, "pos": 0}, 0
        if ckpt is not None:
            state = ckpt[0]
            optimizer.load_state_dict(state["optimizer"])
            if replay is not None and state["replay"] is not None:
                replay.load_state_dict(state["replay"])  # ARPO's own code starts it empty again
            picker, start = dict(state["picker"]), state["iteration"]
            rundir.set_rng_state(state["rng"])
            rundir.trim_metrics(run, start)
            print(f"resumed {run} at iteration {start} ({len(replay or [])} stored successes)")
        elif args.select_tasks > 0:
            tasks = select_and_record(pool, tasks, model_policy(policy, args, args.temperature), args, run)
        tr = Trainer(args, pool, policy, optimizer, replay, model_policy(policy, args, args.temperature), run, tasks)
        ids = [t.id for t in tasks]

        # -- the loop: one iteration, then trajectories, checkpoint, metrics line, console line
        trackers = progress.open_trackers(run, rundir.public_args(args), wandb=args.wandb, tensorboard=args.tensorboard)
        for it in progress.track(range(start, args.iterations), "iterations"):
            m, eps = run_iteration(tr, it, lambda n: pick_tasks(ids, picker, n, args.seed))
            t0 = time.perf_counter()
            if args.save_trajectories:
                save_episodes(run, it, eps)
            if (it + 1) % args.ckpt_every == 0 or it + 1 == args.iterations:
                checkpoint(tr, it + 1, picker, ids, m)
            m["time_save"] = time.perf_counter() - t0
            rundir.log_metrics(run, m)  # after the checkpoint: a resume never logs an iteration twice
            progress.log(trackers, m, step=it)
            progress.say(summary_line(m))
        progress.close(trackers)
    finally:
        pool.close()


def select_and_record(pool: VMPool, tasks: list, policy_fn, args: Args, run: str) -> list:
    """--select-tasks K: run the selection with the starting policy, write selected_tasks.json."""
    path = os.path.join(run, "selected_tasks.json")
    if os.path.exists(path):  # killed after selecting, before the first checkpoint: reuse it
        with open(path) as f:
            keep = json.load(f)["selected"]
        kept = [t for t in tasks if t.id in keep]
    else:
        print(f"task selection: {args.select_tasks} rollouts of each of {len(tasks)} tasks ...", flush=True)
        kept, counts = select_tasks(pool, tasks, args.select_tasks, policy_fn, args)
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
