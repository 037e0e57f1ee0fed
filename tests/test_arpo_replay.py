"""Tests for arpo_replay.py's buffer: the success threshold is strict and the capacity drops the
oldest; injection only into a group that failed alike, in place of its lowest scorer; a checkpoint
round trip replays the same choices (its RNG included). The replay inside a real ARPO iteration:
tests/test_train_arpo.py.

Run: python -m pytest -q tests/test_arpo_replay.py        (~1 s)
"""
import io

import torch

from grpo import ReplayBuffer


def test_replay_threshold_is_strict_and_capacity_drops_oldest():
    rb = ReplayBuffer(capacity_per_task=3, success_threshold=0.1)
    assert not rb.add("t", "exactly-threshold", 0.1)  # 0.1 is not > 0.1
    assert not rb.add("t", "fail", 0.0) and not rb.add("t", "nan", float("nan"))
    assert rb.sample("t") is None and len(rb) == 0
    for i in range(5):
        assert rb.add("t", f"ok{i}", 0.5 + i / 10)
    assert [t for t, _ in rb.data["t"]] == ["ok2", "ok3", "ok4"]  # ok0, ok1 dropped, oldest first
    assert {rb.sample("t") for _ in range(50)} == {"ok2", "ok3", "ok4"}
    assert rb.sample("other") is None


def test_replay_inject_conditions():
    rb = ReplayBuffer()
    rb.add("t", "success", 1.0)
    # all failed (std 0 < 0.05, mean 0 < 0.2): the lowest scorer (first of the zeros) is replaced
    trajs, scores, injected = rb.inject("t", ["a", "b", "c"], [0.0, 0.0, 0.0])
    assert injected == 0 and trajs == ["success", "b", "c"] and scores == [1.0, 0.0, 0.0]
    # lowest scorer among nearly equal ones: [0.02, 0.0, 0.01] std 0.01, mean 0.01 -> index 1
    trajs, scores, injected = rb.inject("t", ["a", "b", "c"], [0.02, 0.0, 0.01])
    assert injected == 1 and trajs == ["a", "success", "c"] and scores == [0.02, 1.0, 0.01]
    # ARPO's code replaces the FIRST member; a lone partial success there (std 0.0354 < 0.05,
    # mean 0.0125) would be lost. We keep it and replace the first of the zeros.
    trajs, scores, injected = rb.inject("t", list("abcdefgh"), [0.1] + [0.0] * 7)
    assert injected == 1 and trajs == ["a", "success"] + list("cdefgh") and scores[:2] == [0.1, 1.0]
    # std too large: [0, 0.1] has std 0.0707 >= 0.05 (mean 0.05 is low enough) -> untouched
    assert rb.inject("t", ["a", "b"], [0.0, 0.1]) == (["a", "b"], [0.0, 0.1], None)
    # mean too high: [0.2, 0.2] std 0 but mean 0.2 is not < 0.2 -> untouched
    assert rb.inject("t", ["a", "b"], [0.2, 0.2])[2] is None
    # thresholds are arguments: std_below = 0.1 makes the [0, 0.1] group qualify (0.0707 < 0.1)
    assert rb.inject("t", ["a", "b"], [0.0, 0.1], std_below=0.1)[2] == 0
    # nothing stored for this task -> nothing to inject
    assert rb.inject("other", ["a", "b"], [0.0, 0.0]) == (["a", "b"], [0.0, 0.0], None)
    # the input lists are not modified in place
    group = ["a", "b"]
    rb.inject("t", group, [0.0, 0.0])
    assert group == ["a", "b"]


def test_replay_state_dict_round_trip_including_rng():
    rb = ReplayBuffer(capacity_per_task=4, success_threshold=0.3, seed=7)
    for i in range(6):
        rb.add(f"task{i % 2}", {"steps": [i, i + 1], "id": i}, 0.5)
    rb.sample("task0")  # advance the RNG a little
    buf = io.BytesIO()
    torch.save(rb.state_dict(), buf)  # must be plain enough for torch.save / weights_only load
    buf.seek(0)
    rb2 = ReplayBuffer(seed=123)
    rb2.load_state_dict(torch.load(buf, weights_only=True))
    assert rb2.capacity_per_task == 4 and rb2.success_threshold == 0.3 and rb2.data == rb.data
    # the same future choices: a resumed run replays exactly what the original would have done
    seq1 = [rb.sample("task0")["id"] for _ in range(20)] + [rb.inject("task1", [0, 1], [0, 0])[0][0]["id"]]
    seq2 = [rb2.sample("task0")["id"] for _ in range(20)] + [rb2.inject("task1", [0, 1], [0, 0])[0][0]["id"]]
    assert seq1 == seq2 and len(set(seq1[:20])) > 1
