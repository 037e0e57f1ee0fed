"""plumbing/rundir.py: the plumbing both train scripts share: flags, the run folder, desktops, checkpoints, metrics.

    lr: float = rundir.arg(1e-6, "AdamW learning rate")               # one Args field = one flag
    args, given = rundir.parse_args(Args, argv, "train_arpo.py")      # one flag per Args field
    args, ckpt = rundir.resume_args(Args, args, given, "train_arpo.py", marker="group_size")
    with rundir.new_run(path):                                        # a failed start leaves no folder
    pool, live, screen, vm_offset = rundir.open_desktops(args.vms, args.token, args.vm_timeout)
    metrics = rundir.update_policy(policy, optimizer, samples, times, ...)   # grpo's, timed, a bar, synced
    rundir.save(run, policy, optimizer, next_iteration, args, metrics, replay=...)   # atomic
    policy = rundir.restore_policy(state, ckpt_dir, load)             # full weights or base + adapter

    runs/<name>/args.json            the Args of the run (also inside every checkpoint)
    runs/<name>/metrics.jsonl        one JSON line per finished iteration
    runs/<name>/trajectories/it000012/vm03.jsonl + vm03_step00.png ...   what the agent saw and did
    runs/<name>/ckpt/                the latest checkpoint (state.pt + policy/)

One vocabulary for both scripts. Flags: --ckpt-every, --eval-episodes, --resume, --eval-only
(with --resume: evaluate the run's checkpoint), --no-<flag> for a flag that defaults to on.
Metrics: `actor/<x>` for the update's numbers (actor/loss, actor/kl, actor/clip_low, actor/lr,
...), `time/<phase>` for seconds (time/iteration is the whole iteration). A checkpoint's state.pt
holds `next_iteration` (the iteration a resume starts with), `args`, `optimizer`, `rng`, and the
policy: its full weights in ckpt/policy/ (save_pretrained), or, with LoRA, the peft adapter state
(`adapter`) on top of `start_model`. Run folders written before this format still resume:
resume_args renames their flags (RENAMED) and restore_policy / next_iteration read their
checkpoints (LoRA as named parameters, `iteration` in each script's old meaning).

Crash safety, the whole story:
- A checkpoint is written into `ckpt.tmp-<pid>/`, fsynced, then swapped in with two renames
  (`ckpt` -> `ckpt.old`, tmp -> `ckpt`), then `ckpt.old` is deleted. A kill at any moment leaves
  either `ckpt` or `ckpt.old` complete; `latest_checkpoint` picks whichever has COMPLETE. When only
  `ckpt.old` is left (a kill between the renames), it is kept until the new `ckpt` is in place, and
  a killed save's `ckpt.tmp-*` is removed by the next save.
- metrics.jsonl is appended one fsynced line per iteration, *after* the checkpoint of that iteration
  is in place; the checkpoint carries a copy of that line. On resume the file is rewritten without
  lines of iterations the checkpoint does not cover (they were logged by an iteration whose
  checkpoint never landed), and with the checkpoint's own line if the kill came before it was
  logged, so every iteration appears exactly once.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, field, is_dataclass

import numpy as np
import torch

from plumbing import dist
import grpo
from plumbing import progress
from env import VMPool
from model import cpu_weights, save_policy, sync_weights

# -----------------------------------------------------------------------------------------------
# Flags: one per Args field, parsed by transformers' HfArgumentParser

# Flags renamed since a run folder was written: its args.json / checkpoint still resume.
RENAMED = {"save_every": "ckpt_every", "eval_rollouts": "eval_episodes"}


def arg(default, help: str, aliases: tuple = ()):
    """One field of a trainer's `Args`: its default and its --help line (both trainers declare every
    flag this way); `aliases` adds other spellings of the flag ("--episodes")."""
    return field(default=default, metadata={"help": help, **({"aliases": list(aliases)} if aliases else {})})


class _Given:
    """argparse leaves a namespace attribute alone unless the flag is on the command line (it only
    fills in defaults for attributes not already there), so starting from this marker tells the
    flags typed now from the defaults."""


def parse_args(cls, argv, prog: str) -> tuple:
    """-> (cls filled from the command line, {field: value} of the flags given explicitly).

    One flag per field, `--max-pixels` (and `--max_pixels`); a bool is `--x` / `--x false`, and
    one that defaults to on is switched off with `--no-x`; `arg(..., aliases=("--y",))` adds
    spellings. A bad flag ends in one sentence, not argparse's usage block."""
    from transformers import HfArgumentParser
    p = HfArgumentParser(cls, prog=prog, description=(sys.modules[cls.__module__].__doc__ or "").split("\n")[0])
    p.error = lambda msg: sys.exit(f"{prog}: {msg}; see --help for the flags.")
    marker = _Given()
    names = [f.name for f in cls.__dataclass_fields__.values()]
    ns = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(names, marker)))
    given = {k: v for k, v in vars(ns).items() if v is not marker}
    return cls(**given), given


def check(problems: list, prog: str) -> None:
    """problems: [(bad?, "what to do")]; the first bad one ends the run in one sentence."""
    for bad, msg in problems:
        if bad:
            sys.exit(f"{prog}: {msg}.")


def resume_args(cls, args, given: dict, prog: str, marker: str) -> tuple:
    """With --resume: the run's saved args (its checkpoint's, else args.json: a run killed before
    its first checkpoint), the flags given now on top. -> (args, (state, ckpt folder) or None).
    `marker`: a field only this script's Args has, so the other script's run is refused."""
    if not args.resume:
        return args, None
    if not os.path.isdir(args.resume):
        sys.exit(f"--resume {args.resume}: no such run folder; pass a folder under {args.runs_dir}/.")
    ckpt = load_checkpoint(args.resume)
    if ckpt is None and given.get("eval_only"):
        sys.exit(f"--resume {args.resume}: no checkpoint there to evaluate; pass a run folder with a ckpt/ in it.")
    saved = ckpt[0].get("args") if ckpt is not None else None
    if saved is None:
        try:
            with open(os.path.join(args.resume, "args.json")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = None
    if not isinstance(saved, dict):
        sys.exit(f"--resume {args.resume}: no checkpoint or args.json there; pass a run folder {prog} wrote.")
    saved = {RENAMED.get(k, k): v for k, v in saved.items()}
    if marker not in saved:
        sys.exit(f"--resume {args.resume}: that is not a {prog} run; resume it with the script that wrote it.")
    known = {k: v for k, v in saved.items() if k in cls.__dataclass_fields__}
    return cls(**{**known, **given}), ckpt


# -----------------------------------------------------------------------------------------------
# The run folder


def run_path(runs_dir: str, run_name: str, prefix: str = "") -> str:
    """runs_dir/run_name (a time stamp when empty). A name that already starts with runs_dir
    (`--run-name runs/x`) or is absolute is taken as the path itself."""
    name = dist.broadcast(run_name or time.strftime(prefix + "%Y%m%d-%H%M%S"))  # rank 0's clock names it
    if os.path.isabs(name) or not runs_dir:
        return name
    norm, root = os.path.normpath(name), os.path.normpath(runs_dir)
    return name if norm == root or norm.startswith(root + os.sep) else os.path.join(runs_dir, name)


@contextlib.contextmanager
def new_run(path: str):
    """Around the setup of a run: if it fails (a bad --model, a name clash), a folder that did not
    exist before is removed again, so a failed start leaves nothing behind."""
    fresh = not os.path.exists(path) and dist.is_main()  # rank 0 makes the folder and removes it
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(path, ignore_errors=True)
        raise


def make_run_dir(path: str, args, resume: bool = False) -> str:
    """Create (or reopen, on resume) the run folder and write args.json (rank 0; the others wait)."""
    if not resume and os.path.exists(os.path.join(path, "ckpt")):
        sys.exit(f"{path} already holds a run; use --resume {path} or another --run-name.")
    if dist.is_main():
        os.makedirs(os.path.join(path, "trajectories"), exist_ok=True)
        with open(os.path.join(path, "args.json"), "w") as f:
            json.dump(public_args(args), f, indent=2)
    dist.barrier()
    return path


# -----------------------------------------------------------------------------------------------
# Desktops, seeds, timers, the learning-rate schedule


def local_vms(vms: str) -> tuple[str, int]:
    """This rank's share of --vms (a number of local desktops, or URLs): a contiguous slice, and
    its VM offset, the index of its first VM among all ranks' (trajectories and metrics name VMs by it)."""
    urls = [u.strip() for u in vms.split(",") if u.strip()]
    n = int(urls[0]) if len(urls) == 1 and urls[0].isdigit() else len(urls)
    mine = dist.shard_range(n)
    if n and not mine:
        sys.exit(f"--vms {vms}: {n} VM(s) for {dist.size()} ranks leaves rank {dist.rank()} without one; "
                 "give every rank at least one VM.")
    return (str(len(mine)) if len(urls) == 1 and urls[0].isdigit() else ",".join(urls[mine.start:mine.stop])), mine.start


def open_desktops(vms: str, token: str, timeout: float, screen=(1280, 720)) -> tuple:
    """This rank's VMs (all of them in one process) -> (VMPool, live VM indices, screen (w, h) of
    the first live one, the rank's VM offset: its first VM's index among all ranks'), or one
    sentence when the VMs cannot start or none answers /health."""
    vms, vm_offset = local_vms(vms)
    try:
        pool = VMPool(vms, token=token or os.environ.get("VM_TOKEN") or None, timeout=timeout, screen=screen)
    except Exception as e:  # noqa: BLE001 -- a bad --vms or a desktop that cannot start: one sentence
        sys.exit(f"cannot start the VMs ({str(e).rstrip('.')}); check --vms.")
    health = pool.map("health", timeout=min(10.0, timeout))
    live = {i for i, h in enumerate(health) if h.ok}
    if not live:
        pool.close()
        sys.exit(f"None of the {pool.size} VM(s) answered /health ({str(health[0].error).rstrip('.')}); "
                 "check --vms and --token (each VM takes the token `python vm_server.py --token-for URL` prints).")
    for i, h in enumerate(health):
        if not h.ok:
            print(f"vm {vm_offset + i} left out: {h.error}", flush=True)
    return pool, live, tuple(health[min(live)].value.get("screen", screen)), vm_offset


def seed_all(seed: int, sample_seed: int = -1) -> None:
    """Python, numpy and torch; torch's generator (what sampling draws from) may get its own seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed if sample_seed < 0 else sample_seed)


@contextlib.contextmanager
def timed(times: dict, phase: str):
    """Add the block's wall time to times["time/<phase>"] (a phase may run several times)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[f"time/{phase}"] = times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


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
    return functools.partial(grpo.per_token_logps, ref.model)


def update_policy(policy, optimizer, samples: list, times: dict, **kw) -> dict:
    """grpo.update_policy with the plumbing around it, so a trainer's update reads as the algorithm:
    its seconds in times["time/update"], a progress bar over the micro-batches, and the generator
    (vLLM) given the new weights after (times["time/sync"]). kw: update_policy's own arguments.
    -> its metrics ({} when no rank had a sample: nothing was updated or synced)."""
    with timed(times, "update"), progress.bar(len(samples) * kw.get("epochs", 1), "update") as pb:
        metrics = grpo.update_policy(policy, optimizer, samples, on_micro_batch=pb.update, **kw)
    if metrics:
        with timed(times, "sync"):
            sync_weights(policy)  # the generator samples the next rollout from the new weights
    return metrics


# -----------------------------------------------------------------------------------------------
# Checkpoints: what a resume needs, in one format for both scripts


def save(run: str, policy, optimizer, next_it: int, args, metrics: dict | None = None,
         start_model: str | None = None, **extra) -> None:
    """Checkpoint the run atomically (save_checkpoint). Full fine-tuning: the weights in policy/;
    LoRA: the peft adapter state in state.pt (exact; the base is `start_model`, default --model).
    `extra`: the script's own state (replay buffer, world model, ...). `metrics`: the line of the
    iteration just done (see save_checkpoint). Every rank calls it (FSDP2 gathers the weights and
    the optimizer state from all of them); rank 0 writes."""
    adapter = weights = None
    if policy.lora:
        from peft import get_peft_model_state_dict
        adapter = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy.model).items()}
    else:
        weights = cpu_weights(policy)
    state = {"next_iteration": next_it, "args": asdict(args), "optimizer": dist.optimizer_state(policy.model, optimizer),
             "rng": rng_state(), "adapter": adapter, "start_model": start_model or args.model, **extra}
    if dist.is_main():
        write = None if policy.lora else (lambda folder: save_policy(policy, os.path.join(folder, "policy"), weights))
        save_checkpoint(run, state, write, metrics=metrics)
    dist.barrier()


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



def next_iteration(state: dict) -> int:
    """The iteration a resume starts with. Checkpoints older than the shared format stored
    `iteration`: train_arpo.py's (they have a task picker) meant the next one, train_explore.py's
    the last one done."""
    if "next_iteration" in state:
        return state["next_iteration"]
    return state["iteration"] + (0 if "picker" in state else 1)


def restore_policy(state: dict, ckpt_dir: str, load):
    """The checkpoint's policy; load(name_or_folder) -> Policy with the run's LoRA settings."""
    if state.get("adapter") is not None:  # LoRA: the starting model + the trained adapter
        from peft import set_peft_model_state_dict
        policy = load(state.get("start_model") or state["args"]["model"])
        set_peft_model_state_dict(policy.model, state["adapter"])
        return policy
    if state.get("trainable") is not None:  # LoRA in the older format: named parameters
        policy = load(state["args"]["model"])
        try:
            bad = policy.model.load_state_dict(state["trainable"], strict=False).unexpected_keys
        except RuntimeError as e:  # a shape mismatch: another LoRA rank
            bad = [str(e).strip().splitlines()[-1].strip()]
        if bad:
            sys.exit(f"the checkpoint's adapter does not fit this model ({bad[0][:150]}); "
                     "resume with the --model and --lora-rank the run was started with.")
        return policy
    return load(os.path.join(ckpt_dir, "policy"))


def resume(run: str, ckpt, policy, optimizer) -> int:
    """Optimizer state, RNG states and metrics.jsonl back to the checkpoint; -> the next iteration.
    Under torchrun every rank takes rank 0's RNG states (dist.seed_ranks then sets them apart)."""
    state = ckpt[0]
    dist.load_optimizer_state(policy.model, optimizer, state["optimizer"])
    start = next_iteration(state)
    if dist.is_main():
        trim_metrics(run, start)  # lines logged after this checkpoint are redone
        trim_trajectories(run, start)
    dist.barrier()
    set_rng_state(state["rng"])
    return start


def public_args(args) -> dict:
    """The run's args for disk (args.json, every checkpoint): --token blanked. Run folders get
    copied and shared (view.py puts args.json into its HTML report), and the token gives control
    of the VMs; on resume, pass --token again or set VM_TOKEN."""
    d = dict(asdict(args) if is_dataclass(args) else args)
    if d.get("token"):
        d["token"] = ""
    return d


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run: str, state: dict, write_extra=None, metrics: dict | None = None) -> None:
    """Atomically replace runs/<name>/ckpt with `state` (torch.save'd as state.pt).

    `write_extra(folder)` writes anything else into the same folder before the swap (the policy via
    save_pretrained, say), so the policy and the optimizer state can never come from two iterations.
    `metrics`: the iteration's metrics line, kept in the checkpoint (metrics.json) so that a kill
    between this call and log_metrics loses no line: trim_metrics writes it back on resume.
    """
    if isinstance(state.get("args"), dict):
        state = {**state, "args": public_args(state["args"])}  # no secret in a checkpoint either
    tmp = os.path.join(run, f"ckpt.tmp-{os.getpid()}")
    for name in os.listdir(run):  # ours from before, or a killed save's: never picked, only disk
        if name.startswith("ckpt.tmp-"):
            shutil.rmtree(os.path.join(run, name), ignore_errors=True)
    os.makedirs(tmp)
    if write_extra is not None:
        write_extra(tmp)
    if metrics is not None:
        with open(os.path.join(tmp, "metrics.json"), "w") as f:
            json.dump(metrics, f, default=float)
    torch.save(state, os.path.join(tmp, "state.pt"))
    for root, _, files in os.walk(tmp):  # everything on disk before the rename makes it visible
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        f.write(str(state.get("next_iteration", "")))
        f.flush()
        os.fsync(f.fileno())
    final, old = os.path.join(run, "ckpt"), os.path.join(run, "ckpt.old")
    if os.path.exists(final) and not os.path.exists(os.path.join(final, "COMPLETE")):
        shutil.rmtree(final)  # not ours (we only ever rename complete folders to ckpt): never keep it
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    # else ckpt.old, if there, is the only complete checkpoint (a kill came between the renames):
    # it stays until the new one is in place.
    os.rename(tmp, final)
    _fsync_dir(run)
    shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run: str) -> str | None:
    """The folder of the newest complete checkpoint, or None (a fresh run)."""
    for name in ("ckpt", "ckpt.old"):
        path = os.path.join(run, name)
        if os.path.exists(os.path.join(path, "COMPLETE")):
            return path
    return None


def load_checkpoint(run: str) -> tuple[dict, str] | None:
    """(state dict, checkpoint folder) of the newest complete checkpoint, or None."""
    path = latest_checkpoint(run)
    if path is None:
        return None
    # weights_only=False: the state holds our own replay buffer and RNG states, written by us.
    return torch.load(os.path.join(path, "state.pt"), weights_only=False), path


def rng_state() -> dict:
    # On a GPU, HF generate samples with the CUDA generator: without its state a resumed run would
    # draw different answers from the same checkpoint.
    # Only if CUDA is in use: asking would otherwise start it for a CPU run on a GPU machine.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": cuda}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    # Skipped when resuming on a machine with a different number of GPUs (or none), where the
    # saved states cannot be mapped one to one.
    cuda = s.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def trim_trajectories(run: str, next_iteration: int) -> None:
    """On resume: remove the trajectory folders of iterations >= next_iteration, a killed attempt's.
    A redone iteration clears its own folder (clear_trajectories), but a kill after the last
    checkpoint leaves one that no iteration redoes."""
    folder = os.path.join(run, "trajectories")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if len(name) == 8 and name.startswith("it") and name[2:].isdigit() and int(name[2:]) >= next_iteration:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def trim_metrics(run: str, next_iteration: int) -> None:
    """On resume: drop metric lines of iterations >= next_iteration (logged after the last
    checkpoint, they are redone), and write back the checkpoint's own line if a kill between the
    checkpoint and its log_metrics lost it. Every iteration then appears exactly once."""
    path = os.path.join(run, "metrics.jsonl")
    keep, seen = [], set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    it = json.loads(line)["iteration"]
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a kill mid-write: drop it
                if it < next_iteration:
                    keep.append(line if line.endswith("\n") else line + "\n")
                    seen.add(it)
    ckpt = latest_checkpoint(run)
    if ckpt is not None and os.path.exists(os.path.join(ckpt, "metrics.json")):
        with open(os.path.join(ckpt, "metrics.json")) as f:
            line = json.load(f)
        if line.get("iteration", next_iteration) < next_iteration and line["iteration"] not in seen:
            keep.append(json.dumps(line) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_trackers(run: str, args):
    """wandb / TensorBoard as asked for, on rank 0 only (none on the others)."""
    return progress.open_trackers(run, public_args(args), wandb=args.wandb and dist.is_main(),
                                  tensorboard=args.tensorboard and dist.is_main())


def gather_times(times: dict) -> dict:
    """An iteration's time/* (rollout.py says what each phase means) and vm_wait_share = time/vm_wait
    / time/iteration, the share of the iteration the learner had nothing to generate or update.
    Under torchrun: each phase's seconds on the slowest rank, and every rank's own under "ranks"
    (with "vm_wait": its seconds waiting on its desktops)."""
    out = dict(times)
    if dist.size() > 1:
        per = dist.gather(dict(times))
        out = {k: max(p.get(k, 0.0) for p in per) for k in sorted(set().union(*per))}
        out["ranks"] = [{**p, "vm_wait": p.get("time/vm_wait", 0.0)} for p in per]
    out["vm_wait_share"] = out.get("time/vm_wait", 0.0) / out["time/iteration"] if out.get("time/iteration") else 0.0
    return out


def end_iteration(run: str, trackers, metrics: dict, line: str) -> None:
    """The iteration's metrics line (after its checkpoint: a resume never logs an iteration
    twice), the same numbers to wandb / TensorBoard, and its console line: rank 0's job."""
    if dist.is_main():
        log_metrics(run, metrics)
        progress.log(trackers, metrics, step=metrics["iteration"])
        progress.say(line)


def log_metrics(run: str, metrics: dict) -> None:
    """Append one iteration's metrics (must carry "iteration") as one fsynced JSON line."""
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())


def clear_trajectories(run: str, iteration: int) -> None:
    """An iteration redone after a kill (its trajectories were saved, its checkpoint was not) must
    not leave the killed attempt's files beside the new ones (a VM that dropped out this time).
    Rank 0 clears it before any rank writes into it."""
    if dist.is_main():
        shutil.rmtree(os.path.join(run, "trajectories", f"it{iteration:06d}"), ignore_errors=True)
    dist.barrier()


def save_trajectory(run: str, iteration: int, vm: int, steps: list[dict], images: list) -> str:
    """Write one VM's steps of one iteration: a PNG per screenshot + one JSONL line per step.

    steps[i] gets "screenshot": <file name> added when images[i] is not None; images are PIL images
    (the screen the model saw before step i). Returns the folder.
    """
    folder = os.path.join(run, "trajectories", f"it{iteration:06d}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"vm{vm:02d}.jsonl"), "w") as f:
        for i, (step, img) in enumerate(zip(steps, images)):
            step = dict(step)
            if img is not None:
                name = f"vm{vm:02d}_step{i:02d}.png"
                img.save(os.path.join(folder, name), compress_level=1)  # level 1: ~5x faster, ~1.3x bigger
                step["screenshot"] = name
            f.write(json.dumps(step, default=str) + "\n")
    return folder
