"""GRPO for vision-language GUI agents: advantages, ARPO's replay buffer, training samples, the
update and its clipped loss; below them the update's bookkeeping, the log-probs of chosen tokens,
the distillation (SFT) step, the learning-rate schedule and the KL reference.

Used by train_explore.py (ScreenExplorer) and train_arpo.py (ARPO); nothing here talks to a VM.
Tests: `python -m pytest -q tests/test_grpo.py tests/test_grpo_model.py tests/test_arpo_replay.py`.

One update (`update_policy`): samples (prompt + completion ids, advantage) -> padded micro-batches,
grouped into optimizer steps -> old log-probs (no grad) -> [reference log-probs, only if beta > 0]
-> the clipped surrogate per token (`grpo_loss`), aggregated, accumulated over micro-batches ->
clip the gradient -> step.

Where this departs from the papers (on purpose, each one small):
1. The loss is DAPO's "clip-higher" (eps_low / eps_high; ARPO 0.2 / 0.3) with an optional dual clip
   (ARPO's verl: c = 3.0 for negative advantages); the KL term is DeepSeekMath's k3 estimator, only
   when beta > 0 (ScreenExplorer: 0.04; ARPO: 0, no reference model at all).
2. Two aggregations: "seq-mean-token-mean" (GRPO as written) and "token-mean" (DAPO: one mean over
   the batch's tokens); Sample.weight lets the pieces of one cut trajectory count as one sequence.
3. One optimizer step per rollout is exactly on-policy (ratio 1, no clipping); several
   (mini_batch_size, optimizer_steps, epochs: ARPO's default is two) fix old log-probs first, and
   `shuffle` mixes the samples, as ScreenExplorer's release does.
4. Old log-probs are the trainer's own, scored at the sampling temperature without the
   never-sampled vision tokens (verl does the same); the sampler's ride along only for `logp_gap`.
5. The replay buffer replaces a failed group's lowest scorer (ARPO's paper: a random member; its
   code: the first): in a group that qualifies (std < 0.05, mean < 0.2) the members score about the
   same, and the lowest keeps a rare partial success (one 0.1 among seven 0s) a random or first pick
   could throw away. It is saved in every checkpoint, its RNG included (ARPO's is lost).
"""
from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

import qwen_vl  # the image tensors and forward inputs of the model family
from plumbing import dist


# ----------------------------------------------------------------------------------------------
# Advantages


def group_advantages(rewards, group_ids=None, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """The advantage both trainers use: each reward against its group's. Returns (N,) float32.

        scale=True  (GRPO):     A = (r - mean_g) / (std_g + eps)
        scale=False (Dr. GRPO): A =  r - mean_g

    Dr. GRPO (arXiv 2503.20783) drops the division by the group's std: it weighs a group whose
    rewards barely differ (a question too easy or too hard) as much as one that splits, a bias
    towards those groups; without it, advantages keep the rewards' scale. Both trainers take the
    choice as --scale-rewards / --no-scale-rewards (TRL's name for it).
    group_ids: one id per reward (int or str; a list, tensor or numpy array), or None for one group
    (ScreenExplorer normalises every step of the rollout buffer together). torch.std is the
    unbiased one (divides by n - 1). A group of one, or one where every reward is equal, gets
    advantage 0 either way: it carries no signal (plumbing/logs.py counts such groups as flat).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # (N,)
    ids = [0] * len(r) if group_ids is None else list(group_ids)
    # A tensor (or numpy array) of ids iterates as 0-d tensors, which hash by identity: every
    # member would become its own group and every advantage 0, silently. Plain Python values.
    ids = [g.item() if hasattr(g, "item") else g for g in ids]
    if len(ids) != len(r):
        raise ValueError(f"group_advantages got {len(r)} rewards but {len(ids)} group ids; "
                         "pass one id per reward.")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(ids):
        members.setdefault(g, []).append(i)
    adv = torch.zeros_like(r)  # (N,)
    for idx in members.values():
        g = r[idx]  # (G,)
        # Checked explicitly: mean of equal floats is not always exactly equal to them, and
        # (r - mean) / (0 + 1e-6) would then blow a rounding error up into a large advantage.
        if len(idx) < 2 or bool((g == g[0]).all()):
            continue
        adv[idx] = g - g.mean()  # ALGO: group-relative advantage (Dr. GRPO stops here), (G,)
        if scale:
            adv[idx] = adv[idx] / (g.std() + eps)  # ALGO: GRPO divides by the group's std, (G,)
    return adv



# ----------------------------------------------------------------------------------------------
# ARPO's replay buffer of successes


class ReplayBuffer:
    """Per-task store of successful trajectories (ARPO). A trajectory is whatever the trainer keeps
    (train_arpo.py: an episode as plain data); it must pickle, for checkpoints.

    Call order per iteration: inject into each new group first, then add its members, so an
    injected success always comes from an earlier iteration. Which member an injection replaces, and
    why: departure 5 of this file's docstring.
    """

    def __init__(self, capacity_per_task: int = 8, success_threshold: float = 0.1, seed: int = 0):
        self.capacity_per_task = int(capacity_per_task)
        self.success_threshold = float(success_threshold)
        self.data: dict[str, list[tuple[Any, float]]] = {}  # task -> [(trajectory, score)], oldest first
        self.rng = random.Random(seed)  # own RNG: resuming from state_dict replays the same choices

    def add(self, task_id, trajectory, score: float) -> bool:
        """Keep a success (score strictly above the threshold); returns whether it was kept."""
        if not (float(score) > self.success_threshold):  # ALGO: a success: score > the threshold (ARPO: 0.1; NaN is not)
            return False
        items = self.data.setdefault(str(task_id), [])
        items.append((trajectory, float(score)))
        if len(items) > self.capacity_per_task:
            items.pop(0)  # ALGO: bounded per task, oldest out: stays close to the current policy
        return True

    def sample(self, task_id):
        """A random stored success of this task, or None."""
        items = self.data.get(str(task_id))
        return self.rng.choice(items)[0] if items else None

    def inject(self, task_id, trajectories: list, scores: Sequence[float], std_below: float = 0.05,
               mean_below: float = 0.2) -> tuple[list, list[float], int | None]:
        """If the group failed alike (std < std_below and mean < mean_below: ARPO's code's numbers),
        replace its lowest scorer (the first of them on a tie) with a stored success so GRPO sees a
        non-zero advantage. ARPO's code replaces the first member, its paper a random one: the lowest keeps
        a partial success the group may hold (departure 5). -> (trajectories, scores, the index
        replaced or None): new lists, the caller's stay as they were."""
        trajectories, scores = list(trajectories), [float(s) for s in scores]
        if not scores:
            return trajectories, scores, None
        std = statistics.stdev(scores) if len(scores) > 1 else 0.0  # unbiased, as group_advantages
        items = self.data.get(str(task_id))
        if not (std < std_below and statistics.fmean(scores) < mean_below) or not items:  # ALGO: failed alike?
            return trajectories, scores, None
        traj, score = self.rng.choice(items)
        worst = min(range(len(scores)), key=scores.__getitem__)
        trajectories[worst], scores[worst] = traj, score  # ALGO: one success into the failed group
        return trajectories, scores, worst

    def __len__(self) -> int:
        return sum(len(v) for v in self.data.values())

    def state_dict(self) -> dict:
        """Plain lists, ints and floats (plus the trajectories): fits torch.save / pickle."""
        version, internal, gauss = self.rng.getstate()
        return {"capacity_per_task": self.capacity_per_task, "success_threshold": self.success_threshold,
                "data": {k: [[t, s] for t, s in v] for k, v in self.data.items()},
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, d: dict) -> None:
        self.capacity_per_task = int(d["capacity_per_task"])
        self.success_threshold = float(d["success_threshold"])
        self.data = {k: [(t, float(s)) for t, s in v] for k, v in d["data"].items()}
        version, internal, gauss = d["rng"]
        self.rng.setstate((version, tuple(internal), gauss))



# ----------------------------------------------------------------------------------------------
# Samples: one training sequence each


@dataclass
class Sample:
    """One training sequence: a prompt + completion (ScreenExplorer step) or a whole multi-turn
    trajectory (ARPO). target_mask is 1 on the tokens the policy produced (the loss's tokens).
    old_logps, if given, has one log-prob per target token, in order (e.g. the sampler's
    Answer.logprobs); update_policy only compares them with its own (logp_gap). weight: what
    this sequence counts for in the "seq-mean-token-mean" mean over sequences; a trajectory cut
    into pieces (ARPO past --max-images) gives each piece its share of the trajectory's target
    tokens, so the pieces together count as the one sequence they came from."""
    input_ids: list[int]
    target_mask: list[int]
    pixel_values: torch.Tensor | None  # (N_patches, D) of all this sample's images, in order
    image_grid_thw: torch.Tensor | None  # (N_img, 3)
    reward: float = 0.0
    advantage: float = 0.0
    group: int | str = 0
    old_logps: list[float] | None = None
    weight: float = 1.0


def step_sample(prompt, answer_ids: Sequence[int], reward: float = 0.0, group: int | str = 0,
                old_logps: Sequence[float] | None = None) -> Sample:
    """ScreenExplorer step: an Encoded prompt (model.encode_chat) followed by the sampled tokens,
    used verbatim (re-tokenising the text could give other ids than the ones sampled).
    old_logps: the sampler's log-prob of each completion token (Answer.logprobs), optional."""
    ids = list(prompt.input_ids) + [int(t) for t in answer_ids]
    mask = [0] * len(prompt.input_ids) + [1] * len(answer_ids)
    olds = None if old_logps is None else [float(x) for x in old_logps]
    return Sample(ids, mask, prompt.pixel_values, prompt.image_grid_thw, float(reward), 0.0, group, olds)


def trajectory_sample(encoded, reward: float = 0.0, group: int | str = 0,
                      old_logps: Sequence[float] | None = None) -> Sample:
    """ARPO trajectory: the whole conversation encoded once (model.encode_chat with
    add_generation_prompt=False), target_mask already 1 on every assistant turn.
    old_logps: one per target token, i.e. every turn's sampler log-probs concatenated, optional."""
    olds = None if old_logps is None else [float(x) for x in old_logps]
    return Sample(list(encoded.input_ids), list(encoded.target_mask), encoded.pixel_values,
                  encoded.image_grid_thw, float(reward), 0.0, group, olds)



# ----------------------------------------------------------------------------------------------
# The update, and its loss


STEP_KEYS = ("pg_loss", "kl", "clip_low", "clip_high", "clip_dual", "ratio_mean")  # token-weighted over micro-batches


def update_policy(policy_or_model, optimizer, samples: Sequence[Sample], micro_batch_size: int = 4,
                  eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0,
                  ref_fn: Callable[[dict], torch.Tensor] | None = None, max_grad_norm: float = 1.0,
                  agg: str = "seq-mean-token-mean", mini_batch_size: int | None = None,
                  epochs: int = 1, on_micro_batch: Callable[[int], None] | None = None, temperature: float = 1.0,
                  dual_clip: float | None = None, shuffle: random.Random | None = None,
                  optimizer_steps: int | None = None) -> dict:
    """One GRPO update on a rollout's samples (each with its .advantage); -> metrics averaged over
    its optimizer steps ({} when no rank had a sample).

    The samples, shuffled by `shuffle` (seeded; None keeps their order), are cut into optimizer
    steps of `mini_batch_size` samples, or into `optimizer_steps` steps (ARPO: 2), or one step, and
    each step is accumulated over micro-batches of `micro_batch_size` (memory only: the gradient is
    the whole step's); `epochs` repeats the steps. Old log-probs are fixed before the first step
    (departure 3, this file's docstring); every log-prob is scored at the sampling `temperature`. beta > 0 adds the KL to a
    reference: `ref_fn(batch)` (a frozen copy, reference_fn) or, for a LoRA model, the same weights
    with the adapter off. `on_micro_batch(n)` is called after each micro-batch (a progress bar).
    metrics["logp_gap"]: the trainer's old log-probs against the sampler's (Sample.old_logps).
    Under torchrun each rank passes its own samples; sizes and means count every rank's.
    """
    model, pad_id, suppressed = _unwrap(policy_or_model)
    samples = list(samples)
    n_all = int(dist.all_sum([len(samples)])[0])  # every rank's samples (one process: its own)
    if n_all == 0:
        return {}
    if beta != 0.0 and ref_fn is None and not hasattr(model, "disable_adapter"):
        raise ValueError("beta > 0 needs a reference policy: pass ref_fn, or train with LoRA (--lora-rank) "
                         "so the adapter can be switched off.")
    if shuffle is not None:
        shuffle.shuffle(samples)  # our copy of the list: the caller's order stays
    per_step = mini_batch_size or math.ceil(n_all / (optimizer_steps or 1))
    # What the sampler did to the logits travels with each batch (verl: meta_info), so every forward
    # that scores it (old, new, a ref_fn's) scores the sampling distribution.
    sampling = {"temperature": float(temperature), "suppressed": suppressed}
    batches, steps = _plan(samples, n_all, per_step, micro_batch_size, sampling, pad_id)  # micro-batches, per step
    extra = _matched(model, steps)  # FSDP2: the forwards a step adds to match the busiest rank's (else 0)
    # With one step in all, the weights that score the tokens are the ones old log-probs would come
    # from: old = the current log-probs, detached, and no second forward (exactly on-policy).
    single = len(steps) == 1 and epochs == 1  # ALGO: on-policy: old = the current log-probs
    gap = _LogpGap()
    model.train()  # gradient checkpointing only runs in train mode; dropout is 0 in our configs
    with torch.no_grad():
        old = None if single else _old_logps(model, batches, extra, gap)  # [(B, T)] ALGO: the ratio's old policy
        ref = _reference_logps(model, batches, beta, ref_fn)  # [(B, T) or None] ALGO: the KL's reference
    # ALGO: what each step's loss is a mean over (sequences or target tokens), over ALL ranks' samples
    # (_units(b, agg): b's sequences, or its target tokens, whichever `agg` averages over)
    units = dist.all_sum([sum(_units(batches[i], agg) for i in step) for step in steps])
    done = []
    optimizer.zero_grad(set_to_none=True)
    for _ in range(max(1, epochs)):
        for step, n_extra, step_units in zip(steps, extra, units):
            sums = dict.fromkeys(("loss", "tokens") + STEP_KEYS, 0.0)
            for i in step:
                b = batches[i]
                logps = per_token_logps(model, b)  # (B, T), at the batch's sampling temperature
                if single:
                    gap.note(logps, b)
                dev = logps.device
                loss, m = grpo_loss(logps, logps.detach() if single else old[i].to(dev),
                                    b["advantages"].to(dev), b["target_mask"].to(dev),
                                    ref_logps=None if ref[i] is None else ref[i].to(dev), eps_low=eps_low,
                                    eps_high=eps_high, beta=beta, agg=agg, dual_clip=dual_clip,
                                    seq_weights=b["weights"].to(dev))  # ALGO: the clipped surrogate, aggregated
                w = _units(b, agg) / step_units if step_units > 0 else 0.0  # ALGO: its share of the step's mean
                (loss * w * dist.grad_scale(model)).backward()
                if on_micro_batch is not None:
                    on_micro_batch(len(b["advantages"]))
                sums["loss"] += m["loss"] * w
                sums["tokens"] += m["tokens"]
                for key in STEP_KEYS:
                    sums[key] += m[key] * m["tokens"]
            _matched_backwards(model, batches, n_extra)  # FSDP2: the busiest rank's extra forwards, weight 0
            done.append(_optimizer_step(model, optimizer, sums, max_grad_norm))  # ranks summed, clipped, stepped
    return _update_metrics(done, samples, gap, epochs)


def grpo_loss(logps, old_logps, advantages, mask, ref_logps=None, eps_low: float = 0.2,
              eps_high: float = 0.28, beta: float = 0.0, agg: str = "seq-mean-token-mean",
              dual_clip: float | None = None, seq_weights=None):
    """Clipped GRPO surrogate. logps, old_logps, ref_logps, mask: (B, T), mask = the batch's
    target_mask (1 on the tokens the policy produced); advantages (B,) or (B, T).

    per token: -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
               + beta * (exp(ref - logps) - (ref - logps) - 1),        ratio = exp(logps - old_logps)
    dual_clip = c > 1 (dual-clip PPO, arXiv 1912.09729; ARPO: 3.0; None or inf = off, the default
    of this function): where A < 0 the policy-gradient part is min(that, -c * A), i.e. -max(min(ratio * A,
    clip(ratio) * A), c * A), so a token whose ratio ran far above 1 on a bad action cannot make
    the loss (and its gradient) unbounded; those tokens get zero gradient, as in verl's
    compute_policy_loss. seq_weights (B,): each sequence's weight in the "seq-mean-token-mean" mean
    (Sample.weight; None = 1 each); "token-mean" ignores them.
    Returns (loss, metrics); metrics are floats: kl (masked mean of the k3 term), clip_low /
    clip_high (share of target tokens whose clipped branch is the active one, so their gradient
    is zero: A < 0 with ratio < 1 - eps_low, resp. A > 0 with ratio > 1 + eps_high), clip_dual
    (A < 0 with ratio > c), ratio_mean, adv_mean / adv_std (over sequences for (B,) advantages,
    over target tokens for (B, T)), tokens, and the mean policy-gradient part pg_loss.
    """
    if agg not in ("seq-mean-token-mean", "token-mean"):
        raise ValueError(f"unknown aggregation {agg!r}; use 'seq-mean-token-mean' or 'token-mean'.")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be above 1 (ARPO: 3.0), or None / inf to switch it off; got {dual_clip}.")
    dual_clip = dual_clip if dual_clip is not None and math.isfinite(dual_clip) else None  # inf: no cap
    m = mask.to(logps.dtype)  # (B, T)
    adv = advantages.to(logps.dtype)  # (B,) or (B, T)
    A = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    on = m > 0  # (B, T)
    # Off-target positions are forced to 0 (not multiplied by 0: a -inf there would make NaN),
    # and |log ratio| <= 20 keeps one absurd token from turning the whole step into inf / NaN.
    log_ratio = torch.where(on, logps - old_logps.detach(), 0.0).clamp(-20, 20)  # (B, T)
    ratio = torch.exp(log_ratio)  # ALGO: importance ratio pi / pi_old, (B, T)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)  # ALGO: (B, T)
    pg = -torch.min(ratio * A, clipped * A)  # ALGO: pessimistic (clipped) surrogate, (B, T)
    if dual_clip:
        # ALGO: dual clip: for A < 0 the loss is capped at c * |A| (verl: clip_ratio_c), (B, T)
        pg = torch.where(A < 0, torch.min(pg, -dual_clip * A), pg)
    per_token = pg  # (B, T)
    kl = torch.zeros_like(pg)  # (B, T)
    if ref_logps is not None:
        d = torch.where(on, ref_logps.detach() - logps, 0.0).clamp(-20, 20)  # (B, T)
        kl = torch.exp(d) - d - 1  # ALGO: k3 estimator of KL(pi || pi_ref), >= 0, (B, T)
        if beta != 0.0:
            per_token = pg + beta * kl  # ALGO: (B, T)

    n_tok = m.sum(1)  # (B,)
    if agg == "seq-mean-token-mean":
        seq = (per_token * m).sum(1) / n_tok.clamp(min=1)  # ALGO: each sequence's token mean, (B,)
        has = (n_tok > 0).to(seq.dtype)  # (B,)
        if seq_weights is not None:
            has = has * seq_weights.to(seq.dtype)  # (B,)
        loss = (seq * has).sum() / has.sum().clamp(min=1e-12)  # ALGO: (weighted) mean over sequences
    else:
        loss = (per_token * m).sum() / m.sum().clamp(min=1)  # ALGO: one mean over all tokens

    with torch.no_grad():
        N = m.sum().clamp(min=1)  # () target tokens
        A_full = A.expand_as(m)  # (B, T)
        low = ((ratio < 1 - eps_low) & (A_full < 0)).to(m.dtype)  # (B, T)
        high = ((ratio > 1 + eps_high) & (A_full > 0)).to(m.dtype)  # (B, T)
        dual = ((ratio > dual_clip) & (A_full < 0)).to(m.dtype) if dual_clip else torch.zeros_like(m)  # (B, T)
        adv_vals = adv if adv.dim() == 1 else adv[m.bool()]  # (B,) or (N,)
        metrics = {
            "loss": float(loss),
            "pg_loss": float((pg * m).sum() / N),
            "kl": float((kl * m).sum() / N),
            "clip_low": float((low * m).sum() / N),
            "clip_high": float((high * m).sum() / N),
            "clip_dual": float((dual * m).sum() / N),
            "ratio_mean": float((ratio * m).sum() / N),
            "adv_mean": float(adv_vals.mean()) if adv_vals.numel() else 0.0,
            "adv_std": float(adv_vals.std()) if adv_vals.numel() > 1 else 0.0,
            "tokens": float(m.sum()),
        }
    return loss, metrics



# ----------------------------------------------------------------------------------------------
# Below the update: what it calls by name. Its bookkeeping (the steps' plan, FSDP2's matched
# forwards, the optimizer step, the metrics), log-probs of the chosen tokens, batches


def _unwrap(policy_or_model):
    """(model, pad_id, ids sampling never emits) from a model.Policy, or (model, 0, []) from a bare model."""
    model = getattr(policy_or_model, "model", None)
    if isinstance(model, torch.nn.Module) and hasattr(policy_or_model, "tokenizer"):
        pad = getattr(policy_or_model.tokenizer, "pad_token_id", None)
        suppressed = policy_or_model.suppressed_ids() if hasattr(policy_or_model, "suppressed_ids") else []
        return model, 0 if pad is None else int(pad), list(suppressed)
    # Padding is right-sided and masked out of attention and loss, so its id does not matter.
    return policy_or_model, 0, []


def _units(batch: dict, agg: str) -> float:
    """What the loss is a mean over: (the weights of) sequences with a target token, or target tokens."""
    n_tok = batch["target_mask"].sum(1)  # (B,)
    if agg == "seq-mean-token-mean":
        return float(((n_tok > 0).float() * batch["weights"]).sum())
    return float(n_tok.sum())


def _plan(samples: list[Sample], n_all: int, per_step: int, micro: int, sampling: dict, pad_id: int):
    """The update's batches and steps: -> (collated micro-batches, per optimizer step the indices of
    its micro-batches). per_step counts samples of ALL ranks: each rank cuts its own share into as
    many mini-batches as one process would cut the whole batch into (verl's data-parallel split)."""
    n_steps = math.ceil(n_all / per_step)
    share = max(1, math.ceil(per_step * len(samples) / n_all))  # at world size 1: per_step itself
    minis = list(micro_batches(samples, share)) if samples else []
    batches, steps = [], []
    for mini in minis + [[]] * (n_steps - len(minis)):
        steps.append([])
        for mb in micro_batches(mini, micro):
            steps[-1].append(len(batches))
            batches.append({**collate(mb, pad_id), **sampling})
    return batches, steps


def _matched(model, steps: list[list[int]]) -> list[int]:
    """FSDP2: every forward is a collective, so each rank runs as many per optimizer step as the
    busiest rank. -> per step, how many extra forwards this rank adds (all 0 without sharding)."""
    if not dist.is_sharded(model):
        return [0] * len(steps)
    busiest = [max(c) for c in zip(*dist.gather([len(s) for s in steps]))]
    extra = [m - len(s) for s, m in zip(steps, busiest)]
    if any(extra) and not any(steps):
        raise ValueError("FSDP2 needs at least one sample on every rank to match the others' forwards.")
    return extra


def _old_logps(model, batches: list, extra: list[int], gap) -> list:
    """The old log-probs of every batch, (B, T) each, fixed before the first step (no grad), their
    gap to the sampler's noted; FSDP2: the busiest rank's extra forwards matched."""
    old = []
    for b in batches:
        old.append(per_token_logps(model, b))
        gap.note(old[-1], b)
    for _ in range(sum(extra)):
        per_token_logps(model, batches[0])
    return old


def _matched_backwards(model, batches: list, n: int) -> None:
    """FSDP2's matched forwards of one step: a zero-weight loss, for the collectives only."""
    for _ in range(n):
        (per_token_logps(model, batches[0]).sum() * 0.0).backward()


def _reference_logps(model, batches: list, beta: float, ref_fn) -> list:
    """The KL reference's (B, T) log-probs of every batch (None each with beta 0): ref_fn's, or with
    LoRA the same model with its adapter switched off (the starting policy)."""
    if beta == 0.0:
        return [None] * len(batches)
    if ref_fn is not None:
        return [ref_fn(b) for b in batches]
    out = []
    for b in batches:
        with model.disable_adapter():
            out.append(per_token_logps(model, b))
    return out


class _LogpGap:
    """Sum of |trainer - sampler| old log-probs over target tokens, and their count (verl logs the
    same, rollout_probs_diff): how far the sampler's numbers are from the trainer's for the same
    weights and tokens, e.g. vLLM vs HF, or a temperature mismatch."""

    def __init__(self):
        self.sum, self.n = 0.0, 0

    def note(self, trainer_old: torch.Tensor, b: dict) -> None:
        if b["old_logps"] is not None:
            on = b["target_mask"].bool()  # (B, T)
            on[:, 0] = False  # per_token_logps leaves position 0 out
            d = (trainer_old.detach().float().cpu() - b["old_logps"])[on].abs()  # (N_target,)
            self.sum, self.n = self.sum + float(d.sum()), self.n + d.numel()


def _clip_and_step(model, optimizer, max_grad_norm) -> tuple[float, bool]:
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm and max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit) if params else 0.0
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
    if not math.isfinite(norm):
        # A NaN/inf gradient would poison every weight; drop this step, keep training.
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, True


def _optimizer_step(model, optimizer, sums: dict, max_grad_norm: float) -> dict:
    """The end of one optimizer step: every rank's gradients summed (data parallel; FSDP2 does its
    own), its numbers summed over ranks, the gradient clipped, the step taken. -> the step's metrics."""
    if not dist.is_sharded(model):
        dist.sync_grads([p for p in model.parameters() if p.requires_grad])
    keys = list(sums)
    sums = dict(zip(keys, dist.all_sum([sums[k] for k in keys])))
    for key in STEP_KEYS:
        sums[key] /= max(sums["tokens"], 1.0)
    sums["grad_norm"], ok = _clip_and_step(model, optimizer, max_grad_norm)
    sums["skipped"] = 0.0 if ok else 1.0
    return sums


def _update_metrics(done: list[dict], samples: list[Sample], gap: _LogpGap, epochs: int) -> dict:
    """The steps' metrics averaged, the advantages' mean and std over every rank's samples, the
    sampler's log-prob gap."""
    metrics = {key: sum(s[key] for s in done) / len(done) for key in done[0]}
    a_sum, a_sq, n = dist.all_sum([sum(float(s.advantage) for s in samples),
                                   sum(float(s.advantage) ** 2 for s in samples), len(samples)])
    mean = a_sum / n
    metrics.update(adv_mean=mean, adv_std=math.sqrt(max(0.0, (a_sq - n * mean * mean) / (n - 1))) if n > 1 else 0.0,
                   steps=float(len(done)), tokens=sum(s["tokens"] for s in done) / max(1, epochs))
    gap_sum, gap_n = dist.all_sum([gap.sum, gap.n])
    if gap_n:
        metrics["logp_gap"] = gap_sum / gap_n
    return metrics


def per_token_logps(model, batch: dict, temperature: float | None = None) -> torch.Tensor:
    """logps[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) on completion tokens, 0 elsewhere: (B, T).

    p = softmax(logits / temperature) without the ids in batch["suppressed"]: the distribution the
    tokens were sampled from (verl and ARPO divide by T when scoring the old, the new and the
    reference policy), so a run sampling at T != 1 trains the policy it sampled from, and the
    sampler's Answer.logprobs are these numbers. temperature None: batch["temperature"] if the
    batch carries one (update_policy puts both there, as verl's meta_info does, so a ref_fn scores
    the same distribution), else 1; <= 0 (greedy) scores at 1. top-p is not reproduced (nor in
    verl): sample with top_p 1 when the ratio must be exact.

    The vocabulary projection is what eats memory: a 4k-token screenshot prompt at V = 151,936 is
    2.5 GB of float32 logits per sample, twice that with a log_softmax beside it. Only the
    positions just before a completion token are needed, so we run the model's body for the
    hidden states, gather exactly those rows and apply lm_head to them alone: (N_completion, V).
    (transformers >= 5.24 can do the gather itself with a boolean `logits_to_keep`; 5.17, which the
    GPU image has, cannot, so we do it by hand and work on both.) Works through peft's LoRA wrapper:
    its adapters sit inside the body's Linear layers.
    """
    dev = next(model.parameters()).device
    target = batch["target_mask"].bool().to(dev)  # (B, T)
    target[:, 0] = False  # the first token has no context to be predicted from
    keep = torch.zeros_like(target)  # (B, T)
    keep[:, :-1] = target[:, 1:]  # position t - 1 predicts token t
    # ids, mask, the images and the token types that give image tokens their 3-D (time, height,
    # width) rotary positions (without them Qwen2/2.5-VL silently fall back to 1-D positions)
    kwargs = dict(qwen_vl.forward_inputs(model, batch, dev), use_cache=False)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # unwrap peft
    if dist.is_sharded(base):
        # FSDP2 gathers the root's weights (embeddings, lm_head) only in the root's own forward, and
        # keeps them gathered for the backward: through it, with one position's logits to spare.
        hidden = base(**kwargs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]  # (B, T, H)
    else:
        hidden = base.model(**kwargs).last_hidden_state  # (B, T, H)
    logits = base.lm_head(hidden[keep])  # (N_completion, V)
    temperature = batch.get("temperature", 1.0) if temperature is None else temperature
    # ALGO: the sampling distribution's logits. In place (as verl): no second (N, V) buffer, and
    # lm_head's backward does not need its output.
    if temperature > 0 and temperature != 1.0:
        logits = logits.div_(temperature)  # (N_completion, V)
    if batch.get("suppressed"):
        logits = logits.index_fill_(1, torch.tensor(batch["suppressed"], device=dev), float("-inf"))  # (N_completion, V)
    lp = selective_log_softmax(logits, kwargs["input_ids"][target])  # (N_completion,)
    # Row-major order of `keep` and `target` is the same, so masked_scatter puts each value back.
    return torch.zeros(target.shape, dtype=lp.dtype, device=dev).masked_scatter(target, lp)  # (B, T)


# Rows of logits handled per exp/logsumexp call: bounds each temporary to ~16M floats (64 MB).
_LSE_CHUNK_ELEMS = 1 << 24


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log p(index) = logits[index] - logsumexp(logits), with a hand-written backward.

    Autograd's own backward for gather + logsumexp allocates three or four (N, V) buffers (the
    gather's zero-filled grad, exp(logits - lse), their sum, ...). d/dlogits is simply
    onehot(index) - softmax(logits), so one (N, V) gradient buffer filled chunk by chunk does it.
    """

    @staticmethod
    def forward(ctx, logits, index):  # logits (N, V), index (N,)
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        rows = max(1, _LSE_CHUNK_ELEMS // logits.shape[1])
        # Upcast per chunk: a bf16 logsumexp over 152k entries loses ~2 digits, and the GRPO
        # ratio exp(new - old) magnifies any such error.
        lse = [torch.logsumexp(logits[i:i + rows].to(out_dtype), dim=-1)
               for i in range(0, logits.shape[0], rows)]  # [(n,)]
        lse = torch.cat(lse) if lse else logits.new_zeros(0, dtype=out_dtype)  # (N,)
        picked = logits.gather(1, index[:, None]).squeeze(1).to(out_dtype)  # (N,)
        ctx.save_for_backward(logits, index, lse)
        ctx.rows = rows
        return picked - lse  # (N,)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,)
        logits, index, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (N, V)
        for i in range(0, logits.shape[0], ctx.rows):
            p = torch.exp(logits[i:i + ctx.rows].to(lse.dtype) - lse[i:i + ctx.rows, None])  # (n, V) softmax
            grad[i:i + ctx.rows] = (p * -grad_out[i:i + ctx.rows, None]).to(grad.dtype)  # (n, V)
        grad.scatter_add_(1, index[:, None], grad_out[:, None].to(grad.dtype))  # + onehot * grad_out
        return grad, None


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., index] without materialising a full log_softmax.

    logits (..., V), index (...) -> (...), in float32 (float64 stays float64), whatever the
    logits' dtype. Memory beyond the logits: one chunk temporary forward, one (N, V) gradient
    backward.
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (N, V)
    idx = index.reshape(-1).to(device=logits.device, dtype=torch.long)  # (N,)
    return _SelectiveLogSoftmax.apply(flat, idx).reshape(index.shape)  # (...)


def micro_batches(samples: Sequence[Sample], size: int) -> Iterator[list[Sample]]:
    """Consecutive chunks of `size` samples (order kept, so old log-probs line up)."""
    size = max(1, int(size))
    for i in range(0, len(samples), size):
        yield list(samples[i:i + size])


def collate(samples: Sequence[Sample], pad_id: int = 0) -> dict:
    """Right-pad samples into one batch: input_ids, attention_mask and target_mask (each sample's
    Sample.target_mask), all (B, T). Images of all samples are concatenated in sample order,
    which is the order the model's placeholder tokens appear in when reading the batch row-major.

    Also carries rewards (B,), advantages (B,), weights (B,), and old_logps (B, T) -- each sample's per-target
    values put at its target positions, 0 elsewhere, aligned with input_ids as per_token_logps is --
    when every sample has them (None otherwise)."""
    B, T = len(samples), max(len(s.input_ids) for s in samples)
    input_ids = torch.full((B, T), int(pad_id), dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    target_mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    carried = all(s.old_logps is not None for s in samples)
    old_logps = torch.zeros(B, T, dtype=torch.float32) if carried else None  # (B, T)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        if len(s.target_mask) != n:
            raise ValueError(f"sample {b} has {n} input ids but {len(s.target_mask)} target-mask entries; "
                             "build samples with step_sample or trajectory_sample.")
        input_ids[b, :n] = torch.tensor(s.input_ids, dtype=torch.long)  # (n,)
        attention_mask[b, :n] = 1
        target_mask[b, :n] = torch.tensor(s.target_mask, dtype=torch.long)  # (n,)
        if carried:
            on = target_mask[b].bool()  # (T,)
            if len(s.old_logps) != int(on.sum()):
                raise ValueError(f"sample {b} has {int(on.sum())} target tokens but {len(s.old_logps)} old log-probs; "
                                 "pass one log-prob per completion token (Answer.logprobs).")
            old_logps[b, on] = torch.tensor(s.old_logps, dtype=torch.float32)  # (n_target,) into (T,)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_mask": target_mask,
        **qwen_vl.image_inputs(samples),  # pixel_values (sum N_patches, D), image_grid_thw (N_img, 3)
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),  # (B,)
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),  # (B,)
        "weights": torch.tensor([s.weight for s in samples], dtype=torch.float32),  # (B,)
        "old_logps": old_logps,  # (B, T) or None
    }



# ----------------------------------------------------------------------------------------------
# Experience-stream distillation: one SFT step; the learning-rate schedule; the KL reference


def distill_step(policy_or_model, optimizer, samples: Sequence[Sample], micro_batch_size: int = 4,
                 max_grad_norm: float = 1.0) -> dict:
    """Experience-stream distillation: one SFT step, NLL averaged over all target tokens."""
    model, pad_id, _ = _unwrap(policy_or_model)
    batches = [collate(mb, pad_id) for mb in micro_batches(list(samples), micro_batch_size)]
    total = sum(float(b["target_mask"][:, 1:].sum()) for b in batches)
    if total == 0:
        return {"nll": 0.0, "tokens": 0.0, "grad_norm": 0.0}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    nll = 0.0
    for b in batches:
        logps = per_token_logps(model, b)  # (B, T), 0 off target
        loss = -logps.sum() / total  # ALGO: token-mean negative log-likelihood
        loss.backward()
        nll += loss.item()
    norm, ok = _clip_and_step(model, optimizer, max_grad_norm)
    return {"nll": nll, "tokens": total, "grad_norm": norm, "skipped": 0.0 if ok else 1.0}


def scheduled_lr(lr: float, u: int, n: int, warmup: int, schedule: str) -> float:
    """The learning rate of update u (0-based) of n: a linear warm-up over the first `warmup`
    updates (lr * (u + 1) / warmup), then `schedule` over the rest, towards 0 at update n but never
    0 itself (the last update still learns):
        constant: lr,  linear: lr * (1 - f),  cosine: lr * (1 + cos(pi f)) / 2,  f = (u - warmup) / (n - warmup).
    A function of u alone, so a resumed run continues the schedule where it stopped."""
    if u < warmup:
        return lr * (u + 1) / warmup
    if schedule == "constant":
        return lr
    f = (u - warmup) / max(1, n - warmup)  # 0 at the first update after the warm-up, < 1 at the last
    return lr * (1 - f) if schedule == "linear" else lr * 0.5 * (1 + math.cos(math.pi * f))


def set_lr(optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def reference_fn(beta: float, lora_rank: int, load):
    """--beta's KL reference with full fine-tuning: a frozen copy of the starting model, `load()`
    (the trainer's own loader, no LoRA). None when no reference is needed: beta 0, or LoRA, where
    update_policy switches the adapter off instead. -> batch -> (B, T) log-probs."""
    if beta == 0 or lora_rank > 0:
        return None
    ref = load()
    ref.model.eval().requires_grad_(False)
    return functools.partial(per_token_logps, ref.model)
