"""Tests for grpo.py on the tiny real Qwen2.5-VL (model.load_policy("tiny")): log-probs against the
naive full-vocabulary way on padded image batches and multi-turn trajectories, the multi-turn target
mask, the update's micro-batches, epochs, clips, KL, mini-batch shuffle and temperature, the
distillation step, bad values, and that GRPO actually learns a simple reward.

Run: python -m pytest -q tests/test_grpo_model.py        (about a minute on 2 CPU cores)
The formulas by hand (advantages, the loss, collation, the selective log-softmax): tests/test_grpo.py.
"""
import copy
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import grpo
import model as M
from model import encode_chat, explore_messages, uitars_messages
from grpo import collate, grpo_loss, group_advantages



@pytest.fixture(scope="module")
def policy():
    return M.load_policy("tiny", seed=0)


def _image(w, h, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _completion(policy, n, seed):
    # Random ordinary tokens (ids below the special ones), closed by <|im_end|> like a finished answer.
    g = torch.Generator().manual_seed(seed)
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first_special = policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return torch.randint(0, first_special, (n,), generator=g).tolist() + [im_end]


def _naive_logps(model, batch):
    """The straightforward way: full (B, T, V) logits, log_softmax everywhere, gather."""
    ids = batch["input_ids"]  # (B, T)
    kw = {}
    if batch["pixel_values"] is not None:
        kw = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                  mm_token_type_ids=(ids == model.config.image_token_id).int())  # (B, T)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], **kw).logits  # (B, T, V)
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    lp = F.pad(lp, (1, 0))  # (B, T): position 0 has no prediction
    mask = batch["target_mask"].clone()
    mask[:, 0] = 0
    return lp * mask


def _explore_step(policy, w, h, seed, n_comp):
    prompt = encode_chat(policy, explore_messages(_image(w, h, seed)))
    return grpo.step_sample(prompt, _completion(policy, n_comp, seed), reward=float(seed))


def test_step_sample_and_collate(policy):
    a, b = _explore_step(policy, 120, 90, 1, 5), _explore_step(policy, 64, 160, 2, 11)
    n_prompt = len(a.input_ids) - 6
    assert a.target_mask == [0] * n_prompt + [1] * 6
    batch = collate([a, b], pad_id=policy.tokenizer.pad_token_id)
    B, T = batch["input_ids"].shape
    assert (B, T) == (2, max(len(a.input_ids), len(b.input_ids)))
    assert batch["attention_mask"].sum(1).tolist() == [len(a.input_ids), len(b.input_ids)]
    assert batch["target_mask"].sum(1).tolist() == [6, 12]
    assert batch["pixel_values"].shape[0] == a.pixel_values.shape[0] + b.pixel_values.shape[0]
    assert batch["image_grid_thw"].shape == (2, 3) and batch["advantages"].shape == (2,)


def test_per_token_logps_matches_naive_on_padded_image_batch(policy):
    m = policy.model.eval()
    a, b = _explore_step(policy, 120, 90, 1, 5), _explore_step(policy, 64, 160, 2, 11)
    batch = collate([a, b], pad_id=policy.tokenizer.pad_token_id)
    with torch.no_grad():
        got = grpo.per_token_logps(m, batch)  # (B, T)
        want = _naive_logps(m, batch)
    assert got.shape == batch["input_ids"].shape
    assert torch.allclose(got, want, atol=1e-5)
    assert (got[batch["target_mask"] == 0] == 0).all() and (got[batch["target_mask"] == 1] < 0).all()
    # Each row equals that sample scored alone: padding and the image split do not leak.
    for i, s in enumerate([a, b]):
        with torch.no_grad():
            alone = grpo.per_token_logps(m, collate([s]))  # (1, T_i)
        assert torch.allclose(alone[0], got[i, :len(s.input_ids)], atol=1e-5)


def _trajectory(policy, turns):
    shots = [_image(100 + 20 * i, 80, 10 + i) for i in range(len(turns))]
    msgs = uitars_messages("Open the calculator.", shots, turns)
    return encode_chat(policy, msgs, add_generation_prompt=False)


def test_per_token_logps_matches_naive_on_multi_turn_trajectory(policy):
    m = policy.model.eval()
    enc = _trajectory(policy, ["Thought: open it\nAction: click(start_box='(10,20)')",
                               _completion(policy, 7, 3),  # sampled ids, used verbatim
                               "Thought: done\nAction: finished(content='ok')"])
    s = grpo.trajectory_sample(enc, reward=1.0, group="calc")
    batch = collate([s, _explore_step(policy, 90, 90, 4, 3)])
    with torch.no_grad():
        assert torch.allclose(grpo.per_token_logps(m, batch), _naive_logps(m, batch), atol=1e-5)


def test_multi_turn_mask_covers_exactly_the_assistant_tokens(policy):
    turns = ["Thought: open it\nAction: click(start_box='(10,20)')", _completion(policy, 7, 3),
             "Thought: done\nAction: finished(content='ok')"]
    enc = _trajectory(policy, turns)
    tok = policy.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    # Walk the ChatML structure ourselves: in each "<|im_start|>role\n ... <|im_end|>" turn, the
    # mask must be 1 from after the header through <|im_end|> for assistants, 0 everywhere else.
    ids, mask = enc.input_ids, enc.target_mask
    expected, role, i = [0] * len(ids), None, 0
    while i < len(ids):
        if ids[i] == im_start:
            j = i + 1
            while tok.decode(ids[i + 1:j]).endswith("\n") is False:
                j += 1
            role, i = tok.decode(ids[i + 1:j]).strip(), j
            continue
        if role == "assistant":
            expected[i] = 1
            if ids[i] == im_end:
                role = None
        i += 1
    assert mask == expected and sum(mask) > 0
    # ... and the target tokens are the three answers, each closed by <|im_end|>.
    spans = tok.decode([t for t, k in zip(ids, mask) if k]).split("<|im_end|>")
    assert spans[0] == turns[0] and spans[2] == turns[2] and spans[3] == ""
    assert tok.decode(turns[1][:-1]) == spans[1]


def test_update_policy_micro_batches_give_the_full_batch_gradient(policy):
    # Same samples, one SGD step: accumulating over micro-batches of 1 must land on the same
    # weights as one batch of 3, for both aggregations (this is what the loss scaling is for).
    samples = [_explore_step(policy, 60 + 10 * i, 60, i, 3 + 4 * i) for i in range(3)]
    for s, a in zip(samples, [1.0, -0.5, -0.5]):
        s.advantage = a
    for agg in ("seq-mean-token-mean", "token-mean"):
        ends = []
        for mbs in (1, 3):
            net = copy.deepcopy(policy.model)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            met = grpo.update_policy(net, opt, samples, micro_batch_size=mbs, agg=agg, max_grad_norm=0.5)
            ends.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
            assert met["steps"] == 1 and met["ratio_mean"] == pytest.approx(1.0)
            assert met["tokens"] == 3 + 7 + 11 + 3  # completion lengths + one <|im_end|> each
        assert (ends[0] - ends[1]).abs().max() < 1e-5
        assert (ends[0] - torch.cat([p.flatten() for p in policy.model.parameters()])).abs().max() > 1e-4


def test_update_policy_several_steps_clip_and_lora_kl(policy):
    lora = M.load_policy("tiny", seed=0, lora_rank=4)
    samples = [_explore_step(lora, 60, 60, i, 6) for i in range(4)]
    for s, a in zip(samples, [1.0, 1.0, -1.0, -1.0]):
        s.advantage = a
    opt = torch.optim.AdamW([p for p in lora.model.parameters() if p.requires_grad], lr=5e-2)
    # Two mini-batches x two epochs = four steps; old log-probs fixed before the first one, so
    # later steps see ratios != 1 (and, at this large lr, clipping); the reference is the same
    # weights with the adapter off, so the KL starts at exactly 0 (LoRA's B = 0) and then grows.
    met = grpo.update_policy(lora, opt, samples, micro_batch_size=1, mini_batch_size=2, epochs=2, beta=0.04)
    assert met["steps"] == 4 and met["ratio_mean"] != pytest.approx(1.0) and met["kl"] > 0
    assert met["clip_low"] + met["clip_high"] > 0
    fresh = M.load_policy("tiny", seed=0, lora_rank=4)
    first = grpo.update_policy(fresh, torch.optim.SGD(fresh.model.parameters(), lr=0.1), samples[:1], beta=0.04)
    assert first["kl"] == 0.0
    # Full fine-tuning with beta > 0 needs a reference: a clear error, or an explicit ref_fn.
    with pytest.raises(ValueError, match="ref_fn"):
        grpo.update_policy(policy.model, opt, samples, beta=0.04)
    frozen = copy.deepcopy(policy.model).eval()
    net = copy.deepcopy(policy.model)
    met = grpo.update_policy(net, torch.optim.SGD(net.parameters(), lr=0.1), samples, beta=0.04,
                             ref_fn=lambda b: grpo.per_token_logps(frozen, b))
    assert met["kl"] == pytest.approx(0.0, abs=1e-6) and met["grad_norm"] > 0


def _with_recomputed_old_logps(model, samples, shift=0.0):
    """Give each sample the trainer's own log-probs of its target tokens (+ shift) as old_logps."""
    with torch.no_grad():
        for s in samples:
            lp = grpo.per_token_logps(model, collate([s]))[0]  # (T,)
            s.old_logps = (lp[torch.tensor(s.target_mask).bool()] + shift).tolist()
    return samples


def test_update_policy_scores_old_logps_itself_and_logs_the_samplers_gap(policy):
    # The samples carry "sampler" log-probs 0.5 above the trainer's own. The update must take its
    # old log-probs from its own forward pass (every first-step ratio is 1, nothing is clipped) and
    # report the gap: mean |trainer - sampler| over the target tokens = 0.5.
    samples = [_explore_step(policy, 60 + 10 * i, 60, i, 3 + 4 * i) for i in range(3)]  # 4, 8, 12 targets
    for s, a in zip(samples, [1.0, -0.5, -0.5]):
        s.advantage = a
    _with_recomputed_old_logps(policy.model, samples, shift=0.5)
    for mini in (None, 1):  # one optimizer step (the on-policy shortcut), and three
        net = copy.deepcopy(policy.model)
        met = grpo.update_policy(net, torch.optim.SGD(net.parameters(), lr=0.1), samples, micro_batch_size=1,
                                 mini_batch_size=mini)
        assert met["logp_gap"] == pytest.approx(0.5, abs=1e-5)
        if mini is None:  # the one step is the first: ratio 1 (later steps see weights the earlier ones moved)
            assert met["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            assert met["clip_low"] == 0.0 and met["clip_high"] == 0.0


def test_update_policy_passes_the_dual_clip_to_the_loss(policy):
    # Two epochs at a large step: in the second the ratios are far from 1, and the negative
    # advantages' losses are capped at c * |A| only when dual_clip is given (the cap's arithmetic
    # is test_grpo_loss_dual_clip_by_hand's).
    samples = [_explore_step(policy, 60 + 10 * i, 60, i, 3 + 4 * i) for i in range(3)]
    for s, a in zip(samples, [1.0, -0.5, -0.5]):
        s.advantage = a
    mets = {}
    for dual in (1.01, None):
        net = copy.deepcopy(policy.model)
        mets[dual] = grpo.update_policy(net, torch.optim.SGD(net.parameters(), lr=20.0), samples,
                                        micro_batch_size=3, epochs=2, dual_clip=dual)
    assert mets[1.01]["clip_dual"] > 0 and mets[None]["clip_dual"] == 0.0
    assert mets[1.01]["loss"] < mets[None]["loss"]


def test_update_policy_shuffles_mini_batches_with_the_given_generator(policy):
    samples = [_explore_step(policy, 60 + 10 * i, 60, i, 2 + i) for i in range(4)]
    for s, a in zip(samples, [1.0, 1.0, -1.0, -1.0]):
        s.advantage = a
    order = list(samples)

    def run(shuffle):
        net = copy.deepcopy(policy.model)
        met = grpo.update_policy(net, torch.optim.SGD(net.parameters(), lr=0.5), samples, micro_batch_size=2,
                                 mini_batch_size=2, shuffle=shuffle)
        return met, torch.cat([p.detach().flatten() for p in net.parameters()])
    met, plain = run(None)
    assert met["steps"] == 2
    # Unshuffled, step 1 is the two positive samples; a seed that splits them gives other weights.
    _, a = run(random.Random(3))
    _, b = run(random.Random(3))
    assert (a - b).abs().max() == 0  # seeded: the same mini-batches again
    assert (a - plain).abs().max() > 1e-4
    assert samples == order  # the caller's list is not reordered


def test_trainer_scores_the_sampling_temperature(policy):
    # Sampled at T = 0.7: the trainer's log-probs of the sampled tokens at the same T are the
    # sampler's (Answer.logprobs), token by token; scored at T = 1 they differ.
    torch.manual_seed(0)
    prompts = [explore_messages(_image(64, 48, 5)), [{"role": "user", "content": "hello"}]]
    gens = M.generate(policy, prompts, max_new_tokens=16, temperature=0.7)
    samples = [grpo.step_sample(g.prompt, g.ids, old_logps=g.logprobs) for g in gens]
    gaps = {}
    for t in (0.7, 1.0):  # lr 0: the policy stays as it sampled
        met = grpo.update_policy(policy, torch.optim.SGD(policy.model.parameters(), lr=0.0), samples, temperature=t)
        gaps[t] = met["logp_gap"]
    assert gaps[0.7] < 1e-4 and gaps[1.0] > 0.2, gaps
    with torch.no_grad():
        b = {**collate(samples), "suppressed": policy.suppressed_ids()}
        lp = grpo.per_token_logps(policy.model, b, temperature=0.7)  # (B, T)
    on = b["target_mask"].bool()
    assert torch.allclose(lp[on], b["old_logps"][on], atol=1e-4)


def test_distill_step_reports_the_mean_nll_of_the_target_tokens(policy):
    # The reported nll is the mean over target tokens (position 0 excluded: nothing predicts it)
    # of -log softmax(logits)[token], from the weights BEFORE the step; micro-batches of 1.
    net = copy.deepcopy(policy.model)
    samples = [_explore_step(policy, 60, 60, i, 3 + 2 * i) for i in range(2)]  # 4 and 6 targets
    with torch.no_grad():
        naive = _naive_logps(net, collate(samples))  # (B, T), 0 off target
    want = float(-naive.sum() / 10)
    m = grpo.distill_step(net, torch.optim.SGD(net.parameters(), lr=0.1), samples, micro_batch_size=1)
    assert m["tokens"] == 10 and m["nll"] == pytest.approx(want, abs=1e-5)
    assert want > 0 and m["grad_norm"] > 0


def test_distill_step_lowers_nll(policy):
    net = copy.deepcopy(policy.model)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    samples = [_explore_step(policy, 60, 60, i, 8) for i in range(2)]
    first = grpo.distill_step(net, opt, samples)
    for _ in range(5):
        last = grpo.distill_step(net, opt, samples)
    assert first["tokens"] == 18 and last["nll"] < first["nll"] - 0.5


def test_grpo_learns_a_simple_reward():
    # Reward = share of completion tokens drawn from a fixed quarter of the vocabulary. A random
    # tiny policy starts near 0.25; ten GRPO iterations (16 samples of 8 tokens, full fine-tuning,
    # two mini-batch steps x two epochs per rollout) must raise it clearly. Two seeds, averaged:
    # the bar is 0.15 (and neither may get worse).
    msgs = [{"role": "user", "content": "Write anything."}]
    gains = []
    for seed in (0, 1):
        pol = M.load_policy("tiny", seed=seed)
        target = set(range(0, pol.tokenizer.convert_tokens_to_ids("<|endoftext|>"), 4))

        def reward(ids):
            return sum(t in target for t in ids) / max(1, len(ids))

        def mean_reward():
            torch.manual_seed(123)
            return sum(reward(g.ids) for g in M.generate(pol, [msgs] * 32, max_new_tokens=8)) / 32

        before = mean_reward()
        opt = torch.optim.AdamW(pol.model.parameters(), lr=1e-2)
        torch.manual_seed(seed)
        for _ in range(10):
            gens = M.generate(pol, [msgs] * 16, max_new_tokens=8)
            samples = [grpo.step_sample(g.prompt, g.ids, reward(g.ids)) for g in gens]
            for s, a in zip(samples, group_advantages([s.reward for s in samples]).tolist()):
                s.advantage = a  # one group, like ScreenExplorer's rollout buffer
            grpo.update_policy(pol, opt, samples, micro_batch_size=8, mini_batch_size=8, epochs=2)
        gains.append(mean_reward() - before)
    print("GRPO reward gains per seed:", gains)
    assert min(gains) > 0 and sum(gains) / len(gains) > 0.15, gains


def test_no_target_tokens_and_bad_values_do_not_crash(policy):
    # A sample without any target token (e.g. a step whose completion was empty) contributes
    # nothing and breaks nothing; a -inf log-prob off the mask cannot produce NaN.
    empty = grpo.step_sample(encode_chat(policy, [{"role": "user", "content": "hi"}]), [], reward=1.0)
    net = copy.deepcopy(policy.model)
    met = grpo.update_policy(net, torch.optim.SGD(net.parameters(), lr=0.1), [empty])
    assert met["tokens"] == 0 and met["loss"] == 0.0 and met["skipped"] == 0.0
    logps = torch.tensor([[-1.0, -math.inf]], requires_grad=True)
    loss, _ = grpo_loss(logps, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[1, 0]]),
                        ref_logps=torch.tensor([[-1.0, 0.0]]), beta=0.1)
    loss.backward()
    assert loss.item() == -1.0 and torch.isfinite(logps.grad).all()
