"""plumbing/rundir.py: what both trainers share around the algorithm: flags, the run folder, desktops,
metrics.jsonl, trajectory files, seeds and timers (checkpoints and resume: plumbing/ckpt.py).

    lr: float = rundir.arg(1e-6, "AdamW learning rate")               # one Args field = one flag
    args, given = rundir.parse_args(Args, argv, "train_arpo.py")      # one flag per Args field
    with rundir.new_run(path):                                        # a failed start leaves no folder
    pool, live, screen = rundir.open_desktops(args.vms, args.token, args.vm_timeout)
    with rundir.timed(times, "update"):                               # times["time/update"] += seconds
    rundir.end_iteration(run, trackers, metrics, console_line)        # metrics.jsonl, trackers, console

    runs/<name>/args.json            the Args of the run (also inside every checkpoint)
    runs/<name>/metrics.jsonl        one JSON line per finished iteration
    runs/<name>/trajectories/it000012/vm03.jsonl + vm03_step00.png ...   what the agent saw and did
    runs/<name>/ckpt/                the latest checkpoint (state.pt + policy/; plumbing/ckpt.py)

One vocabulary for both scripts. Flags: --ckpt-every, --eval-episodes, --resume, --eval-only
(with --resume: evaluate the run's checkpoint), --no-<flag> for a flag that defaults to on, and a
flag whose default is worked out (`--groups`, `--sample-seed`) defaults to None and says in its
help what it then is. Metrics: `actor/<x>` for the update's numbers (actor/loss, actor/kl,
actor/clip_low, actor/lr, ...), `time/<phase>` for seconds (time/iteration is the whole iteration).
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, field, is_dataclass

import numpy as np
import torch

from env import VMPool, png_bytes
from plumbing import dist, progress

# -----------------------------------------------------------------------------------------------
# Flags: one per Args field, parsed by transformers' HfArgumentParser


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


def public_args(args) -> dict:
    """The run's args for disk (args.json, every checkpoint): --token blanked. Run folders get
    copied and shared (view.py puts args.json into its HTML report), and the token gives control
    of the VMs; on resume, pass --token again or set VM_TOKEN."""
    d = dict(asdict(args) if is_dataclass(args) else args)
    if d.get("token"):
        d["token"] = ""
    return d


# -----------------------------------------------------------------------------------------------
# Desktops, seeds, timers


def local_vms(vms: str) -> tuple[str, int]:
    """This rank's share of --vms (a number of local desktops, or URLs): a contiguous slice, and
    its VM offset, the index of its first VM among all ranks' (trajectories and metrics name VMs by it)."""
    if vms.startswith("osworld:"):  # OSWorld's VMs (osworld_env.py): the same slicing, one entry a VM
        import osworld_env
        try:
            specs = osworld_env.expand(vms)
        except ValueError as e:
            sys.exit(f"--vms: {e}.")
        mine = dist.shard_range(len(specs))
        if not mine:
            sys.exit(f"--vms {vms}: {len(specs)} VM(s) for {dist.size()} ranks leaves rank {dist.rank()} without one.")
        return osworld_env.join(specs[mine.start:mine.stop]), mine.start
    urls = [u.strip() for u in vms.split(",") if u.strip()]
    n = int(urls[0]) if len(urls) == 1 and urls[0].isdigit() else len(urls)
    mine = dist.shard_range(n)
    if n and not mine:
        sys.exit(f"--vms {vms}: {n} VM(s) for {dist.size()} ranks leaves rank {dist.rank()} without one; "
                 "give every rank at least one VM.")
    return (str(len(mine)) if len(urls) == 1 and urls[0].isdigit() else ",".join(urls[mine.start:mine.stop])), mine.start


def open_desktops(vms: str, token: str, timeout: float, screen=(1280, 720), limits: str = "",
                  osworld_cache: str = "cache") -> tuple:
    """This rank's VMs (all of them in one process) -> (VMPool, live VM indices, screen (w, h) of
    the first live one), or one sentence when the VMs cannot start or none answers /health. The
    pool numbers its VMs among all ranks' (VMPool.first: its first VM's number). `osworld:...` VMs
    are OSWorld's (osworld_env.py), their downloads cached under `osworld_cache`."""
    vms, first = local_vms(vms)
    try:
        if vms.startswith("osworld:"):
            import osworld_env
            clients = osworld_env.open_clients(vms, osworld_cache, screen, timeout)
            pool = VMPool(clients=clients, timeout=timeout, screen=screen, first=first)
        else:
            pool = VMPool(vms, token=token or os.environ.get("VM_TOKEN") or None, timeout=timeout, screen=screen,
                          first=first, limits=limits)
    except SystemExit:
        raise
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
            print(f"vm {first + i} left out: {h.error}", flush=True)
    return pool, live, tuple(health[min(live)].value.get("screen", screen))


def seed_all(seed: int, sample_seed: int | None = None) -> None:
    """Python, numpy and torch; torch's generator (what sampling draws from) may get its own seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed if sample_seed is None else sample_seed)


def cpu_threads(threads: int | None, on_gpu: bool) -> None:
    """torch's CPU threads: `threads` if given, else on a CPU run half the cores (a GPU run keeps
    torch's default). OpenMP threads spin while they wait; next to Xvfb desktops (and ScreenExplorer's
    OCR) on the same cores, a tiny model's steps on every core ran far slower than on half of them,
    and took the desktops' CPU while they waited (docs/log.md: bench/arpo_multi_iter.py)."""
    if threads or not on_gpu:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // 2))


@contextlib.contextmanager
def timed(times: dict, phase: str):
    """Add the block's wall time to times["time/<phase>"] (a phase may run several times)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[f"time/{phase}"] = times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


# -----------------------------------------------------------------------------------------------
# What an iteration writes: metrics.jsonl, trackers, trajectory files


def add_times(times: dict, more: dict) -> None:
    """Add another phase timing's seconds (a Rollout's time/*) to an iteration's `times`."""
    for k, v in more.items():
        times[k] = times.get(k, 0.0) + v


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
                with open(os.path.join(folder, name), "wb") as out:
                    out.write(png_bytes(img))  # the PNG the VM sent, as it came (no encoding again)
                step["screenshot"] = name
            f.write(json.dumps(step, default=str) + "\n")
    return folder
