"""Tests for grpo.py: hand-computed advantages and losses, log-prob equivalence on the tiny real
Qwen2.5-VL, the multi-turn target mask, every replay-buffer rule, and that GRPO actually learns.

Run: python -m pytest -q tests/test_grpo.py        (about a minute on 2 CPU cores)
"""
import io
import math
import random

import pytest
import torch
import torch.nn.functional as F

import grpo
from grpo import ReplayBuffer, Sample, collate, grpo_loss, group_advantages, selective_log_softmax


# ----------------------------------------------------------------------------------------------
# Advantages, by hand


def test_advantages_one_group():
    # r = [1, 2, 3, 4]: mean 2.5; deviations -1.5, -0.5, 0.5, 1.5; squares sum 5; unbiased var
    # 5 / 3; std sqrt(5/3) = 1.290994 -> [-1.161895, -0.387298, 0.387298, 1.161895]
    adv = group_advantages([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(adv, torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895]), atol=1e-5)


def test_advantages_several_groups_zero_variance_and_single():
    rewards = [1.0, 0.0, 5.0, 3.0, 0.0, 7.0, 5.0, 1.0]
    groups = ["a", "b", "c", "a", "b", "d", "c", "b"]  # interleaved on purpose
    # a = [1, 3]: mean 2, std sqrt((1 + 1) / 1) = 1.414214 -> -0.707107, +0.707107
    # b = [0, 0, 1]: mean 1/3, squares 1/9 + 1/9 + 4/9 = 2/3, var 1/3, std 0.577350
    #     -> (0 - 1/3) / 0.57735 = -0.577350 (twice), (1 - 1/3) / 0.57735 = 1.154701
    # c = [5, 5]: zero variance -> 0, 0;   d = [7]: one member -> 0
    adv = group_advantages(rewards, groups)
    want = torch.tensor([-0.707107, -0.577350, 0.0, 0.707107, -0.577350, 0.0, 0.0, 1.154701])
    assert torch.allclose(adv, want, atol=1e-5)


def test_advantages_equal_floats_are_exactly_zero():
    # float32 mean([0.1] * 7) is 0.1 + 7.45e-9, and std is ~1e-9, so the plain formula would give
    # (-7.45e-9) / (1e-9 + 1e-6) = -0.0074 for every member instead of 0.
    assert torch.equal(group_advantages([0.1] * 7), torch.zeros(7))
    assert torch.equal(group_advantages([0.3]), torch.zeros(1))


def test_assign_advantages_writes_into_samples():
    samples = [Sample([1, 2], [0, 1], None, None, reward=r, group=g) for r, g in [(1, 0), (3, 0), (2, 1)]]
    grpo.assign_advantages(samples)
    # group 0 = [1, 3] -> -0.707107, +0.707107; group 1 alone -> 0
    assert [round(s.advantage, 5) for s in samples] == [-0.70711, 0.70711, 0.0]


# ----------------------------------------------------------------------------------------------
# The loss on a 2 x 3 example, by hand
#
# old_logps = -1 everywhere, logps = -1 + log(ratio), eps_low = 0.2, eps_high = 0.28
# row 0: A = +1, ratios [1.0, 1.5, 0.5], mask [1, 1, 1]
#   token 0: min(1 * 1, 1 * 1) = 1                          -> loss -1
#   token 1: min(1.5, clamp 1.28) = 1.28  (clip HIGH active)  -> loss -1.28
#   token 2: min(0.5, clamp 0.8)  = 0.5   (unclipped: A > 0)  -> loss -0.5
# row 1: A = -1, ratios [1.0, 0.5, 1.5], mask [1, 1, 0]
#   token 0: min(-1, -1) = -1                               -> loss +1
#   token 1: min(-0.5, -0.8) = -0.8       (clip LOW active)   -> loss +0.8
#   token 2: masked out (its loss would be +1.5)
# seq-mean-token-mean: row means -2.78 / 3 = -0.926667 and 1.8 / 2 = 0.9 -> mean -0.0133333
# token-mean: (-2.78 + 1.8) / 5 = -0.196
# clip_low = 1 / 5 = 0.2, clip_high = 1 / 5 = 0.2, ratio_mean = (1 + 1.5 + 0.5 + 1 + 0.5) / 5 = 0.9
# adv_mean 0, adv_std = std([1, -1]) unbiased = sqrt(2) = 1.414214

RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.5, 1.5]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])
OLD = torch.full((2, 3), -1.0)
LN2 = math.log(2.0)
# ref - logps: row 0 [0, ln 2, 0], row 1 [ln 2, 0, ln 2 (masked)]; k3 at d = ln 2 is
# exp(ln 2) - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853, at d = 0 it is 0.
D_REF = torch.tensor([[0.0, LN2, 0.0], [LN2, 0.0, LN2]])


def _logps():
    return (OLD + torch.log(RATIOS)).requires_grad_(True)


@pytest.mark.parametrize("agg,want", [("seq-mean-token-mean", -0.0133333), ("token-mean", -0.196)])
def test_grpo_loss_by_hand(agg, want):
    loss, m = grpo_loss(_logps(), OLD, ADV, MASK, agg=agg)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["clip_low"] == pytest.approx(0.2) and m["clip_high"] == pytest.approx(0.2)
    assert m["ratio_mean"] == pytest.approx(0.9, abs=1e-6)
    assert m["adv_mean"] == pytest.approx(0.0) and m["adv_std"] == pytest.approx(1.414214, abs=1e-5)
    assert m["tokens"] == 5 and m["kl"] == 0.0


@pytest.mark.parametrize("agg,want", [
    # seq: row 0 adds 0.1 * 0.306853 / 3, row 1 adds 0.1 * 0.306853 / 2; halved:
    #      -0.0133333 + 0.1 * 0.306853 * (1/3 + 1/2) / 2 = -0.0133333 + 0.0127855 = -0.0005478
    ("seq-mean-token-mean", -0.0005478),
    # token: -0.196 + 0.1 * (2 * 0.306853) / 5 = -0.196 + 0.0122741 = -0.1837259
    ("token-mean", -0.1837259),
])
def test_grpo_loss_with_kl_by_hand(agg, want):
    logps = _logps()
    loss, m = grpo_loss(logps, OLD, ADV, MASK, ref_logps=logps.detach() + D_REF, beta=0.1, agg=agg)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["kl"] == pytest.approx(2 * 0.306853 / 5, abs=1e-6)  # masked mean of k3 = 0.1227412
    # beta = 0 with a reference given: KL is reported but does not enter the loss
    loss0, m0 = grpo_loss(logps, OLD, ADV, MASK, ref_logps=logps.detach() + D_REF, beta=0.0, agg=agg)
    assert loss0.item() == pytest.approx(-0.0133333 if agg.startswith("seq") else -0.196, abs=1e-6)
    assert m0["kl"] == pytest.approx(0.1227412, abs=1e-6)


def test_grpo_loss_gradient_by_hand():
    # d loss / d logps of an unclipped token is -ratio * A times its aggregation weight; a clipped
    # token has zero gradient. seq-mean-token-mean weights: row 0 1/(3*2), row 1 1/(2*2).
    # row 0 (A=+1): [-1/6, 0 (clipped), -0.5/6];  row 1 (A=-1): [+1/4, 0 (clipped), 0 (masked)]
    logps = _logps()
    loss, _ = grpo_loss(logps, OLD, ADV, MASK)
    loss.backward()
    want = torch.tensor([[-1 / 6, 0.0, -0.5 / 6], [0.25, 0.0, 0.0]])
    assert torch.allclose(logps.grad, want, atol=1e-6)


def test_grpo_gradient_step_moves_logps_with_the_advantage_sign():
    # A real descent step on free logits: tokens of the positive-advantage sequence must gain
    # probability, those of the negative one must lose it.
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11, requires_grad=True)  # (B, T, V)
    idx = torch.randint(0, 11, (2, 4))  # (B, T)
    mask = torch.ones(2, 4)
    before = selective_log_softmax(logits, idx).detach()  # (B, T)
    loss, _ = grpo_loss(selective_log_softmax(logits, idx), before, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    with torch.no_grad():
        after = selective_log_softmax(logits - 0.5 * logits.grad, idx)  # (B, T)
    assert (after[0] > before[0]).all() and (after[1] < before[1]).all()


def test_grpo_loss_rejects_unknown_aggregation():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        grpo_loss(_logps(), OLD, ADV, MASK, agg="sum")


# ----------------------------------------------------------------------------------------------
# selective_log_softmax


@pytest.mark.parametrize("chunk", [1 << 24, 64])  # 64 elements -> one row per logsumexp call
def test_selective_log_softmax_matches_log_softmax(monkeypatch, chunk):
    monkeypatch.setattr(grpo, "_LSE_CHUNK_ELEMS", chunk)
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 4  # (B, T, V)
    idx = torch.randint(0, 50, (3, 7))  # (B, T)
    want = logits.log_softmax(-1).gather(-1, idx[..., None]).squeeze(-1)  # (B, T)
    got = selective_log_softmax(logits, idx)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)
    # bf16 in: the result is float32 and matches the exact answer for those bf16 logits tightly,
    # and a plain bf16 log_softmax only loosely (that one rounds its output to 8 bits).
    lb = logits.bfloat16()
    got_b = selective_log_softmax(lb, idx)
    assert got_b.dtype == torch.float32
    exact = lb.float().log_softmax(-1).gather(-1, idx[..., None]).squeeze(-1)
    assert torch.allclose(got_b, exact, atol=1e-5)
    naive_b = lb.log_softmax(-1).gather(-1, idx[..., None]).squeeze(-1).float()
    assert torch.allclose(got_b, naive_b, atol=0.1)


# ----------------------------------------------------------------------------------------------
# Replay buffer


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
    assert injected and trajs == ["success", "b", "c"] and scores == [1.0, 0.0, 0.0]
    # lowest scorer among nearly equal ones: [0.02, 0.0, 0.01] std 0.01, mean 0.01 -> index 1
    trajs, scores, injected = rb.inject("t", ["a", "b", "c"], [0.02, 0.0, 0.01])
    assert injected and trajs == ["a", "success", "c"] and scores == [0.02, 1.0, 0.01]
    # std too large: [0, 0.1] has std 0.0707 >= 0.05 (mean 0.05 is low enough) -> untouched
    assert rb.inject("t", ["a", "b"], [0.0, 0.1]) == (["a", "b"], [0.0, 0.1], False)
    # mean too high: [0.2, 0.2] std 0 but mean 0.2 is not < 0.2 -> untouched
    assert rb.inject("t", ["a", "b"], [0.2, 0.2])[2] is False
    # thresholds are arguments: std_below = 0.1 makes the [0, 0.1] group qualify (0.0707 < 0.1)
    assert rb.inject("t", ["a", "b"], [0.0, 0.1], std_below=0.1)[2] is True
    # nothing stored for this task -> nothing to inject
    assert rb.inject("other", ["a", "b"], [0.0, 0.0]) == (["a", "b"], [0.0, 0.0], False)
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
