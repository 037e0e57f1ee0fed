"""ScreenExplorer: teach a vision-language model to explore real desktops, with no task at all.

    python train_explore.py --vms 8                                  # 8 local Xvfb desktops, Qwen2.5-VL-3B
    python train_explore.py --vms http://10.0.0.5:8000,http://10.0.0.6:8000 --token T
    python train_explore.py --vms 2 --model tiny-explore --iterations 2 --steps 2   # CPU smoke run (*)
    python train_explore.py --vms 8 --generations 3 --iterations-per-generation 100   # E1, E2, E3
    python train_explore.py --resume runs/<name>                     # continue a run
    python train_explore.py --eval-only --model runs/<name>/models/E1 --episodes 20   # vs random actions
(*) tiny-explore is the tiny model taught the answer format (plumbing/warm_start.py: built on first use, cached),
so its answers parse and the rewards are real; `--model tiny` (random weights) tests the plumbing only.

A run folder: args.json; metrics.jsonl (one line per iteration: every reward component, world-model
loss, KL, clip fractions, format rate, per-phase seconds); trajectories/it<i>/vm<k>.jsonl + the PNG
the model saw at each step; ckpt/ (the latest checkpoint); models/E<g> (each generation's model,
E<g>_sft its SFT starting point); distill/gen<g>.jsonl + gen<g>/*.png (its distilled steps).

Paper: ScreenExplorer (arXiv 2505.19095). One iteration, top to bottom (`train`, then `learn`):
    --steps steps on every live desktop, each on its own (rollout.py; explore_episode.explore, in
        the desktop's thread): screenshot -> exploration prompt -> the policy's answer (generation
        batches the desktops' waiting prompts) -> parse {"intent", "action"} -> the action, and the
        screen once it settled (--settle)
    -> screen features (+ OCR text) -> the world model's guesses (curiosity) -> world model trained
    --wm-epochs on this buffer -> rewards (rewards.TERMS: every term that is on) -> advantages over
    the whole buffer (one group) -> GRPO update (after --update-actor-delay iterations) -> sync
    weights to the generator -> trajectories, checkpoint, log.
The episode is explore_episode.py, the exploration eval (--eval-only) explore_eval.py, the reward
terms rewards.py, the distillation data explore_distill.py, the metrics and console lines
explore_log.py; this file is the training: rewards -> advantages -> update, the generations, the loop.
Experience-stream distillation (--generations G): at the end of a generation its best format-valid
steps (the top --distill-top of each iteration's, by reward) become a dataset in
runs/<name>/distill/; the next generation starts again from the BASE model, fine-tuned on all
distilled data so far, then does RL.

Where this departs from the paper and its release (niuzaisheng/ScreenExplorer), and what it leaves out:
1. Rewards and features are rewards.py's, the world model rewards.py's (a fixed patch-grid screen
   feature instead of Cosmos latents, tesseract + MiniLM instead of PaddleOCR + BGE-M3, an MLP world
   model); see their docstrings. The release's two bugs are not here: the world model's image branch
   is trained, and `--rewards all,no_world_model` still trains the actor (the release skipped the
   update).
   Curiosity is scored before the world model learns the buffer (the release: after, so a new
   transition seen on several desktops had its surprise trained away; --wm-train-first restores
   the release's order). Both optimizers are the release's AdamW, betas (0.9, 0.95).
2. No guided (JSON-schema) decoding: the release constrained vLLM's sampler to the answer schema;
   we sample freely and a malformed answer is a format failure (reward 0, nothing executed), which
   is itself a learning signal. The release's repetition penalty (1.05) is off: it would make the
   sampling distribution differ from the policy whose log-probs the loss uses.
3. The actor starts updating at iteration --update-actor-delay (0-based; the release: after it).
   --no-scale-rewards gives Dr. GRPO's advantages (reward - mean, no division by the std).
   One optimizer step per --mini-batch samples (the release: gradient accumulation 16 of batch 1).
   An lr warm-up and a linear or cosine decay per generation (--lr-warmup, --lr-schedule; off by
   default, the paper's constant lr) are for small models trained from scratch (actor_lr says why).
4. A desktop that fails (no answer, a 5xx, garbage; only a refused action, 4xx, is the model's)
   drops out of the iteration without the step it failed in (`env_failures`) and a reset restarts
   it; the release threw the whole iteration away. No lockstep (the release's): generation batches
   the prompts that are waiting, so sampled tokens are not reproducible across runs. The screen
   settles by the server's watch (--settle watch, the default: answered once the desktop has
   settled, ~0.15-0.3 s a step) instead of the release's fixed 1 s sleep (--settle 1 restores it).
   The watched screen is the fixed sleep's screen for this method's random pointer actions too
   (bench/settle.py --explore: 0 of 128 differ; the one that did, openbox's workspace popup, is off
   on the local desktops: desktop.openbox_config).
5. Distillation: the paper does not publish its SFT recipe; ours is --distill-epochs passes of
   token-mean NLL on the sampled answers, at --distill-lr, with LoRA merged into the weights after
   SFT, so the next generation's adapter (and its KL reference) start from the fine-tuned model.
   The best steps are ranked within each iteration, not over the generation: the reward's scale
   drifts as the world model learns (explore_distill.top_steps says why).
6. Exploration eval (explore_eval.py; the paper's own numbers are its reward terms, these are ours):
   distinct screens by a 64-bit perceptual hash, pairwise diversity, windows opened, vs random
   actions; every episode saved as a trajectory (--eval-save) that `python view.py` shows.
7. Logging: metrics.jsonl always; Weights & Biases (--wandb) and TensorBoard (--tensorboard) when
   asked for and installed (plumbing/progress.py). Left out: mixed-precision autocast (bf16 weights on GPU
   instead).
8. More than one GPU (the release: two): `torchrun --nproc_per_node N train_explore.py ...`, each rank
   with its slice of the desktops; the one group and the world model span every rank (plumbing/dist.py,
   README "More than one GPU").
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import transformers

from plumbing import dist
import explore_log
import grpo
from plumbing import progress
import rewards as R
import rollout
from plumbing import rundir

from actions import MAX_PIXELS, MIN_PIXELS
from env import VMPool
from explore_episode import Step, play, policy_chooser, random_chooser
from explore_distill import distill_samples, write_distill_dataset
from explore_eval import run_eval
from model import load_policy, sync_weights
from env import SETTLE_HELP, parse_settle
from plumbing.rundir import arg

PROG = "train_explore.py"

# -----------------------------------------------------------------------------------------------
# Args


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
    threads: int = arg(0, "torch CPU threads; 0 = half the cores (the desktops and OCR need the rest)")
    # rollout
    steps: int = arg(10, "steps per episode (one episode per desktop per iteration)")
    iterations: int = arg(100, "training iterations (per generation when --generations > 1 and "
                               "--iterations-per-generation is 0)")
    reset_every: int = arg(1, "iterations between desktop resets (0 = only at start); a reset restarts dead "
                              "local desktops")
    settle: str = arg("watch", "after each action: 'watch' (the server answers once the screen has settled) or "
                               "seconds of a fixed sleep (the release: 1)")
    vm_timeout: float = arg(30.0, "seconds a VM call may take before that VM drops out")
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
    wm_lr: float = arg(1e-3, "world-model learning rate")
    wm_batch_size: int = arg(16, "world-model batch size")
    wm_hidden: int = arg(256, "world-model hidden width")
    wm_train_first: bool = arg(False, "the release's order: train the world model on this buffer, then score it "
                                      "(default: score first, so a transition repeated across desktops keeps its "
                                      "surprise)")
    # experience-stream distillation
    generations: int = arg(1, "generations E1..EG; each after the first starts from the base model + SFT")
    iterations_per_generation: int = arg(0, "iterations per generation; 0 = --iterations")
    distill_top: float = arg(0.3, "fraction of each iteration's format-valid steps (best rewards) kept for SFT")
    distill_epochs: int = arg(2, "SFT passes over all distilled data at the start of a generation")
    distill_lr: float = arg(1e-4, "SFT learning rate")
    distill_batch: int = arg(16, "samples per SFT optimizer step")
    # eval (explore_eval.py)
    eval_only: bool = arg(False, "run the policy without training and report exploration diversity: --model's, "
                                 "or with --resume the run's checkpoint")
    eval_episodes: int = arg(20, "episodes for --eval-only, in all (spread over the desktops)", aliases=("--episodes",))
    eval_random: bool = arg(True, "also run a random-action baseline on the same desktops")
    eval_save: bool = arg(True, "save every eval episode as a trajectory (screenshots + steps; view.py shows them)")
    eval_same_hash: int = arg(2, "screens whose 64-bit perceptual hashes (dHash) differ in at most this many bits "
                                 "count as one")
    eval_same_screen: float = arg(0.95, "the feature count of distinct screens: cosine >= this = the same screen")
    # run
    run_name: str = arg("", "folder under --runs-dir; empty = a timestamp")
    runs_dir: str = arg("runs", "where run folders go")
    resume: str = arg("", "a run folder to continue (flags given now override its args.json)")
    ckpt_every: int = arg(1, "iterations between checkpoints (generation ends always save)")
    wandb: bool = arg(False, "also log every metric to Weights & Biases (pip install wandb; WANDB_PROJECT names "
                             "the project)")
    tensorboard: bool = arg(False, "also log every metric to TensorBoard in runs/<name>/tb (pip install tensorboard)")
    seed: int = arg(0, "random seed")


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
        (min(a.micro_batch, a.mini_batch, a.wm_batch_size, a.distill_batch) < 1, "batch sizes must be at least 1"),
        (a.distill_epochs < 0, "--distill-epochs must be 0 or more"),
        (a.lr_schedule not in ("constant", "linear", "cosine"), "--lr-schedule must be constant, linear or cosine"),
        (a.lr_warmup < 0, "--lr-warmup must be 0 or more"),
        (a.eval_episodes < 1 or a.ckpt_every < 1, "--eval-episodes and --ckpt-every must be at least 1"),
        (not 0 <= a.eval_same_hash < 64, "--eval-same-hash must be in 0..63 (bits of a 64-bit hash)"),
        (a.lora_rank < 0 or a.beta < 0, "--lora-rank and --beta must be >= 0"),
        (parse_settle(a.settle) is None, SETTLE_HELP),
        (a.engine == "vllm" and a.beta > 0 and a.lora_rank == 0, "--engine vllm with full fine-tuning and --beta > 0 "
                                                                  "would hold three model copies; use LoRA or --beta 0"),
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
# The learner's state, and the rewards of one buffer (rewards.py does the math)


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
    flags: dict  # the --rewards switches, usable ones only (rewards.effective_flags)
    tools: object  # OCR + embedder, or None
    vm_offset: int = 0  # under torchrun: the index of this rank's first VM among all ranks' VMs


def score(buffer: list[Step], L: Learner, a: Args, times: dict, it: int = 0):
    """-> (rewards.Rewards over the buffer, each (N,), and the world model's metrics).

    Only format-valid steps are featurised, learned from and scored: a malformed answer executed
    nothing, so every one of its terms is 0 anyway, and skipping it saves its OCR (the costliest
    part of the rewards, ~0.5-1 s per screen per core). Under torchrun the world model learns
    every rank's valid steps (gather_steps), the same on every rank. What is computed is what the
    terms that are on read (rewards.reads): OCR text, the world model's guesses, window lists."""
    rows = [k for k, s in enumerate(buffer) if s.parsed is not None]
    steps, reads = [buffer[k] for k in rows], R.reads(L.flags)
    actions = [s.parsed.action for s in steps]
    wm_metrics = {"wm/loss": None, "wm/loss_first_epoch": None}
    if not rows and dist.size() == 1:
        return R.zeros(len(buffer)), wm_metrics
    f = None
    if rows:
        with rundir.timed(times, "features"):
            f = R.step_features([s.before for s in steps], [s.after for s in steps], [s.parsed.thought for s in steps],
                                actions, L.tools if "text" in reads else None)
    pred_s = pred_t = None
    if "world_model" in reads:
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
        return R.zeros(len(buffer)), wm_metrics
    windows = "windows" in reads  # the window lists the rollout recorded for the windows term
    with rundir.timed(times, "rewards"):
        record = R.record(f, [s.vm for s in steps], [1] * len(steps), screen_pred=pred_s, text_pred=pred_t,
                          actions=actions, windows_before=[s.windows_before for s in steps] if windows else None,
                          windows_after=[s.windows_after for s in steps] if windows else None)
        r = R.reward(record, L.flags)  # ALGO: every term that is on, summed, times the format reward
    return R.scatter(r, rows, len(buffer)), wm_metrics  # (V,) into (N,); malformed steps stay 0


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
# One iteration's learning: rewards -> advantages -> GRPO update


def learn(L: Learner, buffer: list[Step], it: int, args: Args, times: dict) -> tuple:
    """ALGO: rewards, advantages and the GRPO update of one iteration's buffer. -> (rewards.Rewards
    (N,) each, advantages (N,), the world model's metrics, the update's metrics or None before
    --update-actor-delay)."""
    r, wm_metrics = score(buffer, L, args, times, it)  # every term, (N,) each; the world model learns
    # ALGO: GRPO with the whole buffer as ONE group: each step's reward against every step's, on
    # every rank (torchrun: the ranks' buffers together, in rank order; each trains its own steps)
    total_all, mine = dist.cat(r.total)  # (N_all,), this rank's rows
    adv = grpo.group_advantages(total_all, scale=args.scale_rewards)[mine]  # (N,)
    # The delay lets the world model warm up before its curiosity steers the actor. It is the
    # ONLY condition: the release also skipped the update whenever the world model was off, so
    # its no-world-model ablation never trained at all.
    if it < args.update_actor_delay:
        return r, adv, wm_metrics, None
    # (The sampler's log-probs ride along only so the update can log actor/logp_gap, how far they
    # are from the trainer's own: the update recomputes its old log-probs.)
    samples = [grpo.step_sample(s.gen.prompt, s.gen.completion_ids, float(r.total[k]), old_logps=s.gen.logprobs)
               for k, s in enumerate(buffer)]
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    lr = rundir.set_lr(L.optimizer, actor_lr(it, args))
    upd = rundir.update_policy(L.policy, L.optimizer, samples, times, micro_batch_size=args.micro_batch,
                               eps_low=args.eps_low, eps_high=args.eps_high, beta=args.beta, ref_fn=L.ref_fn,
                               max_grad_norm=args.max_grad_norm, mini_batch_size=args.mini_batch,
                               temperature=args.temperature, shuffle=random.Random(f"{args.seed}-update-{it}"))
    return r, adv, wm_metrics, {**upd, "lr": lr}


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
    first_update = max(start, a.update_actor_delay)  # its first actor update
    if it < first_update:  # no update this iteration: nothing to schedule
        return a.lr
    return rundir.scheduled_lr(a.lr, it - first_update, start + ipg - first_update, a.lr_warmup, a.lr_schedule)


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
    rundir.save_model(policy, path)
    if a.lora_rank > 0:
        policy = load(path, a)
    per_epoch = max(1, len(nll) // max(1, a.distill_epochs))
    # --distill-epochs 0 is allowed (the next generation is the base model again, an ablation).
    metrics = {"distill/samples": len(samples), "distill/steps": len(nll), "distill/nll_first": nll[0] if nll else None,
               "distill/nll_last_epoch": float(np.mean(nll[-per_epoch:])) if nll else None}
    print(f"E{g}: SFT on {len(samples)} distilled steps ({len(nll)} optimizer steps), nll "
          f"{metrics['distill/nll_first'] or 0:.3f} -> {metrics['distill/nll_last_epoch'] or 0:.3f}", flush=True)
    return policy, path, metrics


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
    L.ref_fn = rundir.reference_fn(args.beta, args.lora_rank, lambda: load(L.start_model, args, lora=False))
    return metrics


# -----------------------------------------------------------------------------------------------
# A generation's end: its model, and its best steps -> runs/<name>/distill/gen<g>.jsonl (explore_distill.py)


def finish_generation(run: str, g: int, first_iteration: int, last_iteration: int, policy, a: Args) -> None:
    """End of generation g: its model as models/E<g>, its best steps as distill/gen<g>.jsonl."""
    path = os.path.join(run, "models", f"E{g}")
    stamp = os.path.join(path, "LAST_ITERATION")
    if not (os.path.exists(stamp) and open(stamp).read().strip() == str(last_iteration)):
        rundir.save_model(policy, path, extra={"LAST_ITERATION": str(last_iteration)})
    if dist.is_main():
        write_distill_dataset(run, g, range(first_iteration, last_iteration + 1), a.distill_top)
    dist.barrier()  # every rank reads the dataset for the next generation's SFT


# -----------------------------------------------------------------------------------------------
# Setup (plumbing): the learner's state, from scratch or from a checkpoint; the eval's


def setup(args: Args, run: str, ckpt, screen, vm_offset: int) -> tuple:
    """-> (Learner, the first iteration to run, SFT metrics of a generation's start, logged once)."""
    # Text tools (OCR + embedder) only when a term that is on reads text; without them those terms
    # are off (said once) and the world model has no text branch.
    want = R.parse_reward_flags(args.rewards)
    tools = R.load_text_tools() if "text" in R.reads(want) else None
    flags = R.effective_flags(want, tools)
    print("reward terms on: " + ", ".join(R.terms_on(flags)), flush=True)
    wm = R.WorldModel(R.SCREEN_DIM, tools.dim if (tools and flags.get("text")) else 0, args.wm_hidden, screen)
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
    ref_fn = rundir.reference_fn(args.beta, args.lora_rank, lambda: load(start_model, args, lora=False))
    learner = Learner(policy, optimizer, start_model, ref_fn, generation, wm, wm_opt,
                      flags, tools, vm_offset)
    dist.seed_ranks(args.seed + start)  # under torchrun: each rank samples its own answers
    return learner, start, distill_metrics


def evaluate(pool: VMPool, args: Args, ckpt, vm_offset: int = 0) -> dict:
    """--eval-only: the policy (--model, or with --resume the run's checkpoint) next to random
    actions (explore_eval.run_eval). Writes a run folder of its own (eval-<time>), or with --resume
    runs/<name>/eval_it<N>/ (N = the checkpoint's next iteration; a second eval of the same
    checkpoint replaces the first)."""
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
    choosers = {"policy": policy_chooser(policy, args.max_new_tokens, args.temperature, args.top_p)}
    if args.eval_random:
        choosers["random"] = random_chooser(random.Random(args.seed))
    return run_eval(pool, choosers, run, args.steps, args.settle, args.eval_episodes, args.eval_same_hash,
                    args.eval_same_screen, args.eval_save, vm_offset, rundir.public_args(args))


# -----------------------------------------------------------------------------------------------
# The loop, top to bottom


def train(pool: VMPool, live: set, L: Learner, args: Args, run: str, start: int, distill_metrics: dict) -> None:
    ipg = args.iterations_per_generation or args.iterations  # iterations per generation
    total = args.generations * ipg
    trackers = rundir.open_trackers(run, args)
    reset_next = False
    windows = "windows" in R.reads(L.flags)  # a term reads the window lists: the rollout records them
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
        # rollout: --steps steps on every live desktop, each on its own, generation batched (rollout.py);
        # when the next iteration resets, its resets run during this one's update (reset_ahead)
        ahead = bool(args.reset_every) and (it + 1) % args.reset_every == 0 and it + 1 < total
        with dist.unsharded(L.policy.model):  # FSDP2: each rank decodes alone, with whole weights
            buffer, out = play(pool, live, policy_chooser(L.policy, args.max_new_tokens, args.temperature, args.top_p),
                               args.steps, args.settle, reset=bool(fresh), reset_after=ahead, windows=windows)
        for k, v in out.times.items():
            times[k] = times.get(k, 0.0) + v
        live -= {f.vm for f in out.failures}  # out until the next reset
        reset_next = not buffer
        if not buffer and dist.size() == 1:
            print(f"it {it}: no desktop answered; resetting them and going on.", flush=True)
            continue
        r, adv, wm_metrics, upd = learn(L, buffer, it, args, times)  # ALGO: rewards -> advantages -> update
        metrics = {"iteration": it, "generation": L.generation,
                   **explore_log.iteration_metrics(buffer, r, adv, wm_metrics, upd, out), **distill_metrics}
        distill_metrics = {}
        with rundir.timed(times, "save"):  # trajectories, checkpoint, then the metrics line: see plumbing/rundir.py
            explore_log.save_trajectories(run, it, buffer, r, adv, L.vm_offset)
            # Always at a generation's last iteration: the boundary (dataset, SFT) is redone from it.
            if (it + 1) % args.ckpt_every == 0 or (it + 1) % ipg == 0 or it + 1 == total:
                line = {**metrics, **rundir.gather_times({**times, "time/iteration": time.perf_counter() - t0})}
                rundir.save(run, L.policy, L.optimizer, it + 1, args, line, start_model=L.start_model,
                            generation=L.generation, wm=L.wm.state_dict(), wm_opt=L.wm_opt.state_dict(),
                            wm_config=L.wm.config)
        metrics.update(rundir.gather_times({**times, "time/iteration": time.perf_counter() - t0}))
        rundir.end_iteration(run, trackers, metrics, explore_log.console_line(metrics, L.flags, args.beta))
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
    pool, live, screen, vm_offset = rundir.open_desktops(args.vms, args.token, args.vm_timeout)
    try:
        if args.eval_only:
            evaluate(pool, args, ckpt, vm_offset)
            return
        run = args.resume or rundir.run_path(args.runs_dir, args.run_name)
        with rundir.new_run(run):  # a failed setup (bad --model, ...) leaves no folder behind
            rundir.make_run_dir(run, args, resume=bool(args.resume))
            print(f"run folder: {run}", flush=True)
            rundir.seed_all(args.seed)
            learner, start, distill_metrics = setup(args, run, ckpt, screen, vm_offset)
        train(pool, live, learner, args, run, start, distill_metrics)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
