"""ARPO: GRPO on multi-turn desktop tasks, with a replay buffer of successes (arXiv 2505.16282).

    python train_arpo.py --vms 16 --group-size 8 --tasks tasks/          # UI-TARS-1.5-7B, a GPU
    python train_arpo.py --vms 4 --group-size 2 --model tiny-uitars --iterations 2 --max-steps 3   # CPU
    python train_arpo.py --resume runs/<name>                             # continue a run
    python train_arpo.py --select-tasks 16 ...                            # ARPO's task selection first
    python train_arpo.py --eval-only --resume runs/<name>                 # standard + hard success rates

One iteration, top to bottom (`run_iteration`):
    pick tasks (desktops in service // group size, at least 1) -> every group member is a job for
    rollout.py's stepper, and each desktop plays its job on its own (arpo_episode.play): reset, task setup,
      then screenshot -> the policy's answer -> parse the UI-TARS answer -> act (the settled screen
      comes back) until finished()/call_user()/an unparseable answer/max steps -> score, as OSWorld's
      DesktopEnv.evaluate: a last call_user() (FAIL) scores 1 on an infeasible task and 0 on a
      feasible one; otherwise 0, resp. the task's evaluator on the VM. Generation batches whatever
      observations are waiting (one policy call), so a slow desktop holds nobody ->
    replay: an all-failed group gets one member swapped for a stored success of the same task ->
    store this iteration's successes -> reward = score - format penalty -> advantages per group,
    broadcast to every assistant token -> GRPO update on whole trajectories (ARPO's schedule: the
    batch shuffled into two optimizer steps, dual clip, log-probs at the sampling temperature) -> log,
    checkpoint.
Tasks come in a seeded shuffled round robin. Every rollout goes through a `policy_fn(observations)
-> answers` (default: one batched model.generate), so a scripted policy can stand in (the tests do).
Output: runs/<name>/ with args.json, metrics.jsonl (one line per iteration), trajectories/, ckpt/.
The episode itself (UI-TARS turns, OSWorld's scoring) is arpo_episode.py; evaluation and task
selection are arpo_eval.py; the metrics line and the console line, arpo_log.py; this file is the
training: groups, replay, advantages, update, loop.

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
   episode go on (the penalty is still paid once per trajectory). `--format-penalty-on advantage`
   (not ARPO's) takes it from the broken trajectory's advantage after the group's scores are
   normalised, so a group that failed alike does not reward its well-formed failures (advantages).
4. The replay buffer is saved in every checkpoint and restored on resume (ARPO's is lost). Injection
   replaces the lowest scorer of the failed group (arpo_replay.ReplayBuffer); ARPO's paper says a random
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
7. Scoring is OSWorld's (arpo_episode.outcome_scores). Evaluation: "standard" counts an episode that runs out of
   steps as ending in FAIL (so an infeasible task passes by timing out and a feasible one scores 0),
   "hard" does not (ARPO's OSWorld-Hard). Training rewards use the hard rule, as ARPO's training
   environment did.
8. Knobs ARPO does not have, for small models trained from scratch (bench/learning.py): a learning-rate
   warm-up and decay (--lr-warmup, --lr-schedule; ARPO: constant), several passes over each batch
   (--epochs; ARPO: one), and a sampling seed of its own (--sample-seed), so an evaluation draws fresh
   samples from a checkpoint while the task order stays the run's; --no-scale-rewards for Dr. GRPO's
   advantages (reward - group mean, no division by the std). Their defaults are ARPO's.
9. KL to the starting policy: off (beta 0, as ARPO). `--beta` adds DeepSeekMath's estimator against
   the adapter-free model (LoRA) or a frozen copy of --model (full fine-tuning: one more model in
   memory, one more forward per update).
10. Logging: metrics.jsonl always, plus Weights & Biases (--wandb) and TensorBoard (--tensorboard)
   when asked for (plumbing/progress.py).
11. More than one GPU (ARPO: verl's FSDP on 8-16 GPUs with Ray): `torchrun --nproc_per_node N
   train_arpo.py ...`; each rank plays its own groups on its slice of the VMs, the replay buffer
   and the task order are the same on every rank, and full fine-tuning is sharded with FSDP2
   (plumbing/dist.py, README "More than one GPU").
12. A group is always --group-size rollouts (ARPO: one per VM, 16 tasks x 8 on 128 VMs): with fewer
   desktops in service than that, they play the group in turns, so even a lone desktop trains (a
   group of one has advantage 0, and replay would only swap its member for a stored success).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from transformers.utils import logging as hf_logging

import arpo_eval
import arpo_log
from plumbing import dist
from plumbing import progress
import rollout
from plumbing import rundir
from actions import MIN_PIXELS
from arpo_episode import Episode, Observation, as_image, play_all, save_episodes, to_record
from arpo_replay import ReplayBuffer, replay_groups
from chat import encode_chat, uitars_messages
from env import VMPool
from grpo import group_advantages, trajectory_sample
from model import Generation, generate, load_policy
from qwen_vl import TURN_START
from env import SETTLE_HELP, parse_settle
from plumbing.rundir import arg
from env import Task, TaskError, load_tasks

PROG = "train_arpo.py"

# ------------------------------------------------------------------------------------------------
# Args


@dataclass
class Args:
    # desktops and tasks
    vms: str = arg("16", "number of local desktops to launch, or comma-separated URLs of running vm_server.py")
    token: str = arg("", "secret each remote VM's token is derived from (default: $VM_TOKEN); local desktops make their own")
    vm_timeout: float = arg(60.0, "seconds one VM call may take before that VM drops out of the iteration")
    screen: str = arg("1280x720", "screen size of local desktops")
    tasks: str = arg("tasks/", "a task file or a folder of *.json task files")
    task_ids: str = arg("", "comma-separated task ids to use (default: every task)")
    group_size: int = arg(8, "rollouts per task = one GRPO group (ARPO: 8); tasks per iteration = desktops in "
                      "service // this, at least 1 (fewer desktops than a group play it in turns); 1 trains "
                      "nothing (no baseline: every advantage is 0), a smoke test only")
    groups: int = arg(0, "tasks (groups) per iteration, played in turns on the desktops; 0 = desktops in service "
                         "// --group-size (ARPO: 16 tasks x 8 rollouts on 128 VMs, one update)")
    # policy
    model: str = arg("ByteDance-Seed/UI-TARS-1.5-7B",
                     "HF id or folder of a Qwen-VL checkpoint; 'tiny-uitars' = tiny, UI-TARS format taught (CPU); "
                     "'tiny' = random weights")
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
        (args.groups < 0, "--groups must be 0 (one per --group-size desktops) or more"),
        (args.engine not in ("hf", "vllm"), "--engine must be hf or vllm"),
        (args.loss_agg not in ("seq-mean-token-mean", "token-mean"), "--loss-agg must be seq-mean-token-mean or token-mean"),
        (args.beta < 0, "--beta must be >= 0"),
        (args.format_penalty_on not in ("reward", "advantage"), "--format-penalty-on must be reward or advantage"),
        (args.engine == "vllm" and args.beta > 0 and args.lora_rank == 0, "--engine vllm with full fine-tuning and "
                                                                          "--beta > 0 would hold three model copies; use LoRA or --beta 0"),
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


def model_policy(policy, args: Args, temperature: float):
    """The default policy_fn: one batched generate over all observations -> Generations."""
    def policy_fn(observations: list[Observation]) -> list[Generation]:
        return generate(policy, [o.messages for o in observations], max_new_tokens=args.max_new_tokens,
                        temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0)
    return policy_fn


# ------------------------------------------------------------------------------------------------
# The pieces of one training iteration


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
    vm_offset: int = 0  # under torchrun: the number of this rank's first VM among all ranks' VMs
    ref_fn: object = None  # --beta with full fine-tuning: the frozen starting policy's log-probs


def n_groups(desktops: int, group_size: int, groups: int = 0) -> int:
    """How many groups (tasks) an iteration plays on `desktops` desktops in service: `groups` if
    given (more jobs than desktops: a desktop whose episode ended takes the next), else one per
    group_size of them (leftovers idle), and at least one. A group is always group_size rollouts:
    fewer desktops than that play it in turns (rollout.py gives a freed desktop the next episode),
    so a lone desktop still trains; a group of one would not (its advantage is always 0, and replay
    would only swap its one member for a stored success, with nothing to compare it with)."""
    if not desktops:
        return 0
    return groups or max(1, desktops // group_size)


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


def assign_tasks(tr: Trainer, pick) -> tuple[list[str], list[Task], list[int], int]:
    """The next task for each group of the desktops in service. -> (task id per group, every
    rank's; this rank's jobs: one task per group member; the group of each job; the number of
    this rank's first job among all ranks')."""
    desktops = len(rollout.in_service(tr.pool))  # dead remote VMs are re-checked
    if not desktops:
        raise SystemExit("No VM answered; check that the desktops run (see --vms).")
    # Under torchrun every rank draws the tasks of ALL groups (the same ids: the order is a function
    # of the seed) and plays its own, numbered after the earlier ranks' groups: a group never
    # straddles ranks.
    counts = dist.gather(n_groups(desktops, tr.args.group_size, tr.args.groups))
    group_offset, size = sum(counts[:dist.rank()]), tr.args.group_size
    task_ids = pick(sum(counts))
    by_id = {t.id: t for t in tr.tasks}
    mine = range(group_offset, group_offset + counts[dist.rank()])
    return task_ids, [by_id[task_ids[g]] for g in mine for _ in range(size)], [g for g in mine for _ in range(size)], \
        group_offset * size


def episode_samples(policy, ep: Episode, args: Args, advantage: float = 0.0) -> list:
    """ALGO: a trajectory as training sequences, every answer in the context it was sampled in: the
    conversation re-encoded, the sampled answer ids verbatim, the sampler's log-probs alongside.

    With at most --max-images steps (ARPO: 15 and 15) that is ONE sequence, target_mask over every
    assistant turn, as ARPO trains. Past that, answer i saw only screenshots i-K+1..i (K = max
    images): the first K answers still share one sequence, and every later answer is a sequence of
    its own, its prompt exactly as sampled and only its answer a target. Each piece's weight is its
    share of the trajectory's target tokens, so under seq-mean-token-mean the pieces count as one
    sequence and the loss is the one the whole trajectory would give."""
    shots = [as_image(s) for s in ep.screenshots]
    n, K = len(ep.assistant), args.max_images
    lps = ep.logprobs if len(ep.logprobs) == n and all(lp is not None for lp in ep.logprobs) else None
    im_start = policy.tokenizer.convert_tokens_to_ids(TURN_START)  # a turn's first token
    pieces = []
    for end in [min(n, K)] + list(range(K + 1, n + 1)):  # answers [0, end) in context; the last one or all targets
        msgs = uitars_messages(ep.task.instruction, shots[:end], ep.assistant[:end], max_images=K)
        enc = encode_chat(policy, msgs, add_generation_prompt=False)
        first_target = 0 if end <= K else end - 1  # the first answer this piece trains
        if first_target:  # earlier answers are context here: only the last assistant turn is a target
            last_turn = max(i for i, t in enumerate(enc.input_ids) if t == im_start)
            enc.target_mask = [0] * last_turn + enc.target_mask[last_turn:]
        old = [x for lp in lps[first_target:end] for x in lp] if lps is not None else None
        pieces.append(trajectory_sample(enc, ep.reward, ep.group, old))
    total = sum(sum(p.target_mask) for p in pieces)
    for p in pieces:
        p.advantage = advantage
        p.weight = sum(p.target_mask) / total if total else 1.0 / len(pieces)
    return pieces


def replay_and_store(tr: Trainer, fresh: list[Episode], task_ids: list[str]) -> tuple:
    """ALGO: replay into all-failed groups, THEN store this iteration's successes. Under torchrun
    every rank keeps the same buffer: the groups' scores and the successes of every rank, in rank
    order. -> replay_groups' (batch, injections, group stats) of this rank's groups."""
    scores = {}
    for part in dist.gather({e.group: [x.score for x in fresh if x.group == e.group] for e in fresh}):
        scores.update(part)
    batch, injections, stats = replay_groups(tr.replay, fresh, task_ids, scores, tr.vm_offset)
    if tr.replay is not None:
        # ALGO: success = score > 0.1; PNG-encode only those
        mine = [(e.task.id, to_record(e, tr.vm_offset), e.score) for e in fresh if e.score > tr.replay.success_threshold]
        for tid, record, score in [x for part in dist.gather(mine) for x in part]:
            tr.replay.add(tid, record, score)
    return batch, injections, stats


def advantages(batch: list[Episode], a: Args) -> list[float]:
    """ALGO: one advantage per trajectory, against its group. --format-penalty-on reward (ARPO): the
    group normalises the rewards, score - penalty on a broken one. --format-penalty-on advantage:
    the group normalises the scores, and a broken trajectory alone loses the penalty afterwards.
    Why the second exists: in a group that failed the task alike, ARPO's way turns one broken
    answer into a positive advantage for every other member (scores [0, 0, 0, 0], one broken:
    rewards [0, 0, 0, -0.5] -> [+0.5, +0.5, +0.5, -1.5]), which reinforces whatever the failed
    members did; here that group gives [0, 0, 0, -0.5]: the format is still taught, and nothing a
    failure did is rewarded (bench/learning.py --method arpo-multi, where such groups dominate)."""
    groups = [e.group for e in batch]
    if a.format_penalty_on == "reward":
        return group_advantages([e.reward for e in batch], groups, a.scale_rewards).tolist()  # (N,)
    adv = group_advantages([e.score for e in batch], groups, a.scale_rewards)  # (N,)
    broken = torch.tensor([float(e.broken) for e in batch])  # (N,)
    return (adv - a.format_penalty * broken).tolist()  # (N,)


def update(tr: Trainer, batch: list[Episode], it: int, times: dict) -> tuple:
    """ALGO: advantages per group of trajectories, broadcast to every assistant token, then the GRPO
    update in ARPO's schedule (two shuffled mini-batches by default, dual clip, log-probs at the
    sampling temperature). -> (advantage per trajectory, its training sequences, update metrics)."""
    a = tr.args
    adv = advantages(batch, a)  # (N,)
    pieces = [episode_samples(tr.policy, e, a, adv_e) for e, adv_e in zip(batch, adv)]  # each trajectory's sequences
    samples = [p for ps in pieces for p in ps]
    upd = rundir.update_policy(tr.policy, tr.optimizer, samples, times, micro_batch_size=a.micro_batch,
                               eps_low=a.eps_low, eps_high=a.eps_high, beta=a.beta, ref_fn=tr.ref_fn,
                               max_grad_norm=a.max_grad_norm,
                               agg=a.loss_agg, epochs=a.epochs, temperature=a.temperature,
                               dual_clip=a.dual_clip or None,
                               mini_batch_size=a.mini_batch or None, optimizer_steps=2,  # ARPO: two steps a batch
                               shuffle=random.Random(f"{a.seed}-update-{it}"))  # the same on a resume
    return adv, pieces, upd


def run_iteration(tr: Trainer, it: int, pick) -> tuple[dict, list[Episode]]:
    """One ARPO iteration; pick(n) -> n task ids. Returns (metrics, this rank's episodes)."""
    times, t0 = {}, time.perf_counter()
    lr = rundir.set_lr(tr.optimizer, lr_at(it, tr.args))
    # -- one task per group; every group member is a job (dead remote VMs re-checked meanwhile)
    with rundir.timed(times, "vm_wait"):
        task_ids, jobs, job_group, first_job = assign_tasks(tr, pick)
    # -- the rollout: each desktop resets, sets up, plays and scores its episode on its own
    with dist.unsharded(tr.policy.model):  # FSDP2: each rank decodes alone, with whole weights
        eps, out = play_all(tr.pool, jobs, tr.policy_fn, tr.args, job_group, it, desc="rollout", first_job=first_job)
    for k, v in out.times.items():
        times[k] = times.get(k, 0.0) + v
    fresh = [e for e in eps if e.end != "dropped"]
    # -- ALGO: replay into all-failed groups, store this iteration's successes, GRPO
    batch, injections, group_stats = replay_and_store(tr, fresh, task_ids)
    adv, pieces, upd = update(tr, batch, it, times)
    times["time/iteration"] = time.perf_counter() - t0
    m = arpo_log.gather_metrics(tr, it, task_ids, fresh, out, batch, adv, pieces, upd, group_stats, injections, times)
    return {**m, "actor/lr": lr}, eps


# ------------------------------------------------------------------------------------------------
# Setup: tasks, policy, checkpoints; then the loop


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


def setup(args: Args, pool: VMPool, policy, run: str, ckpt, tasks: list, vm_offset: int = 0) -> tuple[Trainer, int]:
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
    policy_fn = model_policy(policy, args, args.temperature)
    if ckpt is None and args.select_tasks > 0:
        with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
            tasks = arpo_eval.select_and_record(pool, tasks, policy_fn, args, run, vm_offset)
    ref_fn = rundir.reference_fn(args.beta, args.lora_rank, lambda: load_policy(  # the run's start, also on a resume
        args.model, seed=args.seed, min_pixels=args.min_pixels, max_pixels=args.max_pixels))
    return Trainer(args, pool, policy, optimizer, replay, policy_fn, run, tasks, picker, vm_offset, ref_fn), start


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
        with rundir.timed(m, "save"):
            if args.save_trajectories:
                save_episodes(run, it, eps, tr.vm_offset)
            if (it + 1) % args.ckpt_every == 0 or it + 1 == args.iterations:
                checkpoint(tr, it + 1, m)
        rundir.end_iteration(run, trackers, m, arpo_log.summary_line(m, args.beta))
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
        pool, _, _, vm_offset = rundir.open_desktops(args.vms, args.token, args.vm_timeout, screen_size(args))
    try:
        if args.eval_only:  # standard + hard success rates of the policy, into eval_it<N>.json
            with dist.unsharded(policy.model):  # FSDP2: each rank decodes alone, with whole weights
                arpo_eval.run_eval(pool, tasks, model_policy(policy, args, args.eval_temperature), args, run,
                                   rundir.next_iteration(ckpt[0]) if ckpt else 0, vm_offset)
            return
        train(*setup(args, pool, policy, run, ckpt, tasks, vm_offset))
    finally:
        pool.close()


if __name__ == "__main__":
    main()
