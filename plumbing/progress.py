"""plumbing/progress.py: what a running train script shows and sends: progress bars, console lines, trackers.

    from plumbing import progress
    for t in progress.track(range(args.steps), "rollout"):  # a tqdm bar on a terminal, silent in logs
    with progress.bar(len(jobs), "eval") as pb:             # the same, advanced by hand: pb.update(n)
    progress.say(console_line(metrics))                     # the iteration's line, above open bars
    tr = progress.open_trackers(run, asdict(args), wandb=args.wandb, tensorboard=args.tensorboard)
    progress.log(tr, metrics, step=it)                      # every number of the metrics line
    progress.close(tr)

Why a shared file rather than setup repeated in each train script: both need the same three
small things, and each has one trap that is easy to get wrong twice. A bar and print() fight over
the terminal (say() goes through tqdm.write); a bar in a log file is thousands of \\r lines (bars
show only on a terminal unless asked); a tracker must be an optional import (a missing package is
one sentence, not a traceback, and nobody pays its import time without the flag).

tqdm comes with transformers (huggingface_hub requires it); wandb and tensorboard are optional:
`pip install wandb` / `pip install tensorboard`. wandb runs under the run folder's name, with its
id kept in runs/<name>/wandb_id so --resume continues the same wandb run; TensorBoard writes to
runs/<name>/tb (`tensorboard --logdir runs`). The report of a finished run is view.py's.
"""
import os
import secrets
import sys
from dataclasses import dataclass

# -----------------------------------------------------------------------------------------------
# Progress bars and console lines

# Under torchrun only rank 0 shows bars and console lines (dist.mute_others sets this on the others).
MUTED = False


class _Quiet:
    """The stand-in when there is no bar to draw: the same calls, doing nothing."""
    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bar(total: int, desc: str, enabled: bool | None = None, file=None):
    """A tqdm bar over `total` units named `desc`, removed when done (the console keeps one line per
    iteration). enabled=None: only when the stream is a terminal (or PROGRESS=1 is set); no tqdm
    installed: a silent stand-in. Use as a context manager, or call .close()."""
    if enabled is None:
        enabled = not MUTED and (os.environ.get("PROGRESS") == "1" or (file or sys.stderr).isatty())
    if not enabled:
        return _Quiet()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet()
    return tqdm(total=total, desc=desc, leave=False, file=file, dynamic_ncols=True, mininterval=0.5)


def track(iterable, desc: str, total: int | None = None, enabled: bool | None = None):
    """`for t in track(range(n), "rollout"):` -- the iterable with a bar (see bar), or as it is."""
    if enabled is None:
        enabled = not MUTED and (os.environ.get("PROGRESS") == "1" or sys.stderr.isatty())
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True, mininterval=0.5) if enabled else iterable


def say(line: str) -> None:
    """Print one console line without tearing an open bar (tqdm.write moves the bar below it)."""
    if MUTED:
        return
    try:
        from tqdm import tqdm
        tqdm.write(line, file=sys.stdout)
    except ImportError:
        print(line)
    sys.stdout.flush()


def scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics line, nested dicts flattened as "a/b"; lists, strings, None dropped
    (ARPO's per-group lists stay in metrics.jsonl and view.py; a tracker wants scalars)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):  # v == v: not NaN
            out[f"{prefix}{k}"] = float(v)
    return out


# -----------------------------------------------------------------------------------------------
# Trackers: wandb and TensorBoard, each imported only when asked for


@dataclass
class Trackers:
    """The open trackers of a run; None where not asked for."""
    wandb: object = None        # a wandb Run
    tensorboard: object = None  # a torch.utils.tensorboard.SummaryWriter


def open_trackers(run: str, config: dict, wandb: bool = False, tensorboard: bool = False,
                  project: str = "gui-agent-rl") -> Trackers:
    """Start the trackers asked for; a missing package ends the program in one sentence."""
    tr = Trackers()
    if wandb:
        try:
            import wandb as wb
        except ImportError:
            raise SystemExit("--wandb needs the wandb package: pip install wandb (or drop --wandb).")
        id_file = os.path.join(run, "wandb_id")
        if os.path.exists(id_file):  # a resumed run goes on in the same wandb run
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)  # wandb ids: lower-case letters and digits
            with open(id_file, "w") as f:
                f.write(run_id)
        tr.wandb = wb.init(project=os.environ.get("WANDB_PROJECT", project), name=os.path.basename(os.path.abspath(run)),
                           id=run_id, resume="allow", dir=run, config=config)
    if tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SystemExit("--tensorboard needs the tensorboard package: pip install tensorboard (or drop --tensorboard).")
        tr.tensorboard = SummaryWriter(log_dir=os.path.join(run, "tb"))
    return tr


def log(tr: Trackers, metrics: dict, step: int) -> None:
    """Send one iteration's numbers (see scalars) to every open tracker, at x = the iteration."""
    s = scalars({k: v for k, v in metrics.items() if k != "iteration"})
    if tr.wandb is not None:
        tr.wandb.log(s, step=step)
    if tr.tensorboard is not None:
        for k, v in s.items():
            tr.tensorboard.add_scalar(k, v, step)
        tr.tensorboard.flush()  # a crash later still leaves this iteration on disk


def close(tr: Trackers) -> None:
    if tr.wandb is not None:
        tr.wandb.finish()
    if tr.tensorboard is not None:
        tr.tensorboard.close()
