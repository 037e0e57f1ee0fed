"""plumbing/ckpt.py: checkpoints, one format for both trainers, and what a resume does.

    args, state = ckpt.resume_args(Args, args, given, "train_arpo.py", marker="group_size")  # --resume's flags
    ckpt.save(run, policy, optimizer, next_iteration, args, metrics, replay=...)   # atomic
    state = ckpt.load_checkpoint(run)                 # (state dict, folder) of the newest complete one
    policy = ckpt.restore_policy(state, folder, load)  # full weights, or the base + the LoRA adapter
    start = ckpt.resume(run, state, policy, optimizer)  # optimizer, RNG, metrics.jsonl: -> next iteration

A checkpoint's state.pt holds `next_iteration` (the iteration a resume starts with), `args`,
`optimizer`, `rng`, and the policy: its full weights in ckpt/policy/ (save_pretrained), or, with
LoRA, the peft adapter state (`adapter`) on top of `start_model`; and each trainer's own state
(ARPO: the replay buffer, the task order; ScreenExplorer: the world model, the generation). Run
folders written before this format still resume: restore_policy and next_iteration read their
checkpoints (LoRA as named parameters, `iteration` in each script's old meaning), and resume_args
their flags (RENAMED, and each trainer's OLD_VALUES; tests/test_old_runs.py).

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
  logged, so every iteration appears exactly once. The same goes for the trajectory folders.
"""
import errno
import json
import os
import random
import shutil
import sys
from dataclasses import asdict

import numpy as np
import torch

from model import cpu_weights, save_policy
from plumbing import dist
from plumbing.rundir import public_args

# Flags renamed since a run folder was written: its args.json / checkpoint still resume.
RENAMED = {"save_every": "ckpt_every", "eval_rollouts": "eval_episodes"}


def resume_args(cls, args, given: dict, prog: str, marker: str, old_values: dict | None = None) -> tuple:
    """With --resume: the run's saved args (its checkpoint's, else args.json: a run killed before
    its first checkpoint), the flags given now on top. -> (args, (state, ckpt folder) or None).
    `marker`: a field only this script's Args has, so the other script's run is refused.
    `old_values`: {flag: {old value: today's}} for flags whose special values got names (a run
    folder's `groups: 0` is today's None, "one group per --group-size desktops")."""
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
    for k, values in (old_values or {}).items():
        if k in saved and not isinstance(saved[k], bool) and saved[k] in values:
            saved[k] = values[saved[k]]
    if marker not in saved:
        sys.exit(f"--resume {args.resume}: that is not a {prog} run; resume it with the script that wrote it.")
    known = {k: v for k, v in saved.items() if k in cls.__dataclass_fields__}
    return cls(**{**known, **given}), ckpt


# -----------------------------------------------------------------------------------------------
# Writing a checkpoint


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

# -----------------------------------------------------------------------------------------------
# Resuming


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
        trim_distilled(run, start)
    dist.barrier()
    set_rng_state(state["rng"])
    return start

# -----------------------------------------------------------------------------------------------
# The atomic folder swap, and reading it back


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
    try:
        _write_folder(tmp, state, write_extra, metrics)
    except Exception as e:  # a full disk, say: the half-written folder goes, the last one stays
        st = os.statvfs(run)  # torch's and safetensors' writers do not say ENOSPC: ask the disk
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError) and st.f_bavail * st.f_frsize < 1 << 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), run) from e
        raise
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


def _write_folder(tmp: str, state: dict, write_extra, metrics: dict | None) -> None:
    """A checkpoint's files, each on disk (fsync'd) before COMPLETE says the folder is whole."""
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

# -----------------------------------------------------------------------------------------------
# RNG states, and trimming what a killed attempt left


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


def trim_distilled(run: str, next_iteration: int) -> None:
    """On resume: drop the distillation lines (and their screenshots) of iterations >=
    next_iteration, which a killed attempt appended after its last checkpoint (plumbing/logs.py).
    Lines without an iteration (a dataset written at a generation's end, before) stay."""
    folder = os.path.join(run, "distill")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not (name.startswith("gen") and name.endswith(".jsonl")):
            continue
        path, keep = os.path.join(folder, name), []
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a kill mid-write
                if d.get("iteration", -1) < next_iteration:
                    keep.append(line if line.endswith("\n") else line + "\n")
                else:
                    try:
                        os.unlink(os.path.join(folder, d["image"]))
                    except OSError:
                        pass
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


def stop_if_disk_full(err: OSError, run: str, prog: str) -> None:
    """A write of the run folder failed. If its disk is full (ENOSPC, EDQUOT), stop in one sentence:
    what is on disk is the last complete checkpoint (a checkpoint is written aside and renamed, so
    a full disk leaves the previous one whole), and `--resume` continues from it. Any other error
    is raised as it was."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise err
    path = latest_checkpoint(run)
    where = "no checkpoint yet: --resume starts it over"
    if path is not None:
        with open(os.path.join(path, "COMPLETE")) as f:
            where = f"its last complete checkpoint, iteration {f.read().strip() or '?'}"
    sys.exit(f"{prog}: the disk of {run} is full ({err.strerror.lower()}); the run stopped at {where}: free some "
             f"space, then `python {prog} --resume {run}` continues from there.")

