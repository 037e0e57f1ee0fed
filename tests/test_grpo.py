"""Tests for grpo.py's formulas with hand-computed numbers: advantages (GRPO, Dr. GRPO), the clipped
loss (aggregations, KL, per-token advantages, dual clip, sequence weights, its gradient), collation,
and the selective log-softmax against the full one. On the tiny real model: tests/test_grpo_model.py.

Run: python -m pytest -q tests/test_grpo.py        (a few seconds)
"""
import math

import numpy as np
import pytest
import torch

import grpo
from grpo import Sample, collate, grpo_loss, group_advantages, selective_log_softmax


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


def test_advantages_with_tensor_or_numpy_group_ids():
    # Ids given as a tensor iterate as 0-d tensors that hash by identity: each member would be its
    # own group and get 0. They must group by value, exactly like the list.
    # groups [1, 2] and [3, 4]: means 1.5 and 3.5, std sqrt(0.25 + 0.25) = 0.707107 each
    #   -> (1 - 1.5) / 0.707107 = -0.707107, then +0.707107, -0.707107, +0.707107
    want = torch.tensor([-0.707107, 0.707107, -0.707107, 0.707107])
    assert torch.allclose(group_advantages([1, 2, 3, 4], [0, 0, 1, 1]), want, atol=1e-5)
    assert torch.allclose(group_advantages([1, 2, 3, 4], torch.tensor([0, 0, 1, 1])), want, atol=1e-5)
    assert torch.allclose(group_advantages([1, 2, 3, 4], np.array([0, 0, 1, 1])), want, atol=1e-5)
    assert torch.allclose(group_advantages(torch.tensor([1.0, 2, 3, 4]), [torch.tensor(0)] * 2 + [torch.tensor(1)] * 2),
                          want, atol=1e-5)


def test_dr_grpo_advantages_are_mean_centred_only():
    # scale=False (Dr. GRPO): A = r - mean_g, no division by the std.
    # a = [1, 3]: mean 2 -> -1, +1 (GRPO: -0.707107, +0.707107)
    # b = [0, 0, 1]: mean 1/3 -> -0.333333 (twice), 0.666667 (GRPO: -0.57735, 1.154701)
    # c = [5, 5]: 0, 0;  d = [7]: one member -> 0
    rewards = [1.0, 0.0, 5.0, 3.0, 0.0, 7.0, 5.0, 1.0]
    groups = ["a", "b", "c", "a", "b", "d", "c", "b"]
    adv = group_advantages(rewards, groups, scale=False)
    want = torch.tensor([-1.0, -1 / 3, 0.0, 1.0, -1 / 3, 0.0, 0.0, 2 / 3])
    assert torch.allclose(adv, want, atol=1e-6)
    # the two differ exactly by each group's std + eps: b's std 0.577350 -> -0.333333 / 0.577351 = -0.577350
    assert torch.allclose(group_advantages(rewards, groups)[[1, 4, 7]], adv[[1, 4, 7]] / (0.5773503 + 1e-6), atol=1e-5)
    # a reward scale survives Dr. GRPO (x10 rewards, x10 advantages) and not GRPO
    assert torch.allclose(group_advantages([10.0, 30.0], scale=False), torch.tensor([-10.0, 10.0]))
    assert torch.allclose(group_advantages([10.0, 30.0]), group_advantages([1.0, 3.0]), atol=1e-5)
    assert torch.equal(group_advantages([0.1] * 7, scale=False), torch.zeros(7))  # equal rewards: exactly 0


def test_advantages_equal_floats_are_exactly_zero():
    # float32 mean([0.1] * 7) is 0.1 + 7.45e-9, and std is ~1e-9, so the plain formula would give
    # (-7.45e-9) / (1e-9 + 1e-6) = -0.0074 for every member instead of 0.
    assert torch.equal(group_advantages([0.1] * 7), torch.zeros(7))
    assert torch.equal(group_advantages([0.3]), torch.zeros(1))


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


# Per-token advantages (B, T) (grpo_loss allows them), same ratios, mask and eps as above:
# row 0: A = [1, -1, 2], ratios [1.0, 1.5, 0.5]
#   token 0: min(1, 1) = 1                                   -> loss -1
#   token 1: min(1.5 * -1, 1.28 * -1) = -1.5 (A < 0, high ratio: not clipped) -> loss +1.5
#   token 2: min(0.5 * 2, 0.8 * 2) = 1.0 (A > 0, low ratio: not clipped)     -> loss -1.0
#   row sum -0.5, row mean -0.5 / 3 = -0.1666667
# row 1: A = [0.5, -1, 3], ratios [1.0, 0.5, 1.5], mask [1, 1, 0]
#   token 0: min(0.5, 0.5) = 0.5                             -> loss -0.5
#   token 1: min(-0.5, 0.8 * -1 = -0.8) = -0.8 (clip LOW)     -> loss +0.8
#   token 2: masked (its A = 3 must not count anywhere)
#   row sum 0.3, row mean 0.15
# seq-mean-token-mean: (-0.1666667 + 0.15) / 2 = -0.0083333;  token-mean: (-0.5 + 0.3) / 5 = -0.04
# clip_low 1/5 = 0.2, clip_high 0 (row 0 token 1 has ratio 1.5 but A < 0)
# adv over the 5 target tokens [1, -1, 2, 0.5, -1]: mean 1.5 / 5 = 0.3; squared deviations
#   0.49 + 1.69 + 2.89 + 0.04 + 1.69 = 6.8, unbiased var 6.8 / 4 = 1.7, std 1.303840
# gradient (seq weights 1/6 row 0, 1/4 row 1; unclipped: -ratio * A * weight):
#   row 0: [-1 * 1 / 6, -1.5 * -1 / 6, -0.5 * 2 / 6] = [-0.1666667, 0.25, -0.1666667]
#   row 1: [-1 * 0.5 / 4, 0 (clipped), 0 (masked)]   = [-0.125, 0, 0]
ADV_TOK = torch.tensor([[1.0, -1.0, 2.0], [0.5, -1.0, 3.0]])


@pytest.mark.parametrize("agg,want", [("seq-mean-token-mean", -0.0083333), ("token-mean", -0.04)])
def test_grpo_loss_per_token_advantages_by_hand(agg, want):
    logps = _logps()
    loss, m = grpo_loss(logps, OLD, ADV_TOK, MASK, agg=agg)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["clip_low"] == pytest.approx(0.2) and m["clip_high"] == 0.0
    assert m["adv_mean"] == pytest.approx(0.3, abs=1e-6) and m["adv_std"] == pytest.approx(1.303840, abs=1e-5)
    assert m["tokens"] == 5 and m["ratio_mean"] == pytest.approx(0.9, abs=1e-6)
    if agg == "seq-mean-token-mean":
        loss.backward()
        want_grad = torch.tensor([[-1 / 6, 0.25, -1 / 6], [-0.125, 0.0, 0.0]])
        assert torch.allclose(logps.grad, want_grad, atol=1e-6)


# Dual clip (c = 3), eps 0.2 / 0.28; row 0 A = -1, ratios [4, 2, 0.5]; row 1 A = +1, ratios [4, 1, 0.5]
# row 0: token 0: max(4, 1.28) = 4, capped at c * |A| = 3 (DUAL)        -> 3
#        token 1: max(2, 1.28) = 2 < 3                                  -> 2
#        token 2: max(0.5, 0.8) = 0.8 (clip LOW), < 3                   -> 0.8     row mean 5.8 / 3
# row 1: token 0: -min(4, 1.28) = -1.28 (clip HIGH; no dual clip for A > 0)
#        token 1: -1;  token 2 masked                                            row mean -2.28 / 2
# seq-mean-token-mean: (1.9333333 - 1.14) / 2 = 0.3966667;  token-mean: (5.8 - 2.28) / 5 = 0.704
# without the dual clip row 0 is (4 + 2 + 0.8) / 3: 0.5633333 and 0.904
# clip_dual = clip_low = clip_high = 1 / 5
# gradient (seq weights 1/6, 1/4): only unclipped tokens, -ratio * A * weight:
#   row 0: [0 (dual), -2 * -1 / 6 = 1/3, 0 (low)];  row 1: [0 (high), -1 / 4, 0 (masked)]
DUAL_RATIOS = torch.tensor([[4.0, 2.0, 0.5], [4.0, 1.0, 0.5]])


@pytest.mark.parametrize("agg,want,off", [("seq-mean-token-mean", 0.3966667, 0.5633333), ("token-mean", 0.704, 0.904)])
def test_grpo_loss_dual_clip_by_hand(agg, want, off):
    logps = (OLD + torch.log(DUAL_RATIOS)).requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0])
    loss, m = grpo_loss(logps, OLD, adv, MASK, agg=agg, dual_clip=3.0)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert (m["clip_dual"], m["clip_low"], m["clip_high"]) == pytest.approx((0.2, 0.2, 0.2))
    assert grpo_loss(logps, OLD, adv, MASK, agg=agg)[0].item() == pytest.approx(off, abs=1e-6)  # default off
    if agg == "seq-mean-token-mean":
        loss.backward()
        assert torch.allclose(logps.grad, torch.tensor([[0.0, 1 / 3, 0.0], [0.0, -0.25, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="above 1"):
        grpo_loss(logps, OLD, adv, MASK, dual_clip=0.5)


def test_grpo_loss_dual_clip_matches_verls_formula():
    # verl's compute_policy_loss, written out: pg1 = -A r, pg2 = -A clip(r), pg3 = -A c;
    # higher = max(pg1, pg2); lower = min(higher, pg3); where(A < 0, lower, higher); token mean.
    g = torch.Generator().manual_seed(0)
    logps, old = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    adv = torch.randn(4, 9, generator=g) * 2  # (B, T)
    mask = (torch.rand(4, 9, generator=g) > 0.2).float()
    r = torch.exp(logps - old)
    higher = torch.max(-adv * r, -adv * r.clamp(0.8, 1.3))
    final = torch.where(adv < 0, torch.min(higher, -adv * 3.0), higher)
    verl = (final * mask).sum() / mask.sum()
    loss, m = grpo_loss(logps, old, adv, mask, eps_low=0.2, eps_high=0.3, agg="token-mean", dual_clip=3.0)
    assert loss.item() == pytest.approx(verl.item(), abs=1e-6) and m["clip_dual"] > 0


def test_grpo_loss_sequence_weights_by_hand():
    # Row means of the first hand-computed case: row 0 (A = +1) (-1 - 1.28 - 0.5) / 3 = -0.9266667,
    # row 1 (A = -1) (1 + 0.8) / 2 = 0.9. Weights [0.25, 0.75] (or [1, 3]: only their ratio counts):
    # 0.25 * -0.9266667 + 0.75 * 0.9 = 0.4433333. token-mean ignores weights: -0.196.
    for w in ([0.25, 0.75], [1.0, 3.0]):
        loss, _ = grpo_loss(_logps(), OLD, ADV, MASK, seq_weights=torch.tensor(w))
        assert loss.item() == pytest.approx(0.4433333, abs=1e-6)
    assert grpo_loss(_logps(), OLD, ADV, MASK, agg="token-mean", seq_weights=torch.tensor([0.25, 0.75]))[0].item() \
        == pytest.approx(-0.196, abs=1e-6)
    # A sequence of 5 target tokens cut into pieces of 3 and 2, weighted 3/5 and 2/5, is the same
    # loss and gradient as the whole (what ARPO's per-turn pieces rely on), also next to another row.
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(1, 5, generator=g) * 0.3, torch.randn(1, 5, generator=g) * 0.3
    other_lp, other_old = torch.randn(1, 5, generator=g) * 0.3, torch.randn(1, 5, generator=g) * 0.3
    whole = torch.cat([lp, other_lp]).requires_grad_(True)  # (2, 5)
    l1, _ = grpo_loss(whole, torch.cat([old, other_old]), torch.tensor([-0.7, 1.2]), torch.ones(2, 5), dual_clip=3.0)
    l1.backward()
    cut = torch.stack([torch.cat([lp[0, :3], torch.zeros(2)]), torch.cat([lp[0, 3:], torch.zeros(3)]),
                       other_lp[0]]).requires_grad_(True)  # (3, 5)
    cut_old = torch.stack([torch.cat([old[0, :3], torch.zeros(2)]), torch.cat([old[0, 3:], torch.zeros(3)]), other_old[0]])
    cut_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    l2, _ = grpo_loss(cut, cut_old, torch.tensor([-0.7, -0.7, 1.2]), cut_mask, dual_clip=3.0,
                      seq_weights=torch.tensor([0.6, 0.4, 1.0]))
    l2.backward()
    assert l2.item() == pytest.approx(l1.item(), abs=1e-6)
    grad = torch.cat([cut.grad[0, :3], cut.grad[1, :2]])
    assert torch.allclose(grad, whole.grad[0], atol=1e-6) and torch.allclose(cut.grad[2], whole.grad[1], atol=1e-6)


def test_grpo_loss_rejects_unknown_aggregation():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        grpo_loss(_logps(), OLD, ADV, MASK, agg="sum")


# ----------------------------------------------------------------------------------------------
# Collation: rewards and the sampler's old log-probs travel with the micro-batch


def test_collate_aligns_carried_old_logps_with_the_target_tokens():
    a = Sample([5, 6, 7, 8], [0, 1, 0, 1], None, None, reward=2.0, old_logps=[-0.5, -1.5])
    b = Sample([5, 6, 7], [0, 1, 1], None, None, reward=-1.0, old_logps=[-2.0, -3.0])
    batch = collate([a, b])
    # each value lands on its target token, in order; prompt, gap and padding stay 0
    want = torch.tensor([[0.0, -0.5, 0.0, -1.5], [0.0, -2.0, -3.0, 0.0]])
    assert torch.equal(batch["old_logps"], want)
    assert torch.equal(batch["rewards"], torch.tensor([2.0, -1.0]))
    # step_sample: the completion's log-probs follow the prompt
    prompt = type("Enc", (), dict(input_ids=[1, 2], pixel_values=None, image_grid_thw=None))
    s = grpo.step_sample(prompt, [3, 4], reward=0.5, old_logps=[-0.1, -0.2])
    assert torch.allclose(collate([s])["old_logps"], torch.tensor([[0.0, 0.0, -0.1, -0.2]]))
    # one sample without them: no (B, T) tensor at all (rewards always)
    c = Sample([5, 6], [0, 1], None, None, reward=1.0)
    assert collate([a, c])["old_logps"] is None and collate([a, c])["rewards"].tolist() == [2.0, 1.0]
    # a count that does not match the target tokens is a clear error, not a silent shift
    with pytest.raises(ValueError, match="one log-prob per completion token"):
        collate([Sample([5, 6, 7], [0, 1, 1], None, None, old_logps=[-1.0])])


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


@pytest.mark.parametrize("chunk", [1 << 24, 16])
def test_selective_log_softmax_gradient(monkeypatch, chunk):
    # The hand-written backward (onehot - softmax) against finite differences, in float64, and
    # against autograd through log_softmax + gather in float32.
    monkeypatch.setattr(grpo, "_LSE_CHUNK_ELEMS", chunk)
    torch.manual_seed(0)
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)  # (N, V)
    idx = torch.tensor([0, 3, 8, 3, 1])  # (N,), a repeated index on purpose
    assert torch.autograd.gradcheck(lambda t: selective_log_softmax(t, idx), (x,))
    a = torch.randn(2, 3, 7, requires_grad=True)  # (B, T, V)
    b = a.detach().clone().requires_grad_(True)
    i = torch.randint(0, 7, (2, 3))  # (B, T)
    w = torch.randn(2, 3)  # (B, T)
    (selective_log_softmax(a, i) * w).sum().backward()
    (b.log_softmax(-1).gather(-1, i[..., None]).squeeze(-1) * w).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
