"""ScreenExplorer: teach a vision-language model to explore real desktops, with no task at all (arXiv 2505.19095).

    python train_explore.py --vms 8                                  # 8 local Xvfb desktops, Qwen2.5-VL-3B
    python train_explore.py --vms http://10.0.0.5:8000,http://10.0.0.6:8000 --token T
    python train_explore.py --vms 2 --model tiny-explore --iterations 3 --steps 3 --update-actor-delay 0   # CPU
    python train_explore.py --vms 8 --generations 3 --iterations-per-generation 100   # E1, E2, E3
    python train_explore.py --resume runs/<name>                     # continue a run
    python train_explore.py --eval-only --model runs/<name>/models/E1 --episodes 20   # vs random actions

One iteration (`iteration`, which `main`'s loop `train` calls): --steps steps on every live desktop,
each an `episode` on its own (screenshot -> the exploration prompt -> the policy's answer, one
batched generate for whatever is waiting (rollout.play) -> {"intent", "action"} parsed -> the
action, and the screen once it settled) -> the format-valid steps' screen features (and OCR text) ->
`predict_and_learn`: the world model's guesses (curiosity), then it learns the buffer ->
`step_rewards`: every reward term that is on (rewards.py) -> advantages over the whole buffer, ONE
group -> `update` (after --update-actor-delay iterations) -> the iteration's best steps kept for
distillation -> log, checkpoint. Between generations (--generations G) the next starts again from
the BASE model fine-tuned on every distilled step so far (`start_generation`). The file reads in
that order; after `main` come what the loop calls by name: the flags (`Args`, with the paper's
defaults: LoRA r 64, lr 4e-5, KL 0.04, clip 0.2 / 0.28, one optimizer step per 16 steps, the actor
from iteration 5), their checks, setup, the distillation data's plumbing, the eval (--eval-only).
(--model tiny-explore is the tiny model taught the answer format, models/: its answers parse,
so a CPU run's rewards are real; --model tiny, random weights, tests the plumbing only.)

Where this departs from the paper and its release (niuzaisheng/ScreenExplorer):
1. Rewards, features and the world model are rewards.py's (its docstring says where and why); the
   release's two bugs are not here (the world model's image branch learns; --rewards
   all,no_world_model still trains the actor); curiosity is scored before the world model learns
   the buffer (--wm-train-first: the release's order).
2. No guided (JSON-schema) decoding, no repetition penalty: a malformed answer is a format failure
   (reward 0, nothing executed), itself a learning signal, and the loss scores what was sampled.
3. The actor updates from iteration --update-actor-delay (0-based; the release: after it), one
   optimizer step per --mini-batch samples (the release: gradient accumulation 16 of batch 1);
   --no-scale-rewards gives Dr. GRPO's advantages; --lr-warmup, --lr-schedule are off by default.
4. A desktop that fails drops out of the iteration without the step it failed in; the release threw
   the whole iteration away. No lockstep (rollout.py); the screen settles by the server's watch
   (--settle watch) instead of the release's fixed 1 s sleep (--settle 1).
5. Distillation: the paper publishes no SFT recipe; ours is --distill-epochs passes of token-mean
   NLL on the sampled answers, LoRA merged after SFT; the best steps are ranked within each
   iteration (top_steps says why). The eval's measures are ours (rewards.py). torchrun: each rank
   plays its slice of the desktops; the one group and the world model span every rank (docs/gpu.md).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import transformers
from PIL import Image

import grpo
import rewards as R
import rollout
from actions import MAX_PIXELS, MIN_PIXELS, Action, Parsed, cursor_after, parse_action
from env import SETTLE_HELP, VMError, VMPool, app_of, parse_settle
from model import Answer, encode_chat, explore_messages, generate, load_policy, sync_weights
from ocr import load_text_tools
from plumbing import ckpt, dist, logs, progress, rundir
from plumbing.rundir import arg
from vm.limits import parse as parse_limits

PROG = "train_explore.py"


# -----------------------------------------------------------------------------------------------
# The episode: --steps steps on one desktop, a generator rollout.play steps in the desktop's thread


@dataclass
class Step:
    """One step of one desktop: what the model saw, said and did, and what came of it."""
    vm: int  # the desktop (numbered among all ranks')
    step: int  # its index in the episode
    before: Image.Image  # the screenshot the model saw (screen pixels)
    after: Image.Image  # the screen once it settled after the action (--settle)
    text: str  # the model's answer (or the random baseline's action string)
    parsed: Parsed | None  # the answer's intent (.thought) and action; None: it did not parse, nothing ran
    answer: object = None  # model.Answer (prompt + sampled ids), None for a stand-in policy
    error: str | None = None  # the VM refused the action (4xx): a format failure too, nothing ran
    windows_before: dict | None = None  # {X window id: title} open before the step (when asked for)
    windows_after: dict | None = None  # ... and after it
    opened: list | None = None  # the app of each window the step opened (env.app_of; "other": no app)

    @property
    def format_ok(self) -> bool:
        """The answer parsed into an action the VM took: the format reward."""
        return self.parsed is not None and self.error is None


@dataclass
class Observation:
    """What a policy gets of one desktop at one step: the screen, and where the mouse is (DragTo
    drags from there)."""
    vm: int
    step: int
    image: Image.Image
    cursor: tuple


def episode(desk: rollout.Desktop, steps: int, settle, reset: bool, windows: bool = False, reset_ahead: bool = False):
    """One desktop's episode, top to bottom: the screen -> the policy's answer (`answer = yield
    observation`, batched with other desktops' by rollout.play) -> parsed -> the action, the settled
    screen back -> a Step, `steps` times.
    -> its Steps. A malformed answer executes nothing (the screen is looked at again); a refused
    action (4xx) is a format failure too; any other VM failure ends the episode without the step
    it happened in (EnvFailure with the steps so far): the environment failed, not the model.
    `windows`: record the window list before and after every step (one GET /windows a step), and
    which app each window the step opened belongs to (the desktop's 7 apps by WM_CLASS, env.app_of).
    `reset_ahead`: the desktop's next episode begins with a reset; start it now, in the background."""
    out: list[Step] = []
    try:
        if reset:
            desk.reset()
        before = desk.screenshot()
        listed = desk.windows() if windows else None
        open_before = {w["id"]: w["title"] for w in listed} if windows else None
        # The mouse, for DragTo: /reset leaves it at the centre (training resets every --reset-every
        # iterations, the eval before each episode; between resets this is an approximation).
        cursor = (before.width // 2, before.height // 2)
        for t in range(steps):
            text, parsed, answer = parse_answer((yield Observation(desk.id, t, before, cursor)), before.size, cursor)
            error = None
            try:
                after = desk.act(parsed.action, settle) if parsed else desk.screenshot()
            except VMError as e:
                if not e.refused:
                    raise
                error, after = str(e), desk.screenshot()  # the VM refused the action (bad key name, ...)
            listed, seen = (desk.windows(), open_before) if windows else (None, None)
            open_after = {w["id"]: w["title"] for w in listed} if windows else None
            opened = [app_of(w) or "other" for w in listed if w["id"] not in seen] if windows else None
            # The step is kept even when malformed: its reward is 0, usually below the buffer's mean,
            # so a negative advantage, which is how GRPO teaches the format.
            out.append(Step(desk.id, t, before, after, text, parsed, answer, error, open_before, open_after, opened))
            if error is None:
                cursor = cursor_after(parsed.action if parsed else None, cursor)
            before, open_before = after, open_after  # the after-screen is the next step's before-screen
        if reset_ahead:
            desk.reset_ahead()
    except VMError as err:
        raise rollout.EnvFailure(str(err), partial=out) from None
    return out


def parse_answer(answer, screen: tuple, cursor: tuple) -> tuple:
    """-> (text, Parsed or None, Answer or None). The model's answer (an Answer) is parsed in
    the resized image it saw, its coordinates mapped to the screen; a stand-in's text (the random
    baseline, a test's script) is in screen pixels. None: a format failure."""
    if isinstance(answer, Answer):
        return answer.text, parse_action(answer.text, "explore", screen, answer.prompt.image_sizes[0], cursor=cursor), answer
    return str(answer), parse_action(str(answer), "explore", screen, None, cursor=cursor), None


def play_steps(pool: VMPool, vms: set, policy_fn, steps: int, settle, reset: bool, reset_ahead: bool = False,
               windows: bool = False) -> tuple[list[Step], rollout.Rollout]:
    """`steps` steps on each of the pool's desktops `vms` (the pool's own indices), every desktop on its own, its episode
    pinned to it (it goes on from its own screen); reset first if `reset`. -> (the steps in time
    order (t, then vm), the Rollout: times, batch sizes, the desktops that failed). A desktop the
    environment failed comes back as a rollout.Lost holding the steps it played (`partial`)."""
    todo = [partial(episode, steps=steps, settle=parse_settle(settle), reset=reset, windows=windows,
                    reset_ahead=reset_ahead) for _ in vms]
    out = rollout.play(pool, todo, policy_fn, on=sorted(vms), desktops=sorted(vms), desc="rollout")
    for f in out.failures:
        print(f"vm {pool.first + f.vm} dropped out: {f.error}", flush=True)
    buffer = [s for r in out.results for s in (r.partial or [] if isinstance(r, rollout.Lost) else r)]
    return sorted(buffer, key=lambda s: (s.step, s.vm)), out


def model_policy(policy, a: Args, temperature: float):
    """The default policy_fn: one batched generate over all observations -> Answers."""
    def policy_fn(observations: list[Observation]) -> list[Answer]:
        return generate(policy, [explore_messages(o.image) for o in observations], a.max_new_tokens, temperature,
                        a.top_p if temperature > 0 else 1.0)
    return policy_fn


# -----------------------------------------------------------------------------------------------
# The algorithm: features -> curiosity -> rewards; the update; the distillation data; a generation's start


@dataclass
class Trainer:
    """The trainer's state: what the iterations use and update (the generation's policy, its
    optimizer and KL reference, the world model, the reward terms that are on) and what they run on."""
    args: Args
    pool: VMPool | None
    run: str | None
    policy: object
    optimizer: torch.optim.Optimizer | None
    start_model: str  # the generation's starting model: LoRA's base and the KL reference
    ref_fn: object  # full fine-tuning's frozen reference (grpo.reference_fn), or None
    generation: int
    wm: R.WorldModel | None
    wm_opt: torch.optim.Optimizer | None
    reward_flags: dict  # the --rewards switches, usable ones only (rewards.effective_flags)
    tools: object  # OCR + embedder, or None
    policy_fn: object = None  # observations -> answers: model_policy of the generation's policy
    live: set = field(default_factory=set)  # the pool's desktops in play: one that failed is out until the next reset
    distill_since: int = 0  # the first iteration whose distillation data this run kept as it went


def step_features(tr: Trainer, steps: list[Step]) -> R.Features | None:
    """The screen features (and with a text term on, OCR text and embeddings) of format-valid
    steps: a malformed answer executed nothing, so every term of it is 0 anyway, and skipping it
    saves its OCR (the costliest part of the rewards)."""
    if not steps:
        return None
    return R.step_features([s.before for s in steps], [s.after for s in steps], [s.parsed.thought for s in steps],
                           [s.parsed.action for s in steps], tr.tools if "text" in R.reads(tr.reward_flags) else None)


def predict_and_learn(tr: Trainer, f: R.Features | None, actions: list, a: Args) -> tuple:
    """ALGO: the world model's guesses of every step's after-screen as it stood before this buffer
    (the curiosity terms), then it learns the buffer (--wm-train-first: the release's order, the
    other way round). f, actions: every rank's format-valid steps. -> (screen guesses (V, D) or
    None, text guesses (V, E) or None, the world model's metrics)."""
    if "world_model" not in R.reads(tr.reward_flags) or not actions:
        return None, None, {"wm/loss": None, "wm/loss_first_epoch": None}
    return R.predict_and_learn(tr.wm, tr.wm_opt, f, actions, format_ok=[1] * len(actions), epochs=a.wm_epochs,
                               batch_size=a.wm_batch_size, train_first=a.wm_train_first)  # (V, D), (V, E)


def step_rewards(tr: Trainer, buffer: list[Step], f: R.Features | None, pred_s=None, pred_t=None) -> R.Rewards:
    """ALGO: the exploration reward of each of the N steps: every term that is on, summed, times
    the format reward; a malformed step earns exactly 0 (only format-valid steps were featurised:
    f, and the world model's guesses pred_s, pred_t, are theirs). -> rewards.Rewards, (N,) each."""
    rows = [k for k, s in enumerate(buffer) if s.format_ok]
    if not rows:
        return R.zeros(len(buffer))
    steps, windows = [buffer[k] for k in rows], "windows" in R.reads(tr.reward_flags)
    b = R.make_buffer(f, [s.vm for s in steps], format_ok=[1] * len(steps),  # (a desktop's steps: one episode)
                      screen_pred=pred_s, text_pred=pred_t,
                      actions=[s.parsed.action for s in steps],
                      windows_before=[s.windows_before for s in steps] if windows else None,
                      windows_after=[s.windows_after for s in steps] if windows else None)
    return R.scatter(R.reward(b, tr.reward_flags), rows, len(buffer))  # (V,) into (N,)


def step_samples(buffer: list[Step], r: R.Rewards, adv: torch.Tensor) -> list[grpo.Sample]:
    """One training sequence per step: its prompt and the sampled answer ids, with its advantage.
    (The sampler's log-probs ride along only so the update can log actor/logp_gap.)"""
    out = [grpo.step_sample(s.answer.prompt, s.answer.ids, float(r.total[k]), old_logps=s.answer.logprobs)
           for k, s in enumerate(buffer)]
    for sample, x in zip(out, adv.tolist()):
        sample.advantage = x
    return out


def update(tr: Trainer, samples: list[grpo.Sample], it: int, on_micro_batch=None) -> dict:
    """ALGO: the GRPO update: the steps, shuffled (seeded, the same on a resume), one optimizer step
    per --mini-batch of them, the KL to the generation's start (grpo.update_policy). -> its metrics."""
    a = tr.args
    return grpo.update_policy(tr.policy, tr.optimizer, samples, micro_batch_size=a.micro_batch, eps_low=a.eps_low,
                              eps_high=a.eps_high, beta=a.beta, ref_fn=tr.ref_fn, max_grad_norm=a.max_grad_norm,
                              mini_batch_size=a.mini_batch, temperature=a.temperature, on_micro_batch=on_micro_batch,
                              shuffle=random.Random(f"{a.seed}-update-{it}"))


def lr_at(it: int, a: Args) -> float:
    """The actor's learning rate at iteration `it` (0-based, over the whole run): grpo.scheduled_lr
    within each generation (each has its own optimizer) over the generation's actor updates (the
    first generation's first one is at --update-actor-delay); a linear or cosine --lr-schedule decays
    towards 0 at the generation's last iteration.
    The paper trains at a constant lr (the default); a small model trained from scratch at a high
    lr moves fast early and needs the decay to keep what it learned by the last iteration, which is
    the model a generation hands on (models/E<g>)."""
    ipg = a.iterations_per_generation or a.iterations
    start = it - it % ipg  # the generation's first iteration
    first_update = max(start, a.update_actor_delay)  # its first actor update
    if it < first_update:  # no update this iteration: nothing to schedule
        return a.lr
    return grpo.scheduled_lr(a.lr, it - first_update, start + ipg - first_update, a.lr_warmup, a.lr_schedule)


def top_steps(valid: list[dict], top: float) -> list[dict]:
    """ALGO: per iteration, the ceil(top * n) of its n steps with the highest total reward; iterations
    in order, best first within each, ties in the order given. Each step's dict has its "iteration".

    Ranked within an iteration, not over the whole generation: the reward's scale drifts within a
    generation (curiosity decays as the world model learns, the format rate climbs), so a pooled
    ranking would keep mostly the early iterations' steps for their inflated curiosity, not for
    being the best of what the policy did then. Within one iteration every step was scored by the
    same world model, as GRPO's one group compares them. ceil keeps at least one step of every
    iteration that had a format-valid one."""
    by_it = {}
    for step in valid:
        by_it.setdefault(step["iteration"], []).append(step)
    keep = []
    for it in sorted(by_it):
        ranked = sorted(by_it[it], key=lambda step: -step["reward"])  # stable: ties keep their order
        keep += ranked[:math.ceil(top * len(ranked))]
    return keep


def distill_rows(buffer: list[Step], r: R.Rewards, it: int, top: float, everyone: list[dict]) -> list[int]:
    """ALGO: the rows of this rank's buffer that the iteration keeps for distillation: its share of
    the top `top` of every rank's format-valid steps (`everyone`: their {"reward", "vm", "step"}, tied
    in desktop then time order, as their trajectory files list them)."""
    ranked = sorted(everyone, key=lambda s: (s["vm"], s["step"]))
    kept = {(s["vm"], s["step"]) for s in top_steps([{**s, "iteration": it} for s in ranked], top)}
    return [k for k, s in enumerate(buffer) if s.format_ok and s.answer is not None and (s.vm, s.step) in kept]


def start_generation(g: int, run: str, a: Args) -> tuple:
    """ALGO: generation g's policy: the BASE model, fine-tuned on all distilled data of generations
    < g (experience-stream distillation). -> (policy, start_model path (= the KL reference), SFT metrics)."""
    policy = load(a.model, a)
    data = distill_samples(policy, run, g - 1) if g > 1 else []
    if not data:
        if g > 1:
            print(f"E{g}: no distilled steps yet (no format-valid answers), starting from the base model.", flush=True)
        return policy, a.model, {}
    opt = adamw(trainable(policy), a.distill_lr)
    rng = random.Random(a.seed + g)
    nll = []
    for _ in range(a.distill_epochs):
        rng.shuffle(data)
        for chunk in grpo.micro_batches(data, a.distill_batch):
            nll.append(grpo.distill_step(policy, opt, chunk, a.micro_batch, a.max_grad_norm)["nll"])  # ALGO: SFT
    # Saved merged: with LoRA the next adapter is fresh on top of the fine-tuned weights, so the
    # KL term pulls generation g towards its own starting point, not towards the raw base.
    path = os.path.join(run, "models", f"E{g}_sft")
    ckpt.save_model(policy, path)
    if a.lora_rank > 0:
        policy = load(path, a)
    per_epoch = max(1, len(nll) // max(1, a.distill_epochs))
    # --distill-epochs 0 is allowed (the next generation is the base model again, an ablation).
    metrics = {"distill/samples": len(data), "distill/steps": len(nll), "distill/nll_first": nll[0] if nll else None,
               "distill/nll_last_epoch": float(np.mean(nll[-per_epoch:])) if nll else None}
    print(f"E{g}: SFT on {len(data)} distilled steps ({len(nll)} optimizer steps), nll "
          f"{metrics['distill/nll_first'] or 0:.3f} -> {metrics['distill/nll_last_epoch'] or 0:.3f}", flush=True)
    return policy, path, metrics


def next_generation(tr: Trainer, it: int, ipg: int) -> dict:
    """ALGO: experience-stream distillation at a generation boundary: the finished generation's
    model is saved, and the next one starts from the BASE model fine-tuned on every distilled step
    so far, with a fresh optimizer. -> the SFT metrics."""
    a = tr.args
    finish_generation(tr, (tr.generation - 1) * ipg, it - 1)
    engine = tr.policy.engine
    tr.generation = it // ipg + 1
    tr.policy, tr.start_model, metrics = start_generation(tr.generation, tr.run, a)
    dist.spread(tr.policy.model, shard=a.lora_rank == 0)
    tr.policy.engine = engine
    sync_weights(tr.policy)
    tr.optimizer = adamw(trainable(tr.policy), a.lr)
    tr.policy_fn = model_policy(tr.policy, a, a.temperature)
    tr.ref_fn = grpo.reference_fn(a.beta, a.lora_rank, lambda: load(tr.start_model, a, lora=False))
    return metrics


# -----------------------------------------------------------------------------------------------
# One iteration, and the loop


def iteration(tr: Trainer, it: int, reset: bool) -> tuple:
    """One ScreenExplorer iteration on the desktops in play, top to bottom (`reset`: reset them
    first). -> (metrics, the buffer, its rewards (N,) each, its advantages (N,)); with no desktop
    answering, in one process, (None, [], None, None)."""
    a, times, t0 = tr.args, {}, time.perf_counter()
    if reset:  # every desktop in service plays (a dead one restarts in its own thread)
        with rundir.timed(times, "vm_wait"):
            tr.live = set(rollout.in_service(tr.pool))
    # -- the rollout: --steps steps on every live desktop, each on its own, generation batched; when
    # the next iteration resets, its resets run during this one's update (reset_ahead)
    ahead = bool(a.reset_every) and (it + 1) % a.reset_every == 0 and it + 1 < run_length(a)
    with dist.unsharded(tr.policy.model):  # (FSDP2: each rank decodes alone, with whole weights)
        buffer, out = play_steps(tr.pool, tr.live, tr.policy_fn, a.steps, a.settle, reset, ahead,
                                 windows=a.record_windows or "windows" in R.reads(tr.reward_flags))
    rundir.add_times(times, out.times)
    tr.live -= {f.vm for f in out.failures}  # out until the next reset (the pool's indices, as tr.live)
    if not buffer and dist.size() == 1:  # (under torchrun every rank goes on: their collectives pair up)
        return None, buffer, None, None
    # -- the rewards: features -> the world model's guesses (then it learns the buffer) -> every term
    valid = [s for s in buffer if s.format_ok]
    with rundir.timed(times, "features"):
        f = step_features(tr, valid)
    with rundir.timed(times, "world_model"), dist.same_rng(a.seed + it):  # (torchrun: one world model on every rank)
        f_all, actions_all, my_rows = dist.every_rows(f, [s.parsed.action for s in valid], R.Features)
        pred_s, pred_t, wm_metrics = predict_and_learn(tr, f_all, actions_all, a)  # on every rank's valid steps
    with rundir.timed(times, "rewards"):
        r = step_rewards(tr, buffer, f, *(None if p is None else p[my_rows] for p in (pred_s, pred_t)))  # (N,) each
    # -- ALGO: GRPO with the whole buffer as ONE group: each step's reward against every step's (on
    # every rank: torchrun's buffers together, in rank order; each rank trains its own steps)
    total_all, my_steps = dist.cat(r.total)  # (N_all,), this rank's rows
    adv = grpo.group_advantages(total_all, scale=a.scale_rewards)[my_steps]  # (N,)
    # -- the update, once the world model has warmed up (the ONLY condition: the release also
    # skipped it whenever the world model was off, so its no-world-model ablation never trained)
    upd = None
    if it >= a.update_actor_delay:  # ALGO: the actor waits for the world model (the release: 5 iterations)
        lr = grpo.set_lr(tr.optimizer, lr_at(it, a))
        samples = step_samples(buffer, r, adv)
        with rundir.timed(times, "update"), progress.bar(len(samples), "update") as bar:
            upd = update(tr, samples, it, bar.update)
        if upd:
            with rundir.timed(times, "sync"):
                sync_weights(tr.policy)  # the generator samples the next rollout from the new weights
        upd = {**upd, "lr": lr}
    times["time/iteration"] = time.perf_counter() - t0
    m = {"iteration": it, "generation": tr.generation, **logs.explore_metrics(buffer, r, adv, wm_metrics, upd, out),
         **rundir.gather_times(times)}
    return m, buffer, r, adv


def train(tr: Trainer, start: int, distill_metrics: dict) -> None:
    """The loop: a generation boundary when one is reached, one iteration, then trajectories,
    distillation data, checkpoint, metrics line, console line."""
    a, run = tr.args, tr.run
    ipg, total = a.iterations_per_generation or a.iterations, run_length(a)  # iterations per generation, in all
    trackers = rundir.open_trackers(run, a)
    reset_next = False
    for it in progress.track(range(start, total), "iterations"):
        t0 = time.perf_counter()
        if it // ipg + 1 != tr.generation:  # a generation boundary (also right after resuming at one)
            distill_metrics = next_generation(tr, it, ipg)
            distill_metrics["time/distill"] = time.perf_counter() - t0
        rundir.clear_trajectories(run, it)
        m, buffer, r, adv = iteration(tr, it, reset=it == start or reset_next or bool(a.reset_every and it % a.reset_every == 0))
        reset_next = not buffer
        if m is None:
            print(f"it {it}: no desktop answered; resetting them and going on.", flush=True)
            continue
        m.update(distill_metrics)
        distill_metrics = {}
        with rundir.timed(m, "save"):  # trajectories, distillation data, checkpoint, then the metrics line
            logs.save_steps(run, it, buffer, r, adv)
            everyone = dist.every([{"reward": float(r.total[k]), "vm": s.vm, "step": s.step}
                                   for k, s in enumerate(buffer) if s.format_ok and s.answer is not None])
            logs.save_distilled(run, tr.generation, it, buffer, r, distill_rows(buffer, r, it, a.distill_top, everyone))
            # Always at a generation's last iteration: the boundary (SFT) is redone from it.
            if (it + 1) % a.ckpt_every == 0 or (it + 1) % ipg == 0 or it + 1 == total:
                checkpoint(tr, it + 1, m)
        rundir.end_iteration(run, trackers, m, logs.explore_line(m, tr.reward_flags, a.beta))
    finish_generation(tr, (tr.generation - 1) * ipg, total - 1)
    progress.close(trackers)
    print(f"done: {run}", flush=True)


def run_length(a: Args) -> int:
    """The run's iterations in all: --generations times the iterations per generation."""
    return a.generations * (a.iterations_per_generation or a.iterations)


def main(argv=None) -> None:
    dist.init()  # torchrun: join the other ranks (one process: nothing)
    dist.mute_others()
    args, state = resolve_args(argv)
    transformers.utils.logging.disable_progress_bar()  # one console line per iteration, not bars
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    rundir.cpu_threads(args.threads, args.device.startswith("cuda") or (not args.device and torch.cuda.is_available()))
    # The desktops first: an unreachable VM should leave no run folder behind.
    print(f"starting {args.vms} desktop(s) ..." if args.vms.isdigit() else f"connecting to {args.vms} ...", flush=True)
    pool, _, screen = rundir.open_desktops(args.vms, args.token, args.vm_timeout, limits=args.desktop_limits)
    try:
        if args.eval_only:
            eval_only(pool, args, state)
            return
        run = args.resume or rundir.run_path(args.runs_dir, args.run_name)
        with rundir.new_run(run):  # a failed setup (bad --model, ...) leaves no folder behind
            rundir.make_run_dir(run, args, resume=bool(args.resume))
            print(f"run folder: {run}", flush=True)
            rundir.seed_all(args.seed)
            tr, start, distill_metrics = setup(args, pool, run, state, screen)
        try:
            train(tr, start, distill_metrics)
        except OSError as e:  # the run folder's disk is full: one sentence, the last checkpoint stands
            ckpt.stop_if_disk_full(e, run, PROG)
    finally:
        pool.close()


# -----------------------------------------------------------------------------------------------
# After the loop: what it calls by name. The flags (with the paper's defaults) and their checks,
# setup, a generation's end and the distillation data's plumbing, checkpoints, loading, the eval


@dataclass
class Args:
    vms: str = arg("8", "N local Xvfb desktops, or comma-separated vm_server.py URLs")
    token: str = arg("", "secret each remote VM's token is derived from (or VM_TOKEN); local desktops make their own")
    model: str = arg("Qwen/Qwen2.5-VL-3B-Instruct", "HF id, a local checkpoint folder, 'tiny-explore' "
                     "(tiny, answer format taught; CPU) or 'tiny' (random weights)")
    engine: str = arg("hf", "generation engine: hf (transformers generate) or vllm (GPU)")
    device: str = arg("", "torch device; empty = cuda if available else cpu")
    lora_rank: int = arg(64, "LoRA rank (paper: 64); 0 = full fine-tuning")
    lora_alpha: int = arg(16, "LoRA alpha (paper: 16)")
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the policy update")
    max_pixels: int = arg(MAX_PIXELS, "screenshot size cap for the model, in pixels of the resized image")
    min_pixels: int = arg(MIN_PIXELS, "screenshot size floor for the model, in pixels of the resized image")
    threads: int | None = arg(None, "torch CPU threads (default: half the cores, since the desktops and OCR "
                                    "need the rest)")
    # rollout
    steps: int = arg(10, "steps per episode (one episode per desktop per iteration)")
    iterations: int = arg(100, "training iterations (per generation with --generations > 1, unless "
                               "--iterations-per-generation is given)")
    reset_every: int = arg(1, "iterations between desktop resets (0 = only at start); a reset restarts dead "
                              "local desktops")
    settle: str = arg("watch", "after each action: 'watch' (the server answers once the screen has settled) or "
                               "seconds of a fixed sleep (the release: 1)")
    record_windows: bool = arg(False, "record the window list before and after every step (GET /windows) even when "
                                      "no reward term reads it: trajectory lines say which app each step opened "
                                      "('opened'), metrics count them (apps/*); the eval always records them")
    vm_timeout: float = arg(30.0, "seconds a VM call may take before that VM drops out (ours: an exploration "
                                  "step is one action; ARPO's 60 covers task setups)")
    desktop_limits: str = arg("", "each local desktop's bounds, e.g. memory=1g,pids=512,cpus=1,disk=256m,tmp=256m "
                                  "(the defaults; any subset; docs/vm.md); as root, a desktop cannot take more")
    temperature: float = arg(1.0, "sampling temperature (paper: 1.0)")
    top_p: float = arg(1.0, "nucleus sampling: keep the smallest token set with this much probability (1 = off)")
    max_new_tokens: int = arg(128, "answer length cap (paper: 128)")
    # actor (GRPO)
    lr: float = arg(4e-5, "actor learning rate (paper: 4e-5 with LoRA)")
    lr_warmup: int = arg(0, "actor updates of linear lr warm-up from lr / N, counted from the first update "
                            "(paper: none)")
    lr_schedule: str = arg("constant", "actor lr after the warm-up: constant (paper), linear or cosine (decay "
                                       "towards 0 at the generation's last iteration)")
    scale_rewards: bool = arg(True, "divide the advantages by the buffer's reward std (GRPO, the paper); "
                              "--no-scale-rewards: Dr. GRPO, advantages = reward - mean")
    eps_low: float = arg(0.2, "clip range below 1 (paper: 0.2)")
    eps_high: float = arg(0.28, "clip range above 1 (paper: 0.28)")
    beta: float = arg(0.04, "KL coefficient to the starting model (LoRA: adapter off; full FT: a frozen copy)")
    micro_batch: int = arg(4, "samples per forward/backward (memory knob only)")
    mini_batch: int = arg(16, "samples per optimizer step (release: gradient accumulation 16)")
    max_grad_norm: float = arg(1.0, "gradient clipping of the actor")
    update_actor_delay: int = arg(5, "iterations of world-model warm-up before the actor is updated")
    # rewards + world model
    rewards: str = arg("all", "reward terms (rewards.TERMS), e.g. all | all,no_world_model | none,image,immediate "
                              "(all = the paper's terms); the switches: " + ", ".join(R.SWITCHES) + "; off by "
                              "default, joined by name (all,<switch>): " + ", ".join(
                                  n for n, t in R.TERMS.items() if not t.default))
    wm_epochs: int = arg(3, "world-model epochs per iteration (paper: 3)")
    wm_lr: float = arg(1e-3, "world-model learning rate (ours, untuned; the release's 4e-5 is for its 1B "
                              "Llama world model, far too slow for a small MLP trained from scratch)")
    wm_batch_size: int = arg(16, "world-model batch size (ours, untuned; the release: 2)")
    wm_hidden: int = arg(256, "world-model hidden width (ours, untuned)")
    wm_train_first: bool = arg(False, "the release's order: train the world model on this buffer, then score it "
                                      "(default: score first, so a transition repeated across desktops keeps its "
                                      "surprise)")
    # experience-stream distillation
    generations: int = arg(1, "generations E1..EG; each after the first starts from the base model + SFT")
    iterations_per_generation: int | None = arg(None, "iterations per generation (default: --iterations)")
    distill_top: float = arg(0.3, "fraction of each iteration's format-valid steps (best rewards) kept for SFT "
                                   "(ours, untuned: the paper gives no fraction)")
    distill_epochs: int = arg(2, "SFT passes over all distilled data at the start of a generation (ours, untuned)")
    distill_lr: float = arg(1e-4, "SFT learning rate (ours, untuned: the paper publishes no SFT recipe)")
    distill_batch: int = arg(16, "samples per SFT optimizer step")
    # eval
    eval_only: bool = arg(False, "run the policy without training and report exploration diversity: --model's, "
                                 "or with --resume the run's checkpoint")
    eval_episodes: int = arg(20, "episodes for --eval-only, in all (spread over the desktops)", aliases=("--episodes",))
    eval_random: bool = arg(True, "also run a random-action baseline on the same desktops")
    eval_save: bool = arg(True, "save every eval episode as a trajectory (screenshots + steps; view.py shows them)")
    eval_same_hash: int = arg(2, "screens whose 64-bit perceptual hashes (dHash) differ in at most this many bits "
                                 "count as one (ours, untuned)")
    eval_same_screen: float = arg(0.95, "the feature count of distinct screens: cosine >= this = the same screen "
                                         "(ours, untuned)")
    # run
    run_name: str = arg("", "folder under --runs-dir; empty = a timestamp")
    runs_dir: str = arg("runs", "where run folders go")
    resume: str = arg("", "a run folder to continue (flags given now override its args.json)")
    ckpt_every: int = arg(1, "iterations between checkpoints (generation ends always save)")
    wandb: bool = arg(False, "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names "
                             "the project)")
    tensorboard: bool = arg(False, "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)")
    seed: int = arg(0, "random seed")


# Flag values of run folders written before these flags said what they mean (args.json, checkpoints).
OLD_VALUES = {"threads": {0: None}, "iterations_per_generation": {0: None}}


def check_args(a: Args) -> None:
    """Refuse, in one sentence, anything that would only fail later."""
    import vllm_engine  # plain Python until an engine is built (vLLM itself is imported there)
    rundir.check([
        (a.steps < 1, "--steps must be at least 1"),
        (a.iterations < 1 or a.generations < 1, "--iterations and --generations must be at least 1"),
        (a.iterations_per_generation is not None and a.iterations_per_generation < 1,
         "--iterations-per-generation must be at least 1"),
        (a.threads is not None and a.threads < 1, "--threads must be at least 1"),
        (a.engine not in ("hf", "vllm"), "--engine must be hf or vllm"),
        (a.temperature < 0 or a.max_new_tokens < 1, "--temperature must be >= 0 and --max-new-tokens >= 1"),
        (not 0 < a.top_p <= 1, "--top-p must be in (0, 1]"),
        (not 0 < a.min_pixels <= a.max_pixels, "--min-pixels must be positive and at most --max-pixels"),
        (not 0 < a.distill_top <= 1, "--distill-top must be in (0, 1]"),
        (min(a.micro_batch, a.mini_batch, a.wm_batch_size, a.distill_batch) < 1, "batch sizes must be at least 1"),
        (a.distill_epochs < 0, "--distill-epochs must be 0 or more"),
        (a.lr_schedule not in ("constant", "linear", "cosine"), "--lr-schedule must be constant, linear or cosine"),
        (a.lr_warmup < 0, "--lr-warmup must be 0 or more"),
        (a.eval_episodes < 1 or a.ckpt_every < 1, "--eval-episodes and --ckpt-every must be at least 1"),
        (not 0 <= a.eval_same_hash < 64, "--eval-same-hash must be in 0..63 (bits of a 64-bit hash)"),
        (a.lora_rank < 0 or a.beta < 0, "--lora-rank and --beta must be >= 0"),
        (parse_settle(a.settle) is None, SETTLE_HELP),
        (a.vms.startswith("osworld:"), "--vms osworld:... is for train_arpo.py: ScreenExplorer counts windows "
                                       "through the project's own server, which OSWorld's VMs do not run"),
        (a.engine == "vllm" and a.beta > 0 and a.lora_rank == 0, "--engine vllm with full fine-tuning and --beta > 0 "
                                                                  "would hold three model copies; use LoRA or --beta 0"),
        *vllm_engine.flag_errors(a.engine, a.temperature),
    ], PROG)
    try:
        R.parse_reward_flags(a.rewards)
    except ValueError as e:
        sys.exit(f"--rewards: {e}")
    try:
        parse_limits(a.desktop_limits)
    except ValueError as e:
        sys.exit(f"{PROG}: --desktop-limits: {e}.")


def resolve_args(argv=None) -> tuple:
    """The command line; on --resume, the run's saved args with the flags typed now on top.
    -> (args, (checkpoint state, folder) or None)."""
    args, given = rundir.parse_args(Args, argv, PROG)
    args, state = ckpt.resume_args(Args, args, given, PROG, marker="wm_epochs", old_values=OLD_VALUES)
    check_args(args)
    return args, state


def setup(a: Args, pool: VMPool, run: str, state, screen) -> tuple:
    """The trainer's state, fresh (generation 1's policy) or from the checkpoint: the release's
    AdamW for the actor and the world model, the reward terms that are on (and the OCR + embedder
    if a term reads text), the KL reference. -> (Trainer, the first iteration to run, SFT metrics
    of a generation's start, logged once)."""
    # Text tools (OCR + embedder) only when a term that is on reads text; without them those terms
    # are off (said once) and the world model has no text branch.
    want = R.parse_reward_flags(a.rewards)
    tools = load_text_tools() if "text" in R.reads(want) else None
    flags = R.effective_flags(want, tools)
    print("reward terms on: " + ", ".join(R.terms_on(flags)), flush=True)
    wm = R.WorldModel(R.SCREEN_DIM, tools.dim if (tools and flags.get("text")) else 0, a.wm_hidden, screen)
    wm_opt = adamw(wm.parameters(), a.wm_lr)
    if state is None:
        policy, start_model, distill_metrics = start_generation(1, run, a)
        dist.spread(policy.model, shard=a.lora_rank == 0)  # torchrun: rank 0's weights; full FT: FSDP2
        generation, start, optimizer, since = 1, 0, adamw(trainable(policy), a.lr), 0
    else:
        saved, folder = state
        policy = ckpt.restore_policy(saved, folder, lambda name: load(name, a))
        dist.spread(policy.model, shard=a.lora_rank == 0)
        optimizer = adamw(trainable(policy), a.lr)
        try:
            wm.load_state_dict(saved["wm"])
        except RuntimeError:
            sys.exit("The checkpoint's world model does not fit these reward flags / text tools; resume with the "
                     "run's own --rewards and the same OCR + embedder installed.")
        wm_opt.load_state_dict(saved["wm_opt"])
        start = ckpt.resume(run, state, policy, optimizer)  # optimizer, metrics.jsonl, trajectories, RNG states
        generation, start_model, distill_metrics = saved["generation"], saved["start_model"], {}
        since = saved.get("distill_since", start)  # a run from before: its data so far is in its trajectories
        print(f"resumed {run} at iteration {start} (generation E{generation})", flush=True)
    if a.engine == "vllm":  # GPU only: one screenshot and one answer per prompt
        import vllm_engine
        vllm_engine.attach(policy, 1, a.max_new_tokens)
    ref_fn = grpo.reference_fn(a.beta, a.lora_rank, lambda: load(start_model, a, lora=False))
    tr = Trainer(a, pool, run, policy, optimizer, start_model, ref_fn, generation, wm, wm_opt, flags, tools,
                 model_policy(policy, a, a.temperature), distill_since=since)
    dist.seed_ranks(a.seed + start)  # under torchrun: each rank samples its own answers
    return tr, start, distill_metrics


def finish_generation(tr: Trainer, first: int, last: int) -> None:
    """End of generation g: its model as models/E<g>; and, for a run whose earlier iterations of it
    were written before distillation data was kept per iteration, their best steps from the
    trajectory files (logs.distill_from_trajectories)."""
    a, run = tr.args, tr.run
    path = os.path.join(run, "models", f"E{tr.generation}")
    stamp = os.path.join(path, "LAST_ITERATION")
    if not (os.path.exists(stamp) and open(stamp).read().strip() == str(last)):
        ckpt.save_model(tr.policy, path, extra={"LAST_ITERATION": str(last)})
    if dist.is_main() and tr.distill_since > first:
        logs.distill_from_trajectories(run, tr.generation, range(first, min(tr.distill_since, last + 1)),
                                       lambda steps: top_steps(steps, a.distill_top))
    dist.barrier()  # every rank reads the dataset for the next generation's SFT


def distill_samples(policy, run: str, upto: int) -> list[grpo.Sample]:
    """grpo.Samples of every distilled step of generations 1..upto: the saved screenshot as the
    prompt, the answer's sampled token ids verbatim as the target."""
    out = []
    for d in logs.distilled(run, upto):
        with Image.open(os.path.join(run, "distill", d["image"])) as im:
            enc = encode_chat(policy, explore_messages(im.convert("RGB")))
        out.append(grpo.step_sample(enc, d["completion_ids"]))
    return out


def checkpoint(tr: Trainer, next_it: int, metrics: dict) -> None:
    """ckpt.save plus ScreenExplorer's own state: the world model, the generation and its start."""
    ckpt.save(tr.run, tr.policy, tr.optimizer, next_it, tr.args, metrics, start_model=tr.start_model,
              generation=tr.generation, wm=tr.wm.state_dict(), wm_opt=tr.wm_opt.state_dict(), wm_config=tr.wm.config,
              distill_since=tr.distill_since)


def adamw(params, lr: float) -> torch.optim.AdamW:
    """The release's AdamW, for the actor and the world model alike: betas (0.9, 0.95), eps 1e-8,
    weight decay 0.01. beta2 = 0.95 averages squared gradients over ~20 steps instead of ~1000, so
    the step size follows the gradient scale as the rewards and the policy drift under online RL.
    The distillation SFT (no release recipe) uses the same optimizer."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def trainable(policy):
    return [p for p in policy.model.parameters() if p.requires_grad]


def load(name: str, a: Args, lora: bool = True):
    return load_policy(name, lora_rank=a.lora_rank if lora else 0, lora_alpha=a.lora_alpha,
                       gradient_checkpointing=a.gradient_checkpointing, device=a.device or None,
                       min_pixels=a.min_pixels, max_pixels=a.max_pixels, seed=a.seed)


def evaluate(pool: VMPool, policy_fns: dict, run: str, a: Args, config: dict) -> dict:
    """--eval-episodes episodes of --steps steps, each on a freshly reset desktop (a desktop that
    finishes one starts the next; one the environment failed is played once more elsewhere), for
    each policy_fn ({name: policy_fn}: the policy, the random baseline); per episode rewards.py's
    exploration measures (episode_measures). Under torchrun each rank plays its share. With
    --eval-save each episode is also a trajectory view.py shows. -> the report (logs.explore_eval)."""
    want = len(dist.shard_range(a.eval_episodes))
    report = {"args": config, "same_screen_hash_bits": a.eval_same_hash, "same_screen_cosine": a.eval_same_screen}
    for name, policy_fn in policy_fns.items():
        eps = [partial(episode, steps=a.steps, settle=parse_settle(a.settle), reset=True, windows=True,
                       reset_ahead=True)] * want
        out = rollout.play(pool, eps, policy_fn, retries=1, desktops=rollout.in_service(pool), desc=f"eval {name}")
        for f in out.failures:  # an episode played again elsewhere, or lost: say why
            print(f"eval {name}: an episode failed on {'no vm' if f.vm is None else f'vm {pool.first + f.vm}'}: {f.error}",
                  flush=True)
        played = []
        for k, steps in enumerate(out.results):
            if isinstance(steps, rollout.Lost):
                continue
            e = R.episode_measures([s.before for s in steps], [s.after for s in steps], [s.format_ok for s in steps],
                                   [s.windows_before for s in steps], [s.windows_after for s in steps],
                                   a.eval_same_hash, a.eval_same_screen)
            e.update(vm=steps[0].vm, actions=[logs.step_line(s) for s in steps],
                     apps=[x for s in steps for x in s.opened or []])  # each window opened: its app or "other"
            e["round"], slot = divmod(k, pool.size)
            if a.eval_save:
                rundir.save_trajectory(run if name == "policy" else os.path.join(run, name), e["round"],
                                       pool.first + slot, e["actions"], [s.before for s in steps])
            played.append(e)
        report[name] = logs.eval_summary(dist.every(played), int(dist.all_sum([want - len(played)])[0]),
                                         a.eval_same_hash)
    return logs.explore_eval(report, run, list(policy_fns), a.eval_same_hash)


def eval_only(pool: VMPool, a: Args, state) -> dict:
    """--eval-only: the policy (--model, or with --resume the run's checkpoint) next to random
    actions. Writes a run folder of its own (eval-<time>), or with --resume runs/<name>/eval_it<N>/
    (N = the checkpoint's next iteration; a second eval of the same checkpoint replaces the first)."""
    if state is not None:
        run = os.path.join(a.resume, f"eval_it{ckpt.next_iteration(state[0]):06d}")
        if dist.is_main():
            shutil.rmtree(run, ignore_errors=True)
    else:
        run = rundir.run_path(a.runs_dir, a.run_name, prefix="eval-")
    with rundir.new_run(run):  # a failed setup leaves no folder behind
        rundir.make_run_dir(run, a)
        print(f"run folder: {run}", flush=True)
        rundir.seed_all(a.seed)
        policy = (ckpt.restore_policy(*state, lambda name: load(name, a)) if state is not None
                  else load(a.model, a, lora=False))
        dist.seed_ranks(a.seed)
        if a.engine == "vllm":  # GPU only: one screenshot and one answer per prompt
            import vllm_engine
            vllm_engine.attach(policy, 1, a.max_new_tokens)
    policy_fns = {"policy": model_policy(policy, a, a.temperature)}
    if a.eval_random:
        policy_fns["random"] = random_policy(random.Random(a.seed))
    return evaluate(pool, policy_fns, run, a, rundir.public_args(a))


def random_policy(rng: random.Random):
    """The eval's baseline: uniformly random pointer actions anywhere on the screen, as answers."""
    kinds = ("click", "double_click", "right_click", "move", "scroll")

    def policy_fn(observations: list[Observation]) -> list[str]:
        out = []
        for o in observations:
            kind = rng.choice(kinds)
            act = Action(kind, x=rng.randrange(o.image.width), y=rng.randrange(o.image.height),
                         direction=rng.choice(("up", "down")) if kind == "scroll" else None)
            out.append(answer_text(act))
        return out
    return policy_fn


def answer_text(action: Action, intent: str = "") -> str:
    """An answer in ScreenExplorer's format for a pointer action, key or text, in screen pixels
    (what a stand-in policy answers; parse_answer reads it back as this very action)."""
    name = {"click": "Click", "double_click": "DoubleClick", "right_click": "RightClick", "move": "Move"}.get(action.type)
    if action.type == "scroll":
        call = f"Scroll{action.direction.title()}({action.x}, {action.y})"
    elif action.type == "key":
        call = f"Key({json.dumps('+'.join(action.keys))})"
    elif action.type == "type":
        call = f"Text({action.x}, {action.y}, {json.dumps(action.text)})" if action.x is not None else f"Text({json.dumps(action.text)})"
    elif name:
        call = f"{name}({action.x}, {action.y})"
    else:
        raise ValueError(f"no ScreenExplorer answer for a {action.type} action")
    return json.dumps({"intent": intent, "action": call})


if __name__ == "__main__":
    main()
