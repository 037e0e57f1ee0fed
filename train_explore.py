"""ScreenExplorer: teach a vision-language model to explore real desktops, with no task at all.

    python train_explore.py --vms 8                                  # 8 local Xvfb desktops, Qwen2.5-VL-3B
    python train_explore.py --vms http://10.0.0.5:8000,http://10.0.0.6:8000 --token T
    python train_explore.py --vms 2 --model tiny --iterations 2 --steps 2      # CPU smoke run (*)
    python train_explore.py --vms 8 --generations 3 --iterations-per-generation 100   # E1, E2, E3
    python train_explore.py --resume runs/<name>                     # continue a run
    python train_explore.py --eval-only --model runs/<name>/models/E1 --episodes 20   # vs random actions
(*) the random-weight tiny model almost never writes a well-formed answer: it tests the plumbing only.

A run folder: args.json; metrics.jsonl (one line per iteration: every reward component, world-model
loss, KL, clip fractions, format rate, per-phase seconds); trajectories/it<i>/vm<k>.jsonl + the PNG
the model saw at each step; ckpt/ (the latest checkpoint); models/E<g> (each generation's model,
E<g>_sft its SFT starting point); distill/gen<g>.jsonl + gen<g>/*.png (its distilled steps).

Paper: ScreenExplorer (arXiv 2505.19095). One iteration, top to bottom:
    --steps steps on every live desktop, each on its own (rollout.py; `explore`, in the desktop's
        thread): screenshot -> exploration prompt -> the policy's answer (generation batches the
        desktops' waiting prompts) -> parse {"intent", "action"} -> the action, and the screen once
        it settled (--settle)
    -> screen features (+ OCR text) -> the world model's guesses (curiosity) -> world model trained
    --wm-epochs on this buffer -> rewards (every component) -> advantages over the whole buffer (one
    group) -> GRPO update (after --update-actor-delay iterations) -> sync weights to the generator
    -> trajectories, checkpoint, log.
Experience-stream distillation (--generations G): at the end of a generation its best format-valid
steps (the top --distill-top of each iteration's, by reward) become a dataset in
runs/<name>/distill/; the next generation starts again from the BASE model, fine-tuned on all
distilled data so far, then does RL.

Where this departs from the paper and its release (niuzaisheng/ScreenExplorer), and what it leaves out:
1. Rewards, features and the world model are rewards.py's (a fixed patch-grid screen feature instead
   of Cosmos latents, tesseract + MiniLM instead of PaddleOCR + BGE-M3, an MLP world model); see its
   docstring. The release's two bugs are not here: the world model's image branch is trained, and
   `--rewards all,no_world_model` still trains the actor (the release skipped the update).
   Curiosity is scored before the world model learns the buffer (the release: after, so a new
   transition seen on several desktops had its surprise trained away; --wm-train-first restores
   the release's order). Both optimizers are the release's AdamW, betas (0.9, 0.95).
2. No guided (JSON-schema) decoding: the release constrained vLLM's sampler to the answer schema;
   we sample freely and a malformed answer is a format failure (reward 0, nothing executed), which
   is itself a learning signal. The release's repetition penalty (1.05) is off: it would make the
   sampling distribution differ from the policy whose log-probs the loss uses.
3. The actor starts updating at iteration --update-actor-delay (0-based; the release: after it).
   One optimizer step per --mini-batch samples (the release: gradient accumulation 16 of batch 1).
   An lr warm-up and a linear or cosine decay per generation (--lr-warmup, --lr-schedule; off by
   default, the paper's constant lr) are for small models trained from scratch (actor_lr says why).
4. A desktop that fails (no answer, a 5xx, garbage; only a refused action, 4xx, is the model's)
   drops out of the iteration without the step it failed in (`env_failures`) and a reset restarts
   it; the release threw the whole iteration away. No lockstep (the release's): generation batches
   the prompts that are waiting, so sampled tokens are not reproducible across runs. The screen
   settles by the server's watch (--settle watch) or a fixed sleep (--settle 1, the release's).
5. Distillation: the paper does not publish its SFT recipe; ours is --distill-epochs passes of
   token-mean NLL on the sampled answers, at --distill-lr, with LoRA merged into the weights after
   SFT, so the next generation's adapter (and its KL reference) start from the fine-tuned model.
   The best steps are ranked within each iteration, not over the generation: the reward's scale
   drifts as the world model learns (top_steps says why).
6. Exploration eval (the paper's own numbers are its reward terms; these are ours): distinct screens
   by a 64-bit perceptual hash (dHash; <= --eval-same-hash bits apart = one screen; also counted by
   feature clusters), mean pairwise diversity (1 - cos of the screen features) of an episode's
   distinct screens, and windows opened (X windows seen after any step that were not open at the
   start, from the VM's GET /windows: one window counts once, whatever its title does), vs random
   actions. eval.json has every episode's actions; each episode is also saved as a trajectory
   (--eval-save), so `python view.py` shows what the policy clicked.
7. Logging: metrics.jsonl always; Weights & Biases (--wandb) and TensorBoard (--tensorboard) when
   asked for and installed (progress.py). Left out: mixed-precision autocast (bf16 weights on GPU
   instead).
8. More than one GPU (the release: two): `torchrun --nproc_per_node N train_explore.py ...`, each rank
   with its slice of the desktops; the one group and the world model span every rank (dist.py,
   README "More than one GPU").
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
from dataclasses import asdict, dataclass, field, fields
from functools import partial

import numpy as np
import torch
import transformers
from PIL import Image

import dist
import grpo
import progress
import rewards as R
import rollout
import rundir
from actions import MAX_PIXELS, MIN_PIXELS, Action, Parsed, cursor_after, parse_action
from chat import encode_chat, explore_messages
from env import VMError, VMPool
from rollout import SETTLE_HELP, parse_settle, refused
from model import cpu_weights, generate, load_policy, save_policy, sync_weights

PROG = "train_explore.py"

# -----------------------------------------------------------------------------------------------
# Args


@dataclass
class Args:
    vms: str = field(default="8", metadata={"help": "N local Xvfb desktops, or comma-separated vm_server.py URLs"})
    token: str = field(default="", metadata={"help": "secret each remote VM's token is derived from (or VM_TOKEN); local desktops make their own"})
    model: str = field(default="Qwen/Qwen2.5-VL-3B-Instruct", metadata={"help": "HF id, a local checkpoint folder, or 'tiny' (random weights, CPU)"})
    engine: str = field(default="hf", metadata={"help": "generation engine: hf (transformers generate) or vllm (GPU)"})
    device: str = field(default="", metadata={"help": "torch device; empty = cuda if available else cpu"})
    lora_rank: int = field(default=64, metadata={"help": "LoRA rank (paper: 64); 0 = full fine-tuning"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (paper: 16)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "trade compute for memory in the policy update"})
    max_pixels: int = field(default=MAX_PIXELS, metadata={"help": "screenshot size cap for the model, in pixels of the resized image"})
    min_pixels: int = field(default=MIN_PIXELS, metadata={"help": "screenshot size floor for the model, in pixels of the resized image"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = half the cores (the desktops and OCR need the rest)"})
    # rollout
    steps: int = field(default=10, metadata={"help": "steps per episode (one episode per desktop per iteration)"})
    iterations: int = field(default=100, metadata={"help": "training iterations (per generation when --generations > 1 and --iterations-per-generation is 0)"})
    reset_every: int = field(default=1, metadata={"help": "iterations between desktop resets (0 = only at start); a reset restarts dead local desktops"})
    settle: str = field(default="watch", metadata={"help": "after each action: 'watch' (the server waits until the screen stops changing, with a cap) or seconds of a fixed sleep (the release: 1)"})
    vm_timeout: float = field(default=30.0, metadata={"help": "seconds a VM call may take before that VM drops out"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (paper: 1.0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: keep the smallest token set with this much probability (1 = off)"})
    max_new_tokens: int = field(default=128, metadata={"help": "answer length cap (paper: 128)"})
    # actor (GRPO)
    lr: float = field(default=4e-5, metadata={"help": "actor learning rate (paper: 4e-5 with LoRA)"})
    lr_warmup: int = field(default=0, metadata={"help": "actor updates of linear lr warm-up from lr / N, counted from the first update (paper: none)"})
    lr_schedule: str = field(default="constant", metadata={"help": "actor lr after the warm-up: constant (paper), linear or cosine (decay towards 0 at the generation's last iteration)"})
    eps_low: float = field(default=0.2, metadata={"help": "clip range below 1 (paper: 0.2)"})
    eps_high: float = field(default=0.28, metadata={"help": "clip range above 1 (paper: 0.28)"})
    beta: float = field(default=0.04, metadata={"help": "KL coefficient to the starting model (LoRA: adapter off; full FT: a frozen copy)"})
    micro_batch: int = field(default=4, metadata={"help": "samples per forward/backward (memory knob only)"})
    mini_batch: int = field(default=16, metadata={"help": "samples per optimizer step (release: gradient accumulation 16)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping of the actor"})
    update_actor_delay: int = field(default=5, metadata={"help": "iterations of world-model warm-up before the actor is updated"})
    # rewards + world model
    rewards: str = field(default="all", metadata={"help": "reward components, e.g. all | all,no_world_model | none,image,immediate"})
    wm_epochs: int = field(default=3, metadata={"help": "world-model epochs per iteration (paper: 3)"})
    wm_lr: float = field(default=1e-3, metadata={"help": "world-model learning rate"})
    wm_batch_size: int = field(default=16, metadata={"help": "world-model batch size"})
    wm_hidden: int = field(default=256, metadata={"help": "world-model hidden width"})
    wm_train_first: bool = field(default=False, metadata={"help": "the release's order: train the world model on this buffer, then score it (default: score first, so a transition repeated across desktops keeps its surprise)"})
    # experience-stream distillation
    generations: int = field(default=1, metadata={"help": "generations E1..EG; each after the first starts from the base model + SFT"})
    iterations_per_generation: int = field(default=0, metadata={"help": "iterations per generation; 0 = --iterations"})
    distill_top: float = field(default=0.3, metadata={"help": "fraction of each iteration's format-valid steps (best rewards) kept for SFT"})
    distill_epochs: int = field(default=2, metadata={"help": "SFT passes over all distilled data at the start of a generation"})
    distill_lr: float = field(default=1e-4, metadata={"help": "SFT learning rate"})
    distill_batch: int = field(default=16, metadata={"help": "samples per SFT optimizer step"})
    # eval
    eval_only: bool = field(default=False, metadata={"help": "run the policy without training and report exploration diversity: --model's, or with --resume the run's checkpoint"})
    eval_episodes: int = field(default=20, metadata={"help": "episodes for --eval-only, in all (spread over the desktops)", "aliases": ["--episodes"]})
    eval_random: bool = field(default=True, metadata={"help": "also run a random-action baseline on the same desktops"})
    eval_save: bool = field(default=True, metadata={"help": "save every eval episode as a trajectory (screenshots + steps; view.py shows them)"})
    eval_same_hash: int = field(default=2, metadata={"help": "screens whose 64-bit perceptual hashes (dHash) differ in at most this many bits count as one"})
    eval_same_screen: float = field(default=0.95, metadata={"help": "the feature count of distinct screens: cosine >= this = the same screen"})
    # run
    run_name: str = field(default="", metadata={"help": "folder under --runs-dir; empty = a timestamp"})
    runs_dir: str = field(default="runs", metadata={"help": "where run folders go"})
    resume: str = field(default="", metadata={"help": "a run folder to continue (flags given now override its args.json)"})
    ckpt_every: int = field(default=1, metadata={"help": "iterations between checkpoints (generation ends always save)"})
    wandb: bool = field(default=False, metadata={"help": "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names the project)"})
    tensorboard: bool = field(default=False, metadata={"help": "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)"})
    seed: int = field(default=0, metadata={"help": "random seed"})


def check_args(a: Args) -> None:
    """Refuse, in one sentence, anything that would only fail later."""
    import vllm_engine  # plain Python until an engine is built (vLLM itself is imported there)
    rundir.check([
        (a.steps < 1, "--steps must be at least 1"),
        (a.iterations < 1 or a.generations < 1, "--iterations and --generations must be at least 1"),
        (a.iterations_per_generation < 0, "--iterations-per-generation must be 0 (= --iterations) or more"),
        (a.engine not in ("hf", "vllm"), "--engine must be hf or vllm"),
        (a.temperature < 0 or a.max_new_tokens < 1, "--temperature must be >= 0 and --max-new-tokens >= 1"),
        (not 0 < a.top_p <= 1, "--top-p must be in (0, 1]"),
        (not 0 < a.min_pixels <= a.max_pixels, "--min-pixels must be positive and at most --max-pixels"),
        (not 0 < a.distill_top <= 1, "--distill-top must be in (0, 1]"),
        (a.micro_batch < 1 or a.mini_batch < 1 or a.wm_batch_size < 1 or a.distill_batch < 1, "batch sizes must be at least 1"),
        (a.distill_epochs < 0, "--distill-epochs must be 0 or more"),
        (a.lr_schedule not in ("constant", "linear", "cosine"), "--lr-schedule must be constant, linear or cosine"),
        (a.lr_warmup < 0, "--lr-warmup must be 0 or more"),
        (a.eval_episodes < 1 or a.ckpt_every < 1, "--eval-episodes and --ckpt-every must be at least 1"),
        (not 0 <= a.eval_same_hash < 64, "--eval-same-hash must be in 0..63 (bits of a 64-bit hash)"),
        (a.lora_rank < 0 or a.beta < 0, "--lora-rank and --beta must be >= 0"),
        (parse_settle(a.settle) is None, SETTLE_HELP),
        (a.engine == "vllm" and a.beta > 0 and a.lora_rank == 0, "--engine vllm with full fine-tuning and --beta > 0 would hold three model copies; use LoRA or --beta 0"),
        *vllm_engine.flag_errors(a.engine, a.temperature),
    ], PROG)
    try:
        R.parse_reward_flags(a.rewards)
    except ValueError as e:
        sys.exit(f"--rewards: {e}")


def resolve_args(argv=None) -> tuple:
    """The command line; on --resume, the run's saved args with the flags typed now on top.
    -> (args, (checkpoint state, folder) or None)."""
    args, given = rundir.parse_args(Args, argv, PROG)
    args, ckpt = rundir.resume_args(Args, args, given, PROG, marker="wm_epochs")
    check_args(args)
    return args, ckpt


# -----------------------------------------------------------------------------------------------
# The one console line


def console_line(m: dict) -> str:
    """The iteration's summary: reward components as image/text imm/seq/wm and intent before/after/click."""
    f = lambda k, fmt="{:.3f}": "-" if m.get(k) is None else fmt.format(m[k])  # noqa: E731
    return (f"it {m['iteration']:4d} E{m['generation']} | vms {m['vms']} steps {m['steps']} | "
            f"reward {f('reward/total')} fmt {f('reward/format', '{:.2f}')} "
            f"img {f('reward/image_immediate')}/{f('reward/image_sequence')}/{f('reward/image_world_model')} "
            f"txt {f('reward/text_immediate')}/{f('reward/text_sequence')}/{f('reward/text_world_model')} "
            f"intent {f('reward/intent_before')}/{f('reward/intent_after')}/{f('reward/intent_click')} | "
            f"wm {f('wm/loss', '{:.4f}')} | kl {f('actor/kl', '{:.4f}')} clip {f('actor/clip_low', '{:.2f}')}/{f('actor/clip_high', '{:.2f}')} | "
            f"{m['time/iteration']:.1f}s (gen {m.get('time/generation', 0):.1f} feat {m.get('time/features', 0):.1f} "
            f"upd {m.get('time/update', 0):.1f}, VM wait {100 * m.get('vm_wait_share', 0):.0f}%; per desktop: "
            f"reset {m.get('time/reset', 0):.1f} env {m.get('time/env', 0):.1f})"
            + (f" | env failures {m['env_failures']}" if m.get("env_failures") else ""))


# -----------------------------------------------------------------------------------------------
# Rollout: --steps steps on every desktop, each on its own (rollout.py). Shapes in the buffer:
# N = desktops x steps (fewer where a desktop failed).


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


@dataclass
class Look:
    """What a chooser gets of one desktop at one step: the screen, and where the mouse is (DragTo
    drags from there)."""
    vm: int
    t: int
    image: Image.Image
    cursor: tuple


def policy_chooser(policy, a: Args):
    """list[Look] -> [(text, Parsed | None, Generation)] with ONE batched generate for all of them."""
    def choose(looks):
        gens = generate(policy, [explore_messages(o.image) for o in looks], a.max_new_tokens, a.temperature, a.top_p)
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


def explore(desk: rollout.Desktop, steps: int, settle, out: list, reset: bool, windows: dict | None = None,
            reset_after: bool = False):
    """One desktop's episode (a generator rollout.run steps in the desktop's thread): the screen ->
    the chooser's answer (`yield`) -> the action, the settled screen back -> a Step into `out` (the
    iteration's buffer), --steps times. A malformed answer executes nothing (the screen is looked at
    again); a refused action (4xx) is a format failure too; any other VM failure ends the episode
    without the step it happened in: the environment failed, not the model. `windows`, a dict, gets
    {X window id: title} of every app window that was not open at the start (the eval's count).
    `reset_after`: the desktop's next episode begins with a reset; start it now, in the background."""
    if reset:
        desk.reset()
    before = desk.screenshot()
    start = {w["id"] for w in desk.windows()} if windows is not None else set()
    # The mouse, for DragTo: /reset leaves it at the centre (training resets every --reset-every
    # iterations, the eval before each episode; between resets this is an approximation).
    cursor = (before.width // 2, before.height // 2)
    for t in range(steps):
        text, parsed, gen = yield Look(desk.vm, t, before, cursor)
        error = None
        try:
            after = desk.act(parsed.action, settle) if parsed else desk.screenshot()
        except VMError as e:
            if not refused(e):
                raise
            error, after = str(e), desk.screenshot()  # the VM refused the action (bad key name, ...)
        # The step is kept even when malformed: its reward is 0, and below the buffer's mean that is
        # a negative advantage, which is how GRPO teaches the format.
        out.append(Step(desk.vm, t, before, after, text, None if error else parsed, gen, error))
        if error is None:
            cursor = cursor_after(parsed.action if parsed else None, cursor)
        if windows is not None:
            windows.update({w["id"]: w["title"] for w in desk.windows() if w["id"] not in start | set(windows)})
        before = after  # the after-screen is the next step's before-screen
    if reset_after:
        desk.reset_ahead()


def play(pool: VMPool, vms: set, choose, a: Args, reset: bool,
         reset_after: bool = False) -> tuple[list[Step], rollout.Rollout]:
    """--steps steps on each of `vms`, every desktop on its own, its episode pinned to it (it goes on
    from its own screen); reset first if `reset`; start the next iteration's reset when done if
    `reset_after`. -> (the steps in time order (t, then vm), the Rollout: times, batch sizes, the
    desktops that failed)."""
    buffer: list[Step] = []
    episodes = [partial(explore, steps=a.steps, settle=parse_settle(a.settle), out=buffer, reset=reset,
                        reset_after=reset_after) for _ in vms]
    out = rollout.run(pool, episodes, choose, on=sorted(vms), desktops=sorted(vms), desc="rollout")
    for f in out.failures:
        print(f"vm {f.vm} dropped out: {f.error}", flush=True)
    return sorted(buffer, key=lambda s: (s.t, s.vm)), out


# -----------------------------------------------------------------------------------------------
# Rewards: features, the world model's update, every component (rewards.py does the math)


def score(buffer: list[Step], L: Learner, a: Args, times: dict, it: int = 0):
    """-> (rewards.Rewards over the buffer, each (N,), and the world model's metrics).

    Only format-valid steps are featurised, learned from and scored: a malformed answer executed
    nothing, so every one of its components is 0 anyway, and skipping it saves its OCR (the
    costliest part of the rewards, ~0.5-1 s per screen per core). Under torchrun the world model
    learns every rank's valid steps (gather_steps), the same on every rank."""
    n = len(buffer)
    rows = [k for k, s in enumerate(buffer) if s.parsed is not None]
    full = R.Rewards(**{f.name: torch.zeros(n) for f in fields(R.Rewards)})  # (N,) each
    wm_metrics = {"wm/loss": None, "wm/loss_first_epoch": None}
    if not rows and dist.size() == 1:
        return full, wm_metrics
    steps = [buffer[k] for k in rows]
    actions = [s.parsed.action for s in steps]
    f = None
    if rows:
        with rundir.timed(times, "features"):
            f = R.step_features([s.before for s in steps], [s.after for s in steps], [s.parsed.thought for s in steps],
                                actions, L.tools if R.needs_text(L.flags) else None)
    pred_s = pred_t = None
    if L.flags["world_model"]:
        with rundir.timed(times, "world_model"), dist.same_rng(a.seed + it):
            f_all, actions_all, mine = gather_steps(f, actions)
            # ALGO: curiosity is the surprise of the world model as it stood before this buffer;
            # then it learns the buffer (--wm-train-first: the release's order, the other way round).
            if actions_all:
                pred_s, pred_t, wm_metrics = R.update_and_predict(L.wm, L.wm_opt, f_all, actions_all,
                                                                  [1] * len(actions_all), a.wm_epochs, a.wm_batch_size,
                                                                  a.wm_train_first)  # (V_all, D), (V_all, E)
                pred_s, pred_t = pred_s[mine], None if pred_t is None else pred_t[mine]  # (V, D), (V, E)
    if not rows:
        return full, wm_metrics
    with rundir.timed(times, "rewards"):
        r = R.exploration_rewards(L.flags, [s.vm for s in steps], [1] * len(steps), f.screen_before, f.screen_after,
                                  pred_s, f.text_before, f.text_after, pred_t, f.intent, f.click_text, f.click_hit)
    for name in full.__dataclass_fields__:
        getattr(full, name)[rows] = getattr(r, name)  # (V,) into (N,); malformed steps stay 0
    return full, wm_metrics


def gather_steps(f, actions: list) -> tuple:
    """Every rank's valid steps (features, actions) in rank order, and this rank's rows of them.
    One process: its own, as they are."""
    if dist.size() == 1:
        return f, actions, slice(0, len(actions))
    parts = dist.gather((f, actions))
    start = sum(len(acts) for _, acts in parts[:dist.rank()])
    have = [p for p, acts in parts if acts]
    if not have:
        return None, [], slice(0, 0)

    def cat(name):
        xs = [getattr(p, name) for p in have]
        return None if any(x is None for x in xs) else torch.cat(xs)  # (V_all, ...)
    tensors = ("screen_before", "screen_after", "text_before", "text_after", "intent", "click_text", "click_hit")
    f_all = R.StepFeatures(**{name: cat(name) for name in tensors})
    return f_all, [x for _, acts in parts for x in acts], slice(start, start + len(actions))


# -----------------------------------------------------------------------------------------------
# The policy of a generation: load, distill (SFT), checkpoint round trip


def load(name: str, a: Args, lora: bool = True):
    return load_policy(name, lora_rank=a.lora_rank if lora else 0, lora_alpha=a.lora_alpha,
                         gradient_checkpointing=a.gradient_checkpointing, device=a.device or None,
                         min_pixels=a.min_pixels, max_pixels=a.max_pixels, seed=a.seed)


def trainable(policy):
    return [p for p in policy.model.parameters() if p.requires_grad]


def adamw(params, lr: float) -> torch.optim.AdamW:
    """The release's AdamW, for the actor and the world model alike: betas (0.9, 0.95), eps 1e-8,
    weight decay 0.01. beta2 = 0.95 averages squared gradients over ~20 steps instead of ~1000, so
    the step size follows the gradient scale as the rewards and the policy drift under online RL.
    The distillation SFT (no release recipe) uses the same optimizer."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def actor_lr(it: int, a: Args) -> float:
    """The actor's learning rate at iteration `it` (0-based, over the whole run): rundir.scheduled_lr
    within each generation (each has its own optimizer) over the generation's actor updates (the
    first generation's first one is at --update-actor-delay), towards 0 at its last iteration.
    The paper trains at a constant lr (the default); a small model trained from scratch at a high
    lr moves fast early and needs the decay to keep what it learned by the last iteration, which is
    the model a generation hands on (models/E<g>)."""
    ipg = a.iterations_per_generation or a.iterations
    start = it - it % ipg  # the generation's first iteration
    first = max(start, a.update_actor_delay)  # its first actor update
    if it < first:  # no update this iteration: nothing to schedule
        return a.lr
    return rundir.scheduled_lr(a.lr, it - first, start + ipg - first, a.lr_warmup, a.lr_schedule)


def distill_samples(policy, run: str, upto: int) -> list:
    """grpo.Samples of every distilled step of generations 1..upto: the saved screenshot as the
    prompt, the answer's sampled token ids verbatim as the target."""
    samples = []
    for g in range(1, upto + 1):
        path = os.path.join(run, "distill", f"gen{g}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            for line in fh:
                d = json.loads(line)
                with Image.open(os.path.join(run, "distill", d["image"])) as im:
                    enc = encode_chat(policy, explore_messages(im.convert("RGB")))
                samples.append(grpo.step_sample(enc, d["completion_ids"]))
    return samples


def start_generation(g: int, run: str, a: Args) -> tuple:
    """Generation g's policy: the BASE model, fine-tuned on all distilled data of generations < g.
    -> (policy, start_model path (= the KL reference), SFT metrics)."""
    policy = load(a.model, a)
    samples = distill_samples(policy, run, g - 1) if g > 1 else []
    if not samples:
        if g > 1:
            print(f"E{g}: no distilled steps yet (no format-valid answers), starting from the base model.", flush=True)
        return policy, a.model, {}
    opt = adamw(trainable(policy), a.distill_lr)
    rng = random.Random(a.seed + g)
    nll = []
    for _ in range(a.distill_epochs):
        rng.shuffle(samples)
        for chunk in grpo.micro_batches(samples, a.distill_batch):
            nll.append(grpo.distill_step(policy, opt, chunk, a.micro_batch, a.max_grad_norm)["nll"])  # ALGO: SFT
    # Saved merged: with LoRA the next adapter is fresh on top of the fine-tuned weights, so the
    # KL term pulls generation g towards its own starting point, not towards the raw base.
    path = os.path.join(run, "models", f"E{g}_sft")
    save_model(policy, path)
    if a.lora_rank > 0:
        policy = load(path, a)
    per_epoch = max(1, len(nll) // max(1, a.distill_epochs))
    # --distill-epochs 0 is allowed (the next generation is the base model again, an ablation).
    metrics = {"distill/samples": len(samples), "distill/steps": len(nll), "distill/nll_first": nll[0] if nll else None,
               "distill/nll_last_epoch": float(np.mean(nll[-per_epoch:])) if nll else None}
    print(f"E{g}: SFT on {len(samples)} distilled steps ({len(nll)} optimizer steps), nll "
          f"{metrics['distill/nll_first'] or 0:.3f} -> {metrics['distill/nll_last_epoch'] or 0:.3f}", flush=True)
    return policy, path, metrics


def save_model(policy, path: str, extra: dict | None = None) -> None:
    """save_policy into a temp folder, then rename: a model folder is either complete or absent.
    Every rank calls it (FSDP2 gathers the weights from all of them); rank 0 writes."""
    weights = cpu_weights(policy)
    if dist.is_main():
        tmp = path + f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_policy(policy, tmp, weights)
        for name, text in (extra or {}).items():
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write(text)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    dist.barrier()


def reference_fn(start_model: str, a: Args):
    """KL reference for full fine-tuning: a frozen copy of the generation's starting model.
    (LoRA needs none: update_policy switches the adapter off.)"""
    if a.beta == 0 or a.lora_rank > 0:
        return None
    ref = load(start_model, a, lora=False)
    ref.model.eval().requires_grad_(False)
    return lambda batch: grpo.per_token_logps(ref.model, batch)  # (B, T)


# -----------------------------------------------------------------------------------------------
# Experience-stream distillation: a generation's best steps -> runs/<name>/distill/gen<g>.jsonl


def top_steps(valid: list[dict], top: float) -> list[dict]:
    """ALGO: per iteration, the ceil(top * n) of its n steps with the highest total reward; iterations
    in order, best first within each, ties in time order. Each step's dict has its "iteration".

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
        ranked = sorted(by_it[it], key=lambda step: -step["reward"])  # stable: ties keep time order
        keep += ranked[:math.ceil(top * len(ranked))]
    return keep


def write_distill_dataset(run: str, g: int, iterations: range, top: float) -> int:
    """ALGO: the top `top` fraction (by total reward, ranked within each iteration: top_steps) of the
    generation's format-valid steps, read back from its trajectory files, copied with their
    screenshots. Returns how many were kept.
    Rebuilt only when the generation's iterations changed (a resumed run with more --iterations)."""
    out = os.path.join(run, "distill", f"gen{g}.jsonl")
    meta_path = os.path.join(run, "distill", f"gen{g}.meta.json")
    span = [iterations.start, iterations.stop]
    if os.path.exists(out) and os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta["iterations"] == span:
            return meta["kept"]
    steps = []
    for it in iterations:
        folder = os.path.join(run, "trajectories", f"it{it:06d}")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".jsonl"):
                with open(os.path.join(folder, name)) as fh:
                    steps += [dict(json.loads(line), folder=folder, iteration=it) for line in fh]
    valid = [s for s in steps if s.get("valid") and s.get("completion_ids") and s.get("screenshot")]
    keep = top_steps(valid, top)
    img_dir = os.path.join(run, "distill", f"gen{g}")
    shutil.rmtree(img_dir, ignore_errors=True)
    os.makedirs(img_dir)
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
        for k, s in enumerate(keep):
            name = f"{k:05d}.png"
            shutil.copyfile(os.path.join(s["folder"], s["screenshot"]), os.path.join(img_dir, name))
            fh.write(json.dumps({"image": f"gen{g}/{name}", "text": s["text"], "completion_ids": s["completion_ids"],
                                 "intent": s["intent"], "action": s["action"], "reward": s["reward"],
                                 "source": os.path.relpath(os.path.join(s["folder"], s["screenshot"]), run)}) + "\n")
    os.replace(tmp, out)
    with open(meta_path, "w") as fh:
        json.dump({"iterations": span, "kept": len(keep), "valid": len(valid), "steps": len(steps), "top": top}, fh)
    print(f"E{g}: distilled {len(keep)} of {len(valid)} format-valid steps ({len(steps)} in all) -> {out}", flush=True)
    return len(keep)


def finish_generation(run: str, g: int, first_iteration: int, last_iteration: int, policy, a: Args) -> None:
    """End of generation g: its model as models/E<g>, its best steps as distill/gen<g>.jsonl."""
    path = os.path.join(run, "models", f"E{g}")
    stamp = os.path.join(path, "LAST_ITERATION")
    if not (os.path.exists(stamp) and open(stamp).read().strip() == str(last_iteration)):
        save_model(policy, path, extra={"LAST_ITERATION": str(last_iteration)})
    if dist.is_main():
        write_distill_dataset(run, g, range(first_iteration, last_iteration + 1), a.distill_top)
    dist.barrier()  # every rank reads the dataset for the next generation's SFT


# -----------------------------------------------------------------------------------------------
# Exploration eval (--eval-only): diversity of what the policy reaches, next to random actions


def dhash(img: Image.Image) -> int:
    """ALGO: the screen's 64-bit perceptual hash (dHash): grayscale, box-averaged down to 9 x 8
    pixels; bit k (row by row, the first bit highest) = pixel k+1 of its row is brighter than pixel k.
    It sees layout (a window, a menu), not detail: typing in a terminal keeps the hash."""
    a = np.asarray(img.convert("L").resize((9, 8), Image.BOX), dtype=np.int16)  # (8, 9)
    bits = (a[:, 1:] > a[:, :-1]).ravel()  # (64,)
    return sum(1 << (63 - k) for k, b in enumerate(bits) if b)


def hash_leaders(hashes: list[int], max_bits: int) -> list[int]:
    """ALGO: greedy leader clustering by Hamming distance: a screen is new when its hash differs
    from every earlier leader's in more than `max_bits` bits. Returns the leaders' indices."""
    leaders = []
    for k, h in enumerate(hashes):
        if all((h ^ hashes[j]).bit_count() > max_bits for j in leaders):
            leaders.append(k)
    return leaders


def distinct_screens(feats: torch.Tensor, same: float) -> int:
    """ALGO: greedy leader clustering of unit feature rows (N, D): a screen is new when its cosine
    to every earlier cluster leader is below `same`. Returns the number of clusters."""
    leaders = []
    for row in feats:
        if not leaders or float((torch.stack(leaders) @ row).max()) < same:
            leaders.append(row)
    return len(leaders)


def pairwise_diversity(feats: torch.Tensor) -> float:
    """ALGO: mean of 1 - cos over all pairs p < q of unit feature rows (N, D); 0 with fewer than 2."""
    n = len(feats)
    if n < 2:
        return 0.0
    sim = feats @ feats.T  # (N, N) cosines (unit rows)
    iu = torch.triu_indices(n, n, offset=1)  # (2, N(N-1)/2) every pair once
    return float((1 - sim[iu[0], iu[1]]).mean())


def episode_metrics(steps: list[Step], windows: dict, a: Args) -> dict:
    """One eval episode (its steps in order): format rate, immediate visual change and sequence
    diversity per step (rewards.py's image terms, 0 on format failures); over its screens [s_0,
    s'_1, ..., s'_T]: distinct screens (perceptual hash, and feature clusters), the mean pairwise
    diversity of the distinct ones; windows = {X id: title} of the windows that appeared after some
    step and were not open at the start."""
    flags = R.parse_reward_flags("none,image,immediate,sequence")
    sb = R.screen_features([s.before for s in steps])  # (T, D)
    sa = R.screen_features([s.after for s in steps])  # (T, D)
    r = R.exploration_rewards(flags, [s.vm for s in steps], [s.parsed is not None for s in steps], sb, sa)
    screens = torch.cat([sb[:1], sa])  # (T + 1, D): s_0, s'_1 .. s'_T
    hashes = [dhash(im) for im in [steps[0].before] + [s.after for s in steps]]
    lead = hash_leaders(hashes, a.eval_same_hash)
    return {"vm": steps[0].vm, "steps": len(steps), "format": float(r.format.mean()),
            "immediate": float(r.image_immediate.mean()), "sequence": float(r.image_sequence.mean()),
            "distinct_screens": len(lead), "distinct_screens_feat": distinct_screens(screens, a.eval_same_screen),
            "diversity": pairwise_diversity(screens[lead]), "windows": len(windows),
            "window_titles": [windows[k] for k in sorted(windows)],
            "hashes": [f"{h:016x}" for h in hashes], "actions": [eval_line(s) for s in steps]}


def eval_line(s: Step) -> dict:
    """What one eval step did: the answer, the action it ran (screen pixels; None = a format failure,
    nothing ran) and the VM's refusal if any. Also a line of the eval's trajectory files."""
    return {"step": s.t, "intent": s.parsed.thought if s.parsed else None,
            "action": s.parsed.action.to_dict() if s.parsed else None, "valid": s.parsed is not None,
            "error": s.error, "text": s.text, "screen": list(s.before.size)}


def eval_episode(desk: rollout.Desktop, a: Args):
    """One eval episode (a generator for rollout.run): reset, --steps steps, the windows opened.
    -> (its steps, {X window id: title} of the windows it opened)."""
    steps, windows = [], {}
    yield from explore(desk, a.steps, parse_settle(a.settle), steps, reset=True, windows=windows, reset_after=True)
    return steps, windows


def run_eval(pool: VMPool, choosers: dict, a: Args, run: str, first: int = 0) -> dict:
    """--eval-episodes episodes of --steps steps (each on a freshly reset desktop; a desktop that
    finishes one starts the next) for each chooser (policy, random baseline); writes
    runs/<name>/eval.json (per episode its metrics and every step's action), prints a table. An
    episode the environment failed is played once more on another desktop (`lost` if that fails
    too). With --eval-save each episode is also saved as a trajectory (screenshots + one line per
    step): this rank's episode k in trajectories/it<k // desktops>/vm<first + k % desktops>.jsonl
    (the policy's; the baseline's under runs/<name>/random/), so `python view.py runs/<name>` shows
    them. Under torchrun each rank plays its share of the episodes on its desktops; rank 0 reports
    them all."""
    want = len(dist.shard_range(a.eval_episodes))
    report = {"args": asdict(a), "same_screen_hash_bits": a.eval_same_hash, "same_screen_cosine": a.eval_same_screen}
    for name, choose in choosers.items():
        out = rollout.run(pool, [partial(eval_episode, a=a)] * want, choose, retries=1,
                          desktops=rollout.in_service(pool), desc=f"eval {name}")
        episodes = []
        for k, result in enumerate(out.results):
            if isinstance(result, rollout.Lost):
                continue
            steps, windows = result
            e = episode_metrics(steps, windows, a)
            e["round"], slot = divmod(k, pool.size)
            if a.eval_save:
                rundir.save_trajectory(run if name == "policy" else os.path.join(run, name), e["round"], first + slot,
                                       e["actions"], [s.before for s in steps])
            e["vm"] += first
            episodes.append(e)
        lost = int(dist.all_sum([want - len(episodes)])[0])
        episodes = [e for part in dist.gather(episodes) for e in part]  # every rank's, in rank order
        keys = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "diversity", "windows")
        summary = {k: float(np.mean([e[k] for e in episodes])) if episodes else None for k in keys}
        # Across episodes too: does the agent reach different screens in different episodes?
        summary["distinct_screens_all"] = len(hash_leaders([int(h, 16) for e in episodes for h in e["hashes"]],
                                                           a.eval_same_hash))
        summary["episodes"], summary["lost"] = len(episodes), lost
        report[name] = {"summary": summary, "episodes": episodes}
    if not dist.is_main():
        return report
    path = os.path.join(run, "eval.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    cols = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "distinct_screens_all",
            "diversity", "windows", "episodes")
    heads = ("format", "immediate", "sequence", "screens/ep", "feat scr/ep", "screens all", "diversity", "windows/ep",
             "episodes")
    print(f"{'':8s}" + "".join(f"{h:>12s}" for h in heads))
    for name in choosers:
        s = report[name]["summary"]
        print(f"{name:8s}" + "".join(f"{'-' if s[c] is None else format(s[c], '.3f'):>12s}" for c in cols))
    print(f"eval report: {path} (screens: 64-bit dHash, <= {a.eval_same_hash} bits apart = one screen)", flush=True)
    return report


# -----------------------------------------------------------------------------------------------
# Setup (plumbing): the learner's state, from scratch or from a checkpoint


@dataclass
class Learner:
    """What the iterations update: the generation's policy, its optimizer and KL reference, the
    world model, and the reward terms that are on."""
    policy: object
    optimizer: torch.optim.Optimizer
    start_model: str  # the generation's starting model: LoRA's base and the KL reference
    ref_fn: object  # full fine-tuning's frozen reference (reference_fn), or None
    generation: int
    wm: R.WorldModel
    wm_opt: torch.optim.Optimizer
    flags: dict  # reward components on (rewards.effective_flags)
    tools: object  # OCR + embedder, or None
    first: int = 0  # under torchrun: the index of this rank's first VM among all ranks' VMs


def setup(args: Args, run: str, ckpt, screen, first: int) -> tuple:
    """-> (Learner, the first iteration to run, SFT metrics of a generation's start, logged once)."""
    # Text tools (OCR + embedder) only when a text/intent term is on; without them those terms
    # are off (said once) and the world model has no text branch.
    want = R.parse_reward_flags(args.rewards)
    tools = R.load_text_tools() if R.needs_text(want) else None
    flags = R.effective_flags(want, tools)
    print("reward components on: " + ", ".join(k for k, v in flags.items() if v), flush=True)
    wm = R.WorldModel(R.SCREEN_DIM, tools.dim if (tools and flags["text"]) else 0, args.wm_hidden, screen)
    wm_opt = adamw(wm.parameters(), args.wm_lr)
    if ckpt is None:
        policy, start_model, distill_metrics = start_generation(1, run, args)
        dist.spread(policy.model, shard=args.lora_rank == 0)  # torchrun: rank 0's weights; full FT: FSDP2
        generation, start, optimizer = 1, 0, adamw(trainable(policy), args.lr)
    else:
        state, folder = ckpt
        policy = rundir.restore_policy(state, folder, lambda name: load(name, args))
        dist.spread(policy.model, shard=args.lora_rank == 0)
        optimizer = adamw(trainable(policy), args.lr)
        try:
            wm.load_state_dict(state["wm"])
        except RuntimeError:
            sys.exit("The checkpoint's world model does not fit these reward flags / text tools; resume with the "
                     "run's own --rewards and the same OCR + embedder installed.")
        wm_opt.load_state_dict(state["wm_opt"])
        start = rundir.resume(run, ckpt, policy, optimizer)  # optimizer, metrics.jsonl and RNG states
        generation, start_model, distill_metrics = state["generation"], state["start_model"], {}
        print(f"resumed {run} at iteration {start} (generation E{generation})", flush=True)
    if args.engine == "vllm":  # GPU only: one screenshot and one answer per prompt
        import vllm_engine
        vllm_engine.attach(policy, 1, args.max_new_tokens)
    learner = Learner(policy, optimizer, start_model, reference_fn(start_model, args), generation, wm, wm_opt,
                      flags, tools, first)
    dist.seed_ranks(args.seed + start)  # under torchrun: each rank samples its own answers
    return learner, start, distill_metrics


def evaluate(pool: VMPool, args: Args, ckpt, first: int = 0) -> dict:
    """--eval-only: the policy (--model, or with --resume the run's checkpoint) next to random
    actions. Writes a run folder of its own (eval-<time>), or with --resume runs/<name>/eval_it<N>/
    (N = the checkpoint's next iteration; a second eval of the same checkpoint replaces the first)."""
    if ckpt is not None:
        run = os.path.join(args.resume, f"eval_it{rundir.next_iteration(ckpt[0]):06d}")
        if dist.is_main():
            shutil.rmtree(run, ignore_errors=True)
    else:
        run = rundir.run_path(args.runs_dir, args.run_name, prefix="eval-")
    with rundir.new_run(run):  # a failed setup leaves no folder behind
        rundir.make_run_dir(run, args)
        print(f"run folder: {run}", flush=True)
        rundir.seed_all(args.seed)
        policy = (rundir.restore_policy(*ckpt, lambda name: load(name, args)) if ckpt is not None
                  else load(args.model, args, lora=False))
        dist.seed_ranks(args.seed)
        if args.engine == "vllm":  # GPU only: one screenshot and one answer per prompt
            import vllm_engine
            vllm_engine.attach(policy, 1, args.max_new_tokens)
    choosers = {"policy": policy_chooser(policy, args)}
    if args.eval_random:
        choosers["random"] = random_chooser(random.Random(args.seed))
    return run_eval(pool, choosers, args, run, first)


def next_generation(L: Learner, run: str, it: int, ipg: int, args: Args) -> dict:
    """ALGO: experience-stream distillation at a generation boundary: the finished generation's
    model and best steps are saved, and the next one starts from the BASE model fine-tuned on every
    distilled step so far, with a fresh optimizer. -> the SFT metrics."""
    finish_generation(run, L.generation, (L.generation - 1) * ipg, it - 1, L.policy, args)
    engine = L.policy.engine
    L.generation = it // ipg + 1
    L.policy, L.start_model, metrics = start_generation(L.generation, run, args)
    dist.spread(L.policy.model, shard=args.lora_rank == 0)
    L.policy.engine = engine
    sync_weights(L.policy)
    L.optimizer = adamw(trainable(L.policy), args.lr)
    L.ref_fn = reference_fn(L.start_model, args)
    return metrics


def trajectory_lines(buffer: list[Step], rows: list[int], r, adv) -> list[dict]:
    """One JSON line per step of one desktop: what it saw (the PNG), said, did, and earned."""
    comps = {name: getattr(r, name) for name in ("format",) + R.COMPONENTS}
    return [{"step": buffer[k].t, "intent": buffer[k].parsed.thought if buffer[k].parsed else None,
             "action": buffer[k].parsed.action.to_dict() if buffer[k].parsed else None,
             "valid": buffer[k].parsed is not None, "error": buffer[k].error, "text": buffer[k].text,
             "completion_ids": buffer[k].gen.completion_ids, "image_size": list(buffer[k].gen.prompt.image_sizes[0]),
             "screen": list(buffer[k].before.size), "reward": float(r.total[k]), "advantage": float(adv[k]),
             "rewards": {n: float(c[k]) for n, c in comps.items()}} for k in rows]



def save_trajectories(run: str, it: int, buffer: list[Step], r, adv, first: int = 0) -> None:
    """This rank's desktops' steps; VMs are numbered among all ranks' (this rank's first is `first`)."""
    for vm in sorted({s.vm for s in buffer}):
        rows = [k for k, s in enumerate(buffer) if s.vm == vm]
        rundir.save_trajectory(run, it, first + vm, trajectory_lines(buffer, rows, r, adv), [buffer[k].before for k in rows])


# -----------------------------------------------------------------------------------------------
# One iteration's learning, then the loop, top to bottom

ACTOR_KEYS = ("actor/loss", "actor/kl", "actor/clip_low", "actor/clip_high", "actor/grad_norm", "actor/lr")


def learn(L: Learner, buffer: list[Step], it: int, args: Args, times: dict) -> tuple:
    """Rewards, advantages and the GRPO update of one iteration's buffer.
    -> (rewards.Rewards, advantages (N,), the iteration's metrics)."""
    # rewards: features, the world model's guesses and update, every component (N,) each
    r, wm_metrics = score(buffer, L, args, times, it)
    # ALGO: GRPO with the whole buffer as ONE group: each step's reward against every step's, on
    # every rank (torchrun: the ranks' buffers together, in rank order; each trains its own steps)
    # (The sampler's log-probs ride along only so the update can log actor/logp_gap, how far
    # they are from the trainer's own: the update recomputes its old log-probs.)
    samples = [grpo.step_sample(s.gen.prompt, s.gen.completion_ids, float(r.total[k]), group=0,
                                old_logps=s.gen.logprobs) for k, s in enumerate(buffer)]
    parts = dist.gather((r, len({s.vm for s in buffer})))  # every rank's Rewards and desktops, rank order
    r_all = R.Rewards(**{n: torch.cat([getattr(p, n) for p, _ in parts]) for n in r.__dataclass_fields__})  # (N_all,) each
    adv_all = grpo.group_advantages(r_all.total)  # (N_all,)
    start = sum(len(p.total) for p, _ in parts[:dist.rank()])
    adv = adv_all[start:start + len(buffer)]  # (N,)
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    actor = dict.fromkeys(ACTOR_KEYS)
    # The delay lets the world model warm up before its curiosity steers the actor. It is the
    # ONLY condition: the release also skipped the update whenever the world model was off, so
    # its no-world-model ablation never trained at all.
    updated = it >= args.update_actor_delay
    if updated:
        actor["actor/lr"] = rundir.set_lr(L.optimizer, actor_lr(it, args))
        with rundir.timed(times, "update"), progress.bar(len(samples), "update") as pb:
            m = grpo.update_policy(L.policy, L.optimizer, samples, args.micro_batch, args.eps_low, args.eps_high,
                                   args.beta, L.ref_fn, args.max_grad_norm, mini_batch_size=args.mini_batch,
                                   on_micro_batch=pb.update, temperature=args.temperature,
                                   shuffle=random.Random(f"{args.seed}-update-{it}"))
            actor.update({f"actor/{k}": v for k, v in m.items()})
        with rundir.timed(times, "sync"):
            sync_weights(L.policy)  # the generator samples the next iteration from the new weights
    metrics = {"vms": sum(n for _, n in parts), "steps": len(r_all.total), **R.summarize_rewards(r_all), **wm_metrics,
               "actor/updated": int(updated), **actor, "adv/std": float(adv_all.std()) if len(adv_all) > 1 else 0.0}
    return r, adv, metrics


def train(pool: VMPool, live: set, L: Learner, args: Args, run: str, start: int, distill_metrics: dict) -> None:
    ipg = args.iterations_per_generation or args.iterations  # iterations per generation
    total = args.generations * ipg
    trackers = rundir.open_trackers(run, args)
    reset_next = False
    for it in progress.track(range(start, total), "iterations"):
        t0, times = time.perf_counter(), {}
        if it // ipg + 1 != L.generation:  # a generation boundary (also right after resuming at one)
            with rundir.timed(times, "distill"):
                distill_metrics = next_generation(L, run, it, ipg, args)
        # A reset iteration plays on every desktop in service (a dead one restarts in its thread),
        # the others on those that did not fail since (their screens go on from the last iteration).
        fresh = it == start or reset_next or (args.reset_every and it % args.reset_every == 0)
        if fresh:
            with rundir.timed(times, "vm_wait"):  # re-checks down remote VMs
                live = set(rollout.in_service(pool))
        rundir.clear_trajectories(run, it)
        # rollout: --steps steps on every live desktop, each on its own, generation batched (rollout.py)
        with dist.unsharded(L.policy.model):  # FSDP2: each rank decodes alone, with whole weights
            # the next iteration resets: its resets run during this one's update (reset_ahead)
            ahead = bool(args.reset_every) and (it + 1) % args.reset_every == 0 and it + 1 < total
            buffer, out = play(pool, live, policy_chooser(L.policy, args), args, reset=bool(fresh), reset_after=ahead)
        for k, v in out.times.items():
            times[k] = times.get(k, 0.0) + v
        live -= {f.vm for f in out.failures}  # out until the next reset
        reset_next = not buffer
        if not buffer and dist.size() == 1:
            print(f"it {it}: no desktop answered; resetting them and going on.", flush=True)
            continue
        parts = dist.gather((len(out.failures), out.settles))  # every rank's
        failures, settles = sum(n for n, _ in parts), [s for _, ss in parts for s in ss]
        r, adv, metrics = learn(L, buffer, it, args, times)
        metrics = {"iteration": it, "generation": L.generation, **metrics, "env_failures": failures,
                   "rollout/batches": len(out.batches), "rollout/batch_mean": float(np.mean(out.batches or [0])),
                   **rollout.settle_metrics(settles),
                   **distill_metrics}
        distill_metrics = {}
        with rundir.timed(times, "save"):  # trajectories, checkpoint, then the metrics line: see rundir.py
            save_trajectories(run, it, buffer, r, adv, L.first)
            # Always at a generation's last iteration: the boundary (dataset, SFT) is redone from it.
            if (it + 1) % args.ckpt_every == 0 or (it + 1) % ipg == 0 or it + 1 == total:
                line = {**metrics, **rundir.gather_times({**times, "time/iteration": time.perf_counter() - t0})}
                rundir.save(run, L.policy, L.optimizer, it + 1, args, line, start_model=L.start_model,
                            generation=L.generation, wm=L.wm.state_dict(), wm_opt=L.wm_opt.state_dict(),
                            wm_config=L.wm.config)
        metrics.update(rundir.gather_times({**times, "time/iteration": time.perf_counter() - t0}))
        rundir.end_iteration(run, trackers, metrics, console_line(metrics))
    finish_generation(run, L.generation, (L.generation - 1) * ipg, total - 1, L.policy, args)
    progress.close(trackers)
    print(f"done: {run}", flush=True)


def main(argv=None) -> None:
    dist.init()  # torchrun: join the other ranks (one process: nothing)
    dist.mute_others()
    args, ckpt = resolve_args(argv)
    transformers.utils.logging.disable_progress_bar()  # one console line per iteration, not bars
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if args.threads > 0 or not (args.device.startswith("cuda") or (not args.device and torch.cuda.is_available())):
        # OpenMP threads spin while they wait; next to Xvfb desktops and tesseract on the same cores
        # the default (every core) ran our tiny-model steps 10x slower than one thread did.
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    # The desktops first: an unreachable VM should leave no run folder behind.
    pool, live, screen, first = rundir.open_desktops(args.vms, args.token, args.vm_timeout)
    try:
        if args.eval_only:
            evaluate(pool, args, ckpt, first)
            return
        run = args.resume or rundir.run_path(args.runs_dir, args.run_name)
        with rundir.new_run(run):  # a failed setup (bad --model, ...) leaves no folder behind
            rundir.make_run_dir(run, args, resume=bool(args.resume))
            print(f"run folder: {run}", flush=True)
            rundir.seed_all(args.seed)
            learner, start, distill_metrics = setup(args, run, ckpt, screen, first)
        train(pool, live, learner, args, run, start, distill_metrics)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
