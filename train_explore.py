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

Paper: ScreenExplorer (arXiv 2505.19095). One iteration, top to bottom (see DESIGN.md):
    for step in range(--steps): screenshots of every live desktop (parallel) -> exploration prompts
        -> ONE batched generate -> parse {"intent", "action"} -> actions on every desktop (parallel)
        -> after-screenshots
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
4. A desktop that dies drops out of the rest of the iteration (its unfinished step is not in the
   buffer: the environment failed, not the model) and a reset restarts it; the release threw the
   whole iteration away when any environment failed.
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
   asked for and installed (progress.py). Left out: multi-GPU (torchrun), mixed-precision autocast
   (bf16 weights on GPU instead).
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import transformers
from PIL import Image

import grpo
import model as M
import rewards as R
import progress
import rundir
from actions import Action, Parsed, cursor_after, parse_action
from env import VMPool

# -----------------------------------------------------------------------------------------------
# Args


@dataclass
class Args:
    vms: str = field(default="8", metadata={"help": "N local Xvfb desktops, or comma-separated vm_server.py URLs"})
    token: str = field(default="", metadata={"help": "bearer token of remote VMs (or VM_TOKEN); local desktops make their own"})
    model: str = field(default="Qwen/Qwen2.5-VL-3B-Instruct", metadata={"help": "HF id, a local checkpoint folder, or 'tiny' (random weights, CPU)"})
    engine: str = field(default="hf", metadata={"help": "generation engine: hf (transformers generate) or vllm (GPU)"})
    device: str = field(default="", metadata={"help": "torch device; empty = cuda if available else cpu"})
    lora_rank: int = field(default=64, metadata={"help": "LoRA rank (paper: 64); 0 = full fine-tuning"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (paper: 16)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "trade compute for memory in the policy update"})
    max_pixels: int = field(default=1280 * 28 * 28, metadata={"help": "screenshot size cap for the model, in pixels of the resized image"})
    min_pixels: int = field(default=4 * 28 * 28, metadata={"help": "screenshot size floor for the model, in pixels of the resized image"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = half the cores (the desktops and OCR need the rest)"})
    # rollout
    steps: int = field(default=10, metadata={"help": "steps per episode (one episode per desktop per iteration)"})
    iterations: int = field(default=100, metadata={"help": "training iterations (per generation when --generations > 1 and --iterations-per-generation is 0)"})
    reset_every: int = field(default=1, metadata={"help": "iterations between desktop resets (0 = only at start); a reset restarts dead local desktops"})
    settle: float = field(default=1.0, metadata={"help": "seconds to wait after the actions before the after-screenshots"})
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
    eval_only: bool = field(default=False, metadata={"help": "run the policy without training and report exploration diversity"})
    eval_episodes: int = field(default=20, metadata={"help": "episodes for --eval-only (spread over the desktops)"})
    eval_random: bool = field(default=True, metadata={"help": "also run a random-action baseline on the same desktops"})
    eval_save: bool = field(default=True, metadata={"help": "save every eval episode as a trajectory (screenshots + steps; view.py shows them)"})
    eval_same_hash: int = field(default=2, metadata={"help": "screens whose 64-bit perceptual hashes (dHash) differ in at most this many bits count as one"})
    eval_same_screen: float = field(default=0.95, metadata={"help": "the feature count of distinct screens: cosine >= this = the same screen"})
    # run
    run_name: str = field(default="", metadata={"help": "folder under --runs-dir; empty = a timestamp"})
    runs_dir: str = field(default="runs", metadata={"help": "where run folders go"})
    resume: str = field(default="", metadata={"help": "a run folder to continue (flags given now override its args.json)"})
    save_every: int = field(default=1, metadata={"help": "iterations between checkpoints (generation ends always save)"})
    wandb: bool = field(default=False, metadata={"help": "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names the project)"})
    tensorboard: bool = field(default=False, metadata={"help": "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)"})
    seed: int = field(default=0, metadata={"help": "random seed"})


ALIASES = {"eval_episodes": ["--episodes"]}  # issue 4 spells it `--eval-only --episodes 20`


def parse_args(argv=None) -> tuple[Args, set]:
    """Args from the command line, one flag per field; also the set of flags given explicitly."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(flag, *ALIASES.get(f.name, ()), type=kind, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{f.metadata['help']} (default: {f.default})")
    # argparse's own error is a usage block and exit code 2; we want one sentence.
    p.error = lambda msg: sys.exit(f"train_explore.py: {msg}; see --help for the flags.")
    given = vars(p.parse_args(argv))
    return Args(**given), set(given)


def check_args(a: Args) -> None:
    """Refuse, in one sentence, anything that would only fail later."""
    problems = [
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
        (a.eval_episodes < 1, "--eval-episodes (--episodes) must be at least 1"),
        (not 0 <= a.eval_same_hash < 64, "--eval-same-hash must be in 0..63 (bits of a 64-bit hash)"),
        (a.lora_rank < 0 or a.beta < 0, "--lora-rank and --beta must be >= 0"),
        (a.eval_only and bool(a.resume), "--eval-only evaluates --model; pass --model runs/<name>/models/E<g> (or .../ckpt/policy) instead of --resume"),
        (a.engine == "vllm" and a.beta > 0 and a.lora_rank == 0, "--engine vllm with full fine-tuning and --beta > 0 would hold three model copies; use LoRA or --beta 0"),
    ]
    for bad, msg in problems:
        if bad:
            sys.exit(f"train_explore.py: {msg}.")
    try:
        R.parse_reward_flags(a.rewards)
    except ValueError as e:
        sys.exit(f"--rewards: {e}")


def resolve_args(argv=None) -> Args:
    """Parse and check; on --resume, the run's own args.json with the flags typed now on top."""
    args, given = parse_args(argv)
    check_args(args)
    if args.resume and not args.eval_only:
        try:
            with open(os.path.join(args.resume, "args.json")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            sys.exit(f"--resume {args.resume}: no readable args.json there; pass a run folder this script wrote.")
        if not isinstance(saved, dict) or "wm_epochs" not in saved:  # an ARPO run has no world model
            sys.exit(f"--resume {args.resume}: that is not a train_explore.py run (train_arpo.py's?); resume it "
                     "with the script that wrote it.")
        args = Args(**{**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__},
                       **{k: getattr(args, k) for k in given}})
        check_args(args)
    return args


# -----------------------------------------------------------------------------------------------
# Small plumbing: timers, the one console line


@contextmanager
def timed(times: dict, key: str):
    """Add the block's wall time to times["time/<key>"] (phases repeat once per step)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[f"time/{key}"] = times.get(f"time/{key}", 0.0) + time.perf_counter() - t0


def console_line(m: dict) -> str:
    """The iteration's summary: reward components as image/text imm/seq/wm and intent before/after/click."""
    f = lambda k, fmt="{:.3f}": "-" if m.get(k) is None else fmt.format(m[k])  # noqa: E731
    return (f"it {m['iteration']:4d} E{m['generation']} | vms {m['vms']} steps {m['steps']} | "
            f"reward {f('reward/total')} fmt {f('reward/format', '{:.2f}')} "
            f"img {f('reward/image_immediate')}/{f('reward/image_sequence')}/{f('reward/image_world_model')} "
            f"txt {f('reward/text_immediate')}/{f('reward/text_sequence')}/{f('reward/text_world_model')} "
            f"intent {f('reward/intent_before')}/{f('reward/intent_after')}/{f('reward/intent_click')} | "
            f"wm {f('wm/loss', '{:.4f}')} | kl {f('actor/kl', '{:.4f}')} clip {f('actor/clip_low', '{:.2f}')}/{f('actor/clip_high', '{:.2f}')} | "
            f"{m['time/iteration']:.1f}s (gen {m.get('time/generate', 0):.1f} "
            f"vm {m.get('time/screenshot', 0) + m.get('time/act', 0):.1f} "
            f"feat {m.get('time/features', 0):.1f} upd {m.get('time/update', 0):.1f})")


# -----------------------------------------------------------------------------------------------
# Rollout: --steps lockstep steps on every live desktop. Shapes in the buffer: N = live VMs x steps.


@dataclass
class Step:
    """One step of one desktop: what the model saw, said and did, and what came of it."""
    vm: int
    t: int
    before: Image.Image  # the screenshot the model saw (screen pixels)
    after: Image.Image  # the screen --settle seconds after the action
    text: str  # the model's answer (or the random baseline's action string)
    parsed: object  # env.Parsed, or None: a format failure, nothing was executed
    gen: object = None  # model.Generation (prompt + sampled ids), None for the random baseline
    error: str | None = None  # the VM rejected the action (4xx): counts as a format failure


def policy_chooser(policy, a: Args):
    """(images, pointers) -> [(text, Parsed | None, Generation)] with ONE batched generate for all
    desktops. A pointer is where that desktop's mouse is: DragTo(x, y) drags from there."""
    def choose(images, cursors):
        gens = M.generate(policy, [M.explore_messages(im) for im in images], a.max_new_tokens, a.temperature,
                          a.top_p)
        # Coordinates are in the resized image the model saw; parse_action maps them to the screen.
        return [(g.text, parse_action(g.text, "explore", im.size, g.prompt.image_sizes[0], cursor=c), g)
                for g, im, c in zip(gens, images, cursors)]
    return choose


def random_chooser(rng: random.Random):
    """The eval baseline: uniformly random pointer actions anywhere on the screen."""
    kinds = ("click", "double_click", "right_click", "move", "scroll")

    def choose(images, cursors=None):
        out = []
        for im in images:
            kind = rng.choice(kinds)
            act = Action(kind, x=rng.randrange(im.width), y=rng.randrange(im.height),
                         direction=rng.choice(("up", "down")) if kind == "scroll" else None)
            out.append((json.dumps(act.to_dict()), Parsed(act, ""), None))
        return out
    return choose


def rollout(pool: VMPool, live: set, choose, a: Args, times: dict, watch=None) -> list[Step]:
    """Steps in time order (t, then vm). A VM that fails a screenshot or dies mid-action leaves the
    rest of this iteration (and `live`); a VM that only rejects an action stays in.
    watch(vms), if given, is called after every step with the VMs still in (the eval's window check)."""
    with timed(times, "screenshot"):
        shots = pool.map("screenshot", ["png" if i in live else None for i in range(pool.size)])
    current = {i: r.value for i, r in enumerate(shots) if i in live and r.ok and r.value is not None}
    live.intersection_update(current)
    # Each desktop's mouse, for DragTo: /reset leaves it at the centre (the eval resets before each
    # episode, training every --reset-every iterations; between resets this is an approximation).
    cursor = {i: (im.width // 2, im.height // 2) for i, im in current.items()}
    buffer = []
    for t in progress.track(range(a.steps), "rollout"):
        vms = sorted(current)
        if not vms:
            break
        with timed(times, "generate"):
            # One call for all desktops: on a GPU a batch of 8 costs about what one prompt does.
            choices = choose([current[i] for i in vms], [cursor[i] for i in vms])
        actions = [None] * pool.size
        for i, (_, parsed, _) in zip(vms, choices):
            actions[i] = parsed.action if parsed else None  # a format failure executes nothing
        with timed(times, "act"):
            done = pool.act(actions)
            if any(x is not None for x in actions):
                time.sleep(a.settle)  # let the screen react (menus open, windows map)
        with timed(times, "screenshot"):
            after = pool.map("screenshot", ["png" if i in current else None for i in range(pool.size)])
        for i, (text, parsed, gen) in zip(vms, choices):
            error = None
            if actions[i] is not None and not done[i].ok:
                if not pool.alive[i]:  # unreachable: the environment failed, not the model
                    print(f"vm {i} dropped out: {done[i].error}", flush=True)
                    current.pop(i), live.discard(i)
                    continue
                error = done[i].error  # the VM refused the action (bad key name, ...)
            if not after[i].ok or after[i].value is None:
                print(f"vm {i} dropped out: {after[i].error}", flush=True)
                current.pop(i), live.discard(i)
                continue
            # The step is kept even when malformed: its reward is 0, and below the buffer's mean
            # that is a negative advantage, which is how GRPO teaches the format.
            buffer.append(Step(i, t, current[i], after[i].value, text, None if error else parsed, gen, error))
            current[i] = after[i].value  # the after-screen is the next step's before-screen
            if error is None:
                cursor[i] = cursor_after(parsed.action if parsed else None, cursor[i])
        if watch is not None and current:
            watch(sorted(current))
    return buffer


# -----------------------------------------------------------------------------------------------
# Rewards: features, the world model's update, every component (rewards.py does the math)


def score(buffer: list[Step], flags: dict, tools, wm, wm_opt, a: Args, times: dict):
    """-> (rewards.Rewards over the buffer, each (N,), and the world model's metrics).

    Only format-valid steps are featurised, learned from and scored: a malformed answer executed
    nothing, so every one of its components is 0 anyway, and skipping it saves its OCR (the
    costliest part of the rewards, ~0.5-1 s per screen per core)."""
    n = len(buffer)
    rows = [k for k, s in enumerate(buffer) if s.parsed is not None]
    full = R.Rewards(**{f.name: torch.zeros(n) for f in fields(R.Rewards)})  # (N,) each
    wm_metrics = {"wm/loss": None, "wm/loss_first_epoch": None}
    if not rows:
        return full, wm_metrics
    steps = [buffer[k] for k in rows]
    actions = [s.parsed.action for s in steps]
    with timed(times, "features"):
        f = R.step_features([s.before for s in steps], [s.after for s in steps], [s.parsed.thought for s in steps],
                            actions, tools if R.needs_text(flags) else None)
    pred_s = pred_t = None
    if flags["world_model"]:
        with timed(times, "world_model"):
            # ALGO: curiosity is the surprise of the world model as it stood before this buffer;
            # then it learns the buffer (--wm-train-first: the release's order, the other way round).
            pred_s, pred_t, wm_metrics = R.update_and_predict(wm, wm_opt, f, actions, [1] * len(steps), a.wm_epochs,
                                                              a.wm_batch_size, a.wm_train_first)  # (V, D), (V, E)
    with timed(times, "rewards"):
        r = R.exploration_rewards(flags, [s.vm for s in steps], [1] * len(steps), f.screen_before, f.screen_after,
                                  pred_s, f.text_before, f.text_after, pred_t, f.intent, f.click_text, f.click_hit)
    for name in full.__dataclass_fields__:
        getattr(full, name)[rows] = getattr(r, name)  # (V,) into (N,); malformed steps stay 0
    return full, wm_metrics


# -----------------------------------------------------------------------------------------------
# The policy of a generation: load, distill (SFT), checkpoint round trip


def load(name: str, a: Args, lora: bool = True):
    return M.load_policy(name, lora_rank=a.lora_rank if lora else 0, lora_alpha=a.lora_alpha,
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
    """The actor's learning rate at iteration `it` (0-based, over the whole run). Within each
    generation (each has its own optimizer), u = the generation's actor updates before this one out
    of its n (the first generation's first update is at --update-actor-delay): a linear warm-up
    over the first --lr-warmup updates (lr * (u + 1) / warmup), then --lr-schedule over the rest,
    towards 0 at the generation's last iteration but never 0 there (the last update still learns):
        linear: lr * (1 - f),  cosine: lr * (1 + cos(pi f)) / 2,  f = (u - warmup) / (n - warmup).
    A function of the iteration alone, so a resumed run continues the schedule where it stopped.
    The paper trains at a constant lr (the default); a small model trained from scratch at a high
    lr moves fast early and needs the decay to keep what it learned by the last iteration, which is
    the model a generation hands on (models/E<g>)."""
    ipg = a.iterations_per_generation or a.iterations
    start = it - it % ipg  # the generation's first iteration
    first = max(start, a.update_actor_delay)  # its first actor update
    u, n = it - first, start + ipg - first  # (update index, updates in the generation)
    if u < 0:  # no update this iteration: nothing to schedule
        return a.lr
    if u < a.lr_warmup:
        return a.lr * (u + 1) / a.lr_warmup
    if a.lr_schedule == "constant":
        return a.lr
    f = (u - a.lr_warmup) / max(1, n - a.lr_warmup)  # 0 at the first update after the warm-up, < 1 at the last
    return a.lr * (1 - f) if a.lr_schedule == "linear" else a.lr * 0.5 * (1 + math.cos(math.pi * f))


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
                    enc = M.encode_chat(policy, M.explore_messages(im.convert("RGB")))
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
    """save_policy into a temp folder, then rename: a model folder is either complete or absent."""
    tmp = path + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_policy(policy, tmp)
    for name, text in (extra or {}).items():
        with open(os.path.join(tmp, name), "w") as fh:
            fh.write(text)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def reference_fn(start_model: str, a: Args):
    """KL reference for full fine-tuning: a frozen copy of the generation's starting model.
    (LoRA needs none: update_policy switches the adapter off.)"""
    if a.beta == 0 or a.lora_rank > 0:
        return None
    ref = load(start_model, a, lora=False)
    ref.model.eval().requires_grad_(False)
    return lambda batch: grpo.per_token_logps(ref.model, batch)  # (B, T)


def adapter_state(policy):
    from peft import get_peft_model_state_dict
    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy.model).items()}


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
    write_distill_dataset(run, g, range(first_iteration, last_iteration + 1), a.distill_top)


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


def open_windows(pool: VMPool, vms: list[int]) -> dict:
    """{vm: {X window id: title}} of the application windows open now (GET /windows)."""
    res = pool.windows()
    return {i: {w["id"]: w["title"] for w in res[i].value} if res[i].ok else {} for i in vms}


def episode_metrics(buffer: list[Step], windows: dict, a: Args) -> list[dict]:
    """Per desktop trajectory: format rate, immediate visual change and sequence diversity per step
    (rewards.py's image terms, 0 on format failures); over its screens [s_0, s'_1, ..., s'_T]:
    distinct screens (perceptual hash, and feature clusters), the mean pairwise diversity of the
    distinct ones; windows = windows (X ids) that appeared after some step and were not open at
    the start. windows: {vm: {id: title}} of those."""
    if not buffer:
        return []
    flags = R.parse_reward_flags("none,image,immediate,sequence")
    sb = R.screen_features([s.before for s in buffer])  # (N, D)
    sa = R.screen_features([s.after for s in buffer])  # (N, D)
    r = R.exploration_rewards(flags, [s.vm for s in buffer], [s.parsed is not None for s in buffer], sb, sa)
    out = []
    for vm in sorted({s.vm for s in buffer}):
        rows = [k for k, s in enumerate(buffer) if s.vm == vm]
        screens = torch.cat([sb[rows[:1]], sa[rows]])  # (T + 1, D): s_0, s'_1 .. s'_T
        hashes = [dhash(im) for im in [buffer[rows[0]].before] + [buffer[k].after for k in rows]]
        lead = hash_leaders(hashes, a.eval_same_hash)
        win = windows.get(vm, {})
        out.append({"vm": vm, "steps": len(rows), "format": float(r.format[rows].mean()),
                    "immediate": float(r.image_immediate[rows].mean()), "sequence": float(r.image_sequence[rows].mean()),
                    "distinct_screens": len(lead), "distinct_screens_feat": distinct_screens(screens, a.eval_same_screen),
                    "diversity": pairwise_diversity(screens[lead]), "windows": len(win),
                    "window_titles": [win[k] for k in sorted(win)],
                    "hashes": [f"{h:016x}" for h in hashes], "actions": [eval_line(buffer[k]) for k in rows]})
    return out


def eval_line(s: Step) -> dict:
    """What one eval step did: the answer, the action it ran (screen pixels; None = a format failure,
    nothing ran) and the VM's refusal if any. Also a line of the eval's trajectory files."""
    return {"step": s.t, "intent": s.parsed.thought if s.parsed else None,
            "action": s.parsed.action.to_dict() if s.parsed else None, "valid": s.parsed is not None,
            "error": s.error, "text": s.text, "screen": list(s.before.size)}


def eval_episodes(pool: VMPool, vms: list[int], choose, a: Args) -> tuple[list[dict], list[Step]]:
    """One episode of --steps on each of `vms` (just reset), with the open windows after every step.
    -> (episode_metrics of each desktop's episode, the steps)."""
    start = open_windows(pool, vms)  # open before the first action: not "opened" by the agent
    seen = {i: {} for i in vms}  # vm -> {window id: its title when first seen}

    def watch(now: list[int]):
        for i, wins in open_windows(pool, now).items():
            seen[i].update({k: t for k, t in wins.items() if k not in start[i] and k not in seen[i]})
    buffer = rollout(pool, set(vms), choose, a, {}, watch=watch)
    return episode_metrics(buffer, seen, a), buffer


def run_eval(pool: VMPool, live: set, choosers: dict, a: Args, run: str) -> dict:
    """--eval-episodes episodes of --steps steps (one per desktop per round, reset before each
    round) for each chooser (policy, random baseline); writes runs/<name>/eval.json (per episode its
    metrics and every step's action), prints a table. With --eval-save each episode is also saved as
    a trajectory (screenshots + one line per step), the policy's in runs/<name>/trajectories/it<round>/
    vm<k>.jsonl and the baseline's under runs/<name>/random/: `python view.py runs/<name>` shows them."""
    rounds = math.ceil(a.eval_episodes / pool.size)
    report = {"args": asdict(a), "same_screen_hash_bits": a.eval_same_hash, "same_screen_cosine": a.eval_same_screen}
    for name, choose in choosers.items():
        episodes = []
        for k in progress.track(range(rounds), f"eval {name}"):
            live.intersection_update({i for i, res in enumerate(pool.reset()) if res.ok})
            done, buffer = eval_episodes(pool, sorted(live)[:a.eval_episodes - len(episodes)], choose, a)
            for e in done:
                e["round"] = k  # its trajectory: trajectories/it<round>/vm<vm>.jsonl
                if a.eval_save:
                    steps = [s for s in buffer if s.vm == e["vm"]]
                    rundir.save_trajectory(run if name == "policy" else os.path.join(run, name), k, e["vm"],
                                           e["actions"], [s.before for s in steps])
            episodes += done
        keys = ("format", "immediate", "sequence", "distinct_screens", "distinct_screens_feat", "diversity", "windows")
        summary = {k: float(np.mean([e[k] for e in episodes])) if episodes else None for k in keys}
        # Across episodes too: does the agent reach different screens in different episodes?
        summary["distinct_screens_all"] = len(hash_leaders([int(h, 16) for e in episodes for h in e["hashes"]],
                                                           a.eval_same_hash))
        summary["episodes"] = len(episodes)
        report[name] = {"summary": summary, "episodes": episodes}
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
# Setup helpers: the desktops, a resumed run


def open_desktops(a: Args) -> tuple:
    """-> (VMPool, set of VMs that answered /health, screen (w, h)); one sentence if none did."""
    try:
        pool = VMPool(a.vms, token=a.token or os.environ.get("VM_TOKEN") or None, timeout=a.vm_timeout)
    except Exception as e:  # noqa: BLE001 -- a bad --vms or a desktop that cannot start: one sentence
        sys.exit(f"--vms {a.vms}: {e}")
    health = pool.map("health", timeout=min(10.0, a.vm_timeout))
    live = {i for i, h in enumerate(health) if h.ok}
    if not live:
        pool.close()
        sys.exit(f"None of the {pool.size} VM(s) answered /health: {health[0].error.rstrip('.')}; "
                 "also check --vms and --token.")
    for i, h in enumerate(health):
        if not h.ok:
            print(f"vm {i} left out: {h.error}", flush=True)
    return pool, live, tuple(health[min(live)].value.get("screen", (1280, 720)))


def restore(state: dict, ckpt_dir: str, wm, wm_opt, a: Args) -> tuple:
    """A checkpoint back into memory -> (policy, optimizer). RNG states are restored last, by the caller."""
    if a.lora_rank > 0:  # the generation's starting model + the trained adapter (exact, not merged)
        from peft import set_peft_model_state_dict
        policy = load(state["start_model"], a)
        set_peft_model_state_dict(policy.model, state["adapter"])
    else:
        policy = load(os.path.join(ckpt_dir, "policy"), a)
    optimizer = adamw(trainable(policy), a.lr)
    optimizer.load_state_dict(state["optimizer"])
    try:
        wm.load_state_dict(state["wm"])
    except RuntimeError:
        sys.exit("The checkpoint's world model does not fit these reward flags / text tools; resume with the "
                 "run's own --rewards and the same OCR + embedder installed.")
    wm_opt.load_state_dict(state["wm_opt"])
    return policy, optimizer


def trajectory_lines(buffer: list[Step], rows: list[int], r, adv) -> list[dict]:
    """One JSON line per step of one desktop: what it saw (the PNG), said, did, and earned."""
    comps = {name: getattr(r, name) for name in ("format",) + R.COMPONENTS}
    return [{"step": buffer[k].t, "intent": buffer[k].parsed.thought if buffer[k].parsed else None,
             "action": buffer[k].parsed.action.to_dict() if buffer[k].parsed else None,
             "valid": buffer[k].parsed is not None, "error": buffer[k].error, "text": buffer[k].text,
             "completion_ids": buffer[k].gen.completion_ids, "image_size": list(buffer[k].gen.prompt.image_sizes[0]),
             "screen": list(buffer[k].before.size), "reward": float(r.total[k]), "advantage": float(adv[k]),
             "rewards": {n: float(c[k]) for n, c in comps.items()}} for k in rows]


# -----------------------------------------------------------------------------------------------
# Main: setup, then one top-to-bottom loop

if __name__ == "__main__":
    args = resolve_args()
    ipg = args.iterations_per_generation or args.iterations  # iterations per generation
    total_iterations = args.generations * ipg
    transformers.utils.logging.disable_progress_bar()  # one console line per iteration, not bars
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if args.threads > 0 or not (args.device.startswith("cuda") or (not args.device and torch.cuda.is_available())):
        # OpenMP threads spin while they wait; next to Xvfb desktops and tesseract on the same cores
        # the default (every core) ran our tiny-model steps 10x slower than one thread did.
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    pool, live, screen = open_desktops(args)  # first: an unreachable VM should leave no run folder behind
    new_run = None  # a run folder made just now: removed again if the setup below fails (bad --model, ...)
    try:
        name = args.run_name or time.strftime(("eval-" if args.eval_only else "") + "%Y%m%d-%H%M%S")
        if not args.resume and not os.path.exists(os.path.join(args.runs_dir, name)):
            new_run = os.path.join(args.runs_dir, name)
        if args.eval_only:
            run = rundir.make_run_dir(args.runs_dir, name, args)
            ckpt = None
        else:
            run = rundir.make_run_dir(args.runs_dir, name, args, resume=args.resume or None)
            ckpt = rundir.load_checkpoint(run)
        print(f"run folder: {run}", flush=True)
        random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
        if args.eval_only:
            policy = load(args.model, args, lora=False)
            if args.engine == "vllm":
                policy.engine = M.VLLMEngine(policy, os.path.join(run, "vllm_init"))
            choosers = {"policy": policy_chooser(policy, args)}
            if args.eval_random:
                choosers["random"] = random_chooser(random.Random(args.seed))
            new_run = None  # set up: from here on the folder holds results
            run_eval(pool, live, choosers, args, run)
            sys.exit(0)

        # Text tools (OCR + embedder) only when a text/intent term is on; without them those terms
        # are off (said once) and the world model has no text branch.
        want = R.parse_reward_flags(args.rewards)
        tools = R.load_text_tools() if R.needs_text(want) else None
        flags = R.effective_flags(want, tools)
        print("reward components on: " + ", ".join(k for k, v in flags.items() if v), flush=True)
        wm = R.WorldModel(R.SCREEN_DIM, tools.dim if (tools and flags["text"]) else 0, args.wm_hidden, screen)
        wm_opt = adamw(wm.parameters(), args.wm_lr)
        distill_metrics = {}  # SFT numbers of a generation's start, logged once on its first line
        if ckpt is None:
            start_it, generation = 0, 1
            policy, start_model, distill_metrics = start_generation(1, run, args)
            optimizer = adamw(trainable(policy), args.lr)
        else:
            state, ckpt_dir = ckpt
            start_it, generation, start_model = state["iteration"] + 1, state["generation"], state["start_model"]
            policy, optimizer = restore(state, ckpt_dir, wm, wm_opt, args)
            rundir.trim_metrics(run, start_it)  # lines logged after this checkpoint are redone
            rundir.set_rng_state(state["rng"])
            print(f"resumed {run} at iteration {start_it} (generation E{generation})", flush=True)
        ref_fn = reference_fn(start_model, args)
        if args.engine == "vllm":
            policy.engine = M.VLLMEngine(policy, os.path.join(run, "vllm_init"))

        new_run = None  # set up: from here on the folder holds results
        trackers = progress.open_trackers(run, rundir.public_args(args), wandb=args.wandb, tensorboard=args.tensorboard)
        for it in progress.track(range(start_it, total_iterations), "iterations"):
            t_iter = time.perf_counter()
            times = {}
            g = it // ipg + 1
            if g != generation:  # a generation boundary (also right after resuming at one)
                with timed(times, "distill"):
                    finish_generation(run, generation, (generation - 1) * ipg, it - 1, policy, args)
                    engine = policy.engine
                    policy, start_model, distill_metrics = start_generation(g, run, args)
                    policy.engine = engine
                    M.sync_weights(policy)
                    optimizer = adamw(trainable(policy), args.lr)
                    ref_fn = reference_fn(start_model, args)
                    generation = g
            if it == start_it or (args.reset_every and it % args.reset_every == 0):
                with timed(times, "reset"):  # fresh desktops; dead local ones are restarted here
                    live = {i for i, res in enumerate(pool.reset()) if res.ok}
            # A kill after an iteration saved trajectories but before its checkpoint leaves files
            # that this redo would only partly overwrite (fewer live desktops, say): start clean.
            shutil.rmtree(os.path.join(run, "trajectories", f"it{it:06d}"), ignore_errors=True)

            # rollout: --steps lockstep steps on every live desktop, one batched generate per step
            buffer = rollout(pool, live, policy_chooser(policy, args), args, times)
            if not buffer:
                print(f"it {it}: no desktop answered; resetting them and going on.", flush=True)
                live = {i for i, res in enumerate(pool.reset()) if res.ok}
                continue

            # rewards: features, the world model's update, every component (N,) each
            r, wm_metrics = score(buffer, flags, tools, wm, wm_opt, args, times)

            # ALGO: GRPO with the whole buffer as ONE group: each step's reward against every step's
            # (The sampler's log-probs ride along only so the update can log actor/logp_gap, how far
            # they are from the trainer's own: the update recomputes its old log-probs.)
            samples = [grpo.step_sample(s.gen.prompt, s.gen.completion_ids, float(r.total[k]), group=0,
                                        old_logps=s.gen.logprobs) for k, s in enumerate(buffer)]
            adv = grpo.assign_advantages(samples)  # (N,)
            actor = dict.fromkeys(("actor/loss", "actor/kl", "actor/clip_low", "actor/clip_high", "actor/grad_norm",
                                   "actor/lr"))
            # The delay lets the world model warm up before its curiosity steers the actor. It is
            # the ONLY condition: the release also skipped the update whenever the world model was
            # off, so its no-world-model ablation never trained at all.
            updated = it >= args.update_actor_delay
            if updated:
                for group in optimizer.param_groups:
                    group["lr"] = actor["actor/lr"] = actor_lr(it, args)
                with timed(times, "update"), progress.bar(len(samples), "update") as pb:
                    m = grpo.update_policy(policy, optimizer, samples, args.micro_batch, args.eps_low, args.eps_high,
                                           args.beta, ref_fn, args.max_grad_norm, mini_batch_size=args.mini_batch,
                                           on_micro_batch=pb.update, temperature=args.temperature,
                                           shuffle=random.Random(f"{args.seed}-update-{it}"))
                    actor.update({f"actor/{k}": v for k, v in m.items()})
                with timed(times, "sync"):
                    M.sync_weights(policy)  # the generator samples the next iteration from the new weights

            # trajectories, checkpoint, then the metrics line (this order: see rundir.py)
            metrics = {"iteration": it, "generation": generation, "vms": len({s.vm for s in buffer}),
                       "steps": len(buffer), **R.summarize_rewards(r), **wm_metrics, "actor/updated": int(updated),
                       **actor, "adv/std": float(adv.std()) if len(adv) > 1 else 0.0, **distill_metrics}
            with timed(times, "save"):
                for vm in sorted({s.vm for s in buffer}):
                    rows = [k for k, s in enumerate(buffer) if s.vm == vm]
                    rundir.save_trajectory(run, it, vm, trajectory_lines(buffer, rows, r, adv), [buffer[k].before for k in rows])
                # Always at a generation's last iteration: the boundary (dataset, SFT) is redone from it.
                if (it + 1) % args.save_every == 0 or (it + 1) % ipg == 0 or it + 1 == total_iterations:
                    # LoRA: the adapter alone, exact; the merged policy beside it is for loading elsewhere.
                    state = {"iteration": it, "generation": generation, "start_model": start_model,
                             "adapter": adapter_state(policy) if args.lora_rank > 0 else None,
                             "optimizer": optimizer.state_dict(), "wm": wm.state_dict(), "wm_opt": wm_opt.state_dict(),
                             "wm_config": wm.config, "rng": rundir.rng_state(), "args": asdict(args)}
                    # The checkpoint carries this iteration's line (its times up to now): a kill
                    # before log_metrics below would otherwise lose the line for good.
                    rundir.save_checkpoint(run, state, lambda d: M.save_policy(policy, os.path.join(d, "policy")),
                                           metrics={**metrics, **times, "time/iteration": time.perf_counter() - t_iter})
            metrics.update(times)
            metrics["time/iteration"] = time.perf_counter() - t_iter
            rundir.log_metrics(run, metrics)
            progress.log(trackers, metrics, step=it)
            distill_metrics = {}
            progress.say(console_line(metrics))

        finish_generation(run, generation, (generation - 1) * ipg, total_iterations - 1, policy, args)
        progress.close(trackers)
        print(f"done: {run}", flush=True)
    except BaseException:
        if new_run:  # it holds only args.json: a failed start leaves nothing behind
            shutil.rmtree(new_run, ignore_errors=True)
        raise
    finally:
        pool.close()
