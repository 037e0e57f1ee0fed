"""plumbing/: what the two trainers share that is not the method: the run around the algorithm.

    rundir.py      flags, the run folder, desktops, metrics.jsonl, trajectory files, seeds, timers
    dist.py        torchrun: ranks, the collectives the trainers use, FSDP2; no-ops in one process
    progress.py    progress bars, the console line, optional wandb / TensorBoard
    warm_start.py  how the tiny warm-started models (tiny-uitars, tiny-explore) are built

A reader of the methods can take these by their names: nothing here decides what the policy
learns. The algorithm is train_arpo.py / train_explore.py, grpo.py and rewards.py.
"""
