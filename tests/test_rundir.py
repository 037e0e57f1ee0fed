"""Tests for plumbing/rundir.py's shared plumbing: flags, run paths, resume of saved args, checkpoint meaning.

    python -m pytest -q tests/test_rundir.py

The atomic checkpoint and metrics rules are tests/test_crash_resume.py's; old run folders resumed by
the real scripts are tests/test_old_runs.py's.
"""
import json
import os

import pytest

import grpo
from plumbing import ckpt, rundir
import train_arpo
import train_explore


def test_run_path_never_nests_the_runs_folder(tmp_path):
    assert rundir.run_path("runs", "x") == os.path.join("runs", "x")
    assert rundir.run_path("runs", "runs/x") == "runs/x"  # not runs/runs/x
    assert rundir.run_path("runs", "./runs/x") == "./runs/x"
    assert rundir.run_path("runs", "sub/x") == os.path.join("runs", "sub", "x")
    assert rundir.run_path("runs", str(tmp_path / "abs")) == str(tmp_path / "abs")
    assert rundir.run_path("", "here") == "here"
    assert rundir.run_path("runs", "", prefix="eval-").startswith(os.path.join("runs", "eval-"))


@pytest.mark.parametrize("cls, prog", [(train_arpo.Args, "train_arpo.py"), (train_explore.Args, "train_explore.py")])
def test_both_scripts_parse_flags_alike(cls, prog):
    # one spelling per field (dashes or underscores), --no-x for a flag that is on by default,
    # --x / --x false for one that is off; `given` holds only what was typed
    args, given = rundir.parse_args(cls, ["--eval-only", "--ckpt-every", "3", "--eval_episodes", "2", "--lr", "1e-5",
                                          "--wandb", "false"], prog)
    assert (args.eval_only, args.ckpt_every, args.eval_episodes, args.lr, args.wandb) == (True, 3, 2, 1e-5, False)
    assert given == {"eval_only": True, "ckpt_every": 3, "eval_episodes": 2, "lr": 1e-5, "wandb": False}
    assert rundir.parse_args(cls, [], prog) == (cls(), {})
    with pytest.raises(SystemExit, match=rf"^{prog}: .*--ckpt-every.*; see --help for the flags\.$"):
        rundir.parse_args(cls, ["--ckpt-every", "often"], prog)
    with pytest.raises(SystemExit, match="unrecognized arguments: --save-every"):
        rundir.parse_args(cls, ["--save-every", "2"], prog)


def test_resume_args_renames_old_flags_and_refuses_the_other_scripts_run(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    # an args.json of a run killed before its first checkpoint, with the old flag names
    (run / "args.json").write_text(json.dumps({"save_every": 4, "wm_epochs": 2, "lr": 1e-3, "gone_flag": 1}))
    args, given = rundir.parse_args(train_explore.Args, ["--resume", str(run), "--lr", "2e-3"], "train_explore.py")
    args, state = ckpt.resume_args(train_explore.Args, args, given, "train_explore.py", marker="wm_epochs")
    assert state is None and (args.ckpt_every, args.wm_epochs, args.lr, args.resume) == (4, 2, 2e-3, str(run))
    args, given = rundir.parse_args(train_arpo.Args, ["--resume", str(run)], "train_arpo.py")
    with pytest.raises(SystemExit, match="not a train_arpo.py run"):
        ckpt.resume_args(train_arpo.Args, args, given, "train_arpo.py", marker="group_size")
    args, given = rundir.parse_args(train_explore.Args, ["--resume", str(run), "--eval-only"], "train_explore.py")
    with pytest.raises(SystemExit, match="no checkpoint there to evaluate"):
        ckpt.resume_args(train_explore.Args, args, given, "train_explore.py", marker="wm_epochs")
    args, given = rundir.parse_args(train_explore.Args, ["--resume", str(tmp_path / "nope")], "train_explore.py")
    with pytest.raises(SystemExit, match="no such run folder"):
        ckpt.resume_args(train_explore.Args, args, given, "train_explore.py", marker="wm_epochs")


def test_next_iteration_reads_every_format():
    assert ckpt.next_iteration({"next_iteration": 5, "iteration": 9}) == 5
    assert ckpt.next_iteration({"iteration": 5, "picker": {}}) == 5  # train_arpo.py's old: the next one
    assert ckpt.next_iteration({"iteration": 5, "generation": 1}) == 6  # train_explore.py's old: the last done


def test_cpu_threads_by_hand(monkeypatch):
    """Both trainers' torch threads: what --threads says; else on a CPU half the cores (at least
    one), the desktops' share; a GPU run keeps torch's own number."""
    import torch
    before = torch.get_num_threads()
    try:
        for cores, threads, on_gpu, want in ((2, None, False, 1), (16, None, False, 8), (1, None, False, 1),
                                              (2, 3, False, 3), (16, 5, True, 5), (16, None, True, "kept")):
            torch.set_num_threads(7)
            monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
            rundir.cpu_threads(threads, on_gpu)
            assert torch.get_num_threads() == (7 if want == "kept" else want), (cores, threads, on_gpu)
    finally:
        torch.set_num_threads(before)


def test_scheduled_lr_by_hand():
    # lr 1, 2 warm-up updates of 10: 0.5, 1.0; then linear from f = 0 (update 2) to f = 7/8 (update 9)
    assert [grpo.scheduled_lr(1.0, u, 10, 2, "linear") for u in (0, 1, 2, 6, 9)] == [0.5, 1.0, 1.0, 0.5, 0.125]
    # cosine over 4, no warm-up: (1 + cos(pi u / 4)) / 2
    assert [grpo.scheduled_lr(2.0, u, 4, 0, "cosine") for u in range(4)] == pytest.approx([2.0, 1.70711, 1.0, 0.29289],
                                                                                             abs=1e-5)
    assert grpo.scheduled_lr(3e-4, 50, 10, 3, "constant") == 3e-4


def test_new_run_removes_only_a_folder_it_saw_appear(tmp_path):
    fresh, old = tmp_path / "fresh", tmp_path / "old"
    old.mkdir()
    (old / "keep").write_text("x")
    for path in (fresh, old):
        with pytest.raises(RuntimeError):
            with rundir.new_run(str(path)):
                rundir.make_run_dir(str(path), train_arpo.Args(), resume=path == old)
                raise RuntimeError("a bad --model")
    assert not fresh.exists() and (old / "keep").read_text() == "x"


def test_old_special_values_read_as_the_named_choices_they_were(tmp_path):
    # Run folders written when 0 / -1 stood for "work it out": they resume with today's None (and
    # dual clip 0, "off", as inf: no cap), and an explicit value stays what it was.
    run = tmp_path / "old"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"group_size": 2, "groups": 0, "sample_seed": -1, "mini_batch": 0,
                                               "dual_clip": 0}))
    args, given = rundir.parse_args(train_arpo.Args, ["--resume", str(run)], "train_arpo.py")
    args, _ = ckpt.resume_args(train_arpo.Args, args, given, "train_arpo.py", marker="group_size",
                               old_values=train_arpo.OLD_VALUES)
    assert (args.groups, args.sample_seed, args.mini_batch, args.dual_clip) == (None, None, None, float("inf"))
    (run / "args.json").write_text(json.dumps({"group_size": 2, "groups": 3, "sample_seed": 5, "mini_batch": 16,
                                               "dual_clip": 2.5}))
    args, _ = ckpt.resume_args(train_arpo.Args, args, given, "train_arpo.py", marker="group_size",
                               old_values=train_arpo.OLD_VALUES)
    assert (args.groups, args.sample_seed, args.mini_batch, args.dual_clip) == (3, 5, 16, 2.5)
    (run / "args.json").write_text(json.dumps({"wm_epochs": 3, "threads": 0, "iterations_per_generation": 0}))
    args, given = rundir.parse_args(train_explore.Args, ["--resume", str(run)], "train_explore.py")
    args, _ = ckpt.resume_args(train_explore.Args, args, given, "train_explore.py", marker="wm_epochs",
                               old_values=train_explore.OLD_VALUES)
    assert (args.threads, args.iterations_per_generation) == (None, None)

