"""The run folder both train scripts write: args, metrics, trajectories, checkpoints.

    runs/<name>/args.json            the Args of the run (also inside every checkpoint)
    runs/<name>/metrics.jsonl        one JSON line per finished iteration
    runs/<name>/trajectories/it000012/vm03.jsonl + vm03_step00.png ...   what the agent saw and did
    runs/<name>/ckpt/                the latest checkpoint (state.pt + policy/ + extra files)

Why a shared file when STYLE.md says the two train scripts may repeat setup: the crash-safety
rules below are easy to get subtly wrong (a half-written checkpoint, an iteration logged twice after
a resume), and two copies would drift. Everything else about a run lives in the train scripts.

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
import json
import os
import shutil
import time
from dataclasses import asdict, is_dataclass

import torch


def make_run_dir(root: str, name: str | None, args, resume: str | None = None) -> str:
    """Create (or reopen, on resume) the run folder and write args.json."""
    if resume:
        if not os.path.isdir(resume):
            raise SystemExit(f"--resume {resume}: no such run folder; pass a folder under runs/.")
        path = resume
    else:
        name = name or time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(root, name)
        if os.path.exists(os.path.join(path, "ckpt")):
            raise SystemExit(f"{path} already holds a run; use --resume {path} or another --run-name.")
    os.makedirs(os.path.join(path, "trajectories"), exist_ok=True)
    with open(os.path.join(path, "args.json"), "w") as f:
        json.dump(public_args(args), f, indent=2)
    return path


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
        f.write(str(state.get("iteration", "")))
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
    import random

    import numpy as np
    # On a GPU, HF generate samples with the CUDA generator: without its state a resumed run would
    # draw different answers from the same checkpoint.
    # Only if CUDA is in use: asking would otherwise start it for a CPU run on a GPU machine.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": cuda}


def set_rng_state(s: dict) -> None:
    import random

    import numpy as np
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    # Absent in checkpoints written before it was saved; skipped when resuming on a machine with a
    # different number of GPUs (or none), where the old states cannot be mapped one to one.
    cuda = s.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


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


def log_metrics(run: str, metrics: dict) -> None:
    """Append one iteration's metrics (must carry "iteration") as one fsynced JSON line."""
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())


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
