"""Tests for model.py and model.py, on the tiny random-weight Qwen2.5-VL (the real transformers
class, CPU).

Run: python -m pytest -q tests/test_model.py        (about half a minute on 2 CPU cores)

What they pin down: the tiny model is the real class and small (bench/tiny_model.py times it); a sampled answer trains the
language model and the vision tower; images become exactly t*h*w/4 placeholder tokens; the target
mask covers exactly the assistant tokens of every turn; the UI-TARS history keeps only the last K
screenshots; batched (left-padded, 3D-rope) greedy generation equals one-prompt-at-a-time; the
returned log-probs are the sampling distribution's; save/load keeps the logits (full and LoRA);
LoRA and full fine-tuning both learn, and LoRA switched off is the base model; bad names give
one clear sentence. vllm_engine.py's tests: tests/test_vllm_engine.py.
"""
import io

import numpy as np
import pytest
import torch
from PIL import Image

import model as M
import qwen_vl
from model import encode_chat, encode_chats, explore_messages, image_parts, uitars_messages
from qwen_vl import SPECIAL_TOKENS, VISION_TOKENS, expand_image_tokens
from vllm_engine import collapse_image_pads


def _img(w, h, seed):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def policy():
    return M.load_policy("tiny", seed=0)


@pytest.fixture(scope="module")
def images():
    # Different sizes, so that grids (and token counts) differ between prompts.
    return [_img(200, 120, 0), _img(160, 160, 1), _img(300, 100, 2)]


def _forward_logits(policy, enc):
    ids = torch.tensor([enc.input_ids])  # (1, T)
    with torch.no_grad():
        return policy.model(input_ids=ids, pixel_values=enc.pixel_values,
                            image_grid_thw=enc.image_grid_thw).logits[0]  # (T, V)


# ----------------------------------------------------------------------------------------------
# The tiny model


def test_tiny_is_real_class_small_and_reproducible(policy):
    from transformers import Qwen2_5_VLForConditionalGeneration
    assert type(policy.model) is Qwen2_5_VLForConditionalGeneration
    n = sum(p.numel() for p in policy.model.parameters())
    assert n < 2_000_000, n  # a few MB
    cfg = policy.model.config
    tok = policy.tokenizer
    # The config's special ids are the tokenizer's.
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.text_config.vocab_size >= len(tok)
    for t in SPECIAL_TOKENS:  # each special token is one token
        assert len(tok(t, add_special_tokens=False).input_ids) == 1
    # Same seed -> same tokenizer and weights; another seed -> other weights.
    again = M.load_policy("tiny", seed=0)
    assert again.tokenizer.get_vocab() == tok.get_vocab()
    w0 = policy.model.lm_head.weight
    assert torch.equal(again.model.lm_head.weight, w0)
    assert not torch.equal(M.load_policy("tiny", seed=1).model.lm_head.weight, w0)
    big = M.load_policy("tiny", vocab_size=151936)
    assert big.model.lm_head.weight.shape[0] == 151936


def test_generate_then_backward_reaches_every_part(policy, images):
    # One sampled answer, encoded back as a training sample: its target log-probs send gradients
    # through the language model AND the vision tower (the image is part of the same forward).
    msgs = explore_messages(images[0])
    gen = M.generate(policy, [msgs], max_new_tokens=16)[0]
    assert 0 < len(gen.ids) == len(gen.logprobs) <= 16
    enc = encode_chat(policy, msgs + [{"role": "assistant", "content": gen.ids}],
                      add_generation_prompt=False)
    assert sum(enc.target_mask) == len(gen.ids)
    ids = torch.tensor([enc.input_ids])  # (1, T)
    logits = policy.model(input_ids=ids, pixel_values=enc.pixel_values,
                          image_grid_thw=enc.image_grid_thw).logits  # (1, T, V)
    logits[0, :-1][torch.tensor(enc.target_mask[1:]).bool()].logsumexp(-1).sum().backward()
    visual = M.inner_model(policy.model).visual
    for part in (policy.model.lm_head, visual.patch_embed):
        grads = [q.grad for q in part.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    policy.model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# Images, chat encoding, prompts


def test_expand_image_tokens_by_hand():
    # grid (t=1, h=4, w=6) -> 24 patches -> 24 / 2**2 = 6 tokens; grid (1, 2, 2) -> 1 token.
    P = 9
    ids, mask = expand_image_tokens([1, P, 2, P, 3], [0, 0, 1, 0, 1], torch.tensor([[1, 4, 6], [1, 2, 2]]), P, 2)
    assert ids == [1] + [P] * 6 + [2, P, 3]
    assert mask == [0] + [0] * 6 + [1, 0, 1]


def test_image_token_count_matches_grid(policy, images):
    enc = encode_chat(policy, [{"role": "user", "content": [
        {"type": "image", "image": im} for im in images] + [{"type": "text", "text": "hi"}]}])
    pad = policy.model.config.image_token_id
    grid = enc.image_grid_thw
    assert grid.shape == (3, 3)
    per_image = (grid.prod(-1) // 4).tolist()  # t*h*w / merge**2
    assert enc.input_ids.count(pad) == sum(per_image)
    assert enc.pixel_values.shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    # 200x120 -> smart_resize -> 196x112 (multiples of 28): 8x14 patches -> 28 tokens.
    assert enc.image_sizes[0] == (196, 112) and per_image[0] == 28
    # Runs of pads are contiguous, one per image, between vision_start and vision_end.
    vs, ve = policy.model.config.vision_start_token_id, policy.model.config.vision_end_token_id
    starts = [i for i, t in enumerate(enc.input_ids) if t == vs]
    for s, n in zip(starts, per_image):
        assert enc.input_ids[s + 1:s + 1 + n] == [pad] * n and enc.input_ids[s + 1 + n] == ve


def test_image_caps(images):
    small = M.load_policy("tiny", max_pixels=56 * 56)
    enc = encode_chat(small, explore_messages(_img(1280, 720, 3)))
    w, h = enc.image_sizes[0]
    assert w * h <= 56 * 56 and w % 28 == 0 and h % 28 == 0


def test_encode_matches_chat_template(policy, images):
    msgs = [{"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "Go."}]},
            {"role": "assistant", "content": "Thought: ok\nAction: wait()"},
            {"role": "user", "content": "next"}]
    enc = encode_chat(policy, msgs)
    pad = policy.model.config.image_token_id
    # The template writes one <|image_pad|> per image; ours expands it. Collapse and compare.
    ours = collapse_image_pads(enc.input_ids, pad)
    theirs = policy.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)


def test_target_mask_covers_exactly_the_assistant_turns(policy, images):
    answers = ["Thought: open it\nAction: click(start_box='(10,20)')",
               "Thought: type\nAction: type(content='hi')",
               "Thought: done\nAction: finished(content='ok')"]
    msgs = [{"role": "system", "content": "sys"}]
    for im, a in zip(images, answers):
        msgs += [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": "go on"}]},
                 {"role": "assistant", "content": a}]
    enc = encode_chat(policy, msgs, add_generation_prompt=False)
    tok = policy.tokenizer
    assert len(enc.target_mask) == len(enc.input_ids)
    target = [t for t, m in zip(enc.input_ids, enc.target_mask) if m]
    assert tok.decode(target) == "".join(a + "<|im_end|>" for a in answers)
    # Exactly three target runs, each ending at an <|im_end|>.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runs = [i for i in range(len(enc.target_mask)) if enc.target_mask[i] and
            (i + 1 == len(enc.target_mask) or not enc.target_mask[i + 1])]
    assert len(runs) == 3 and all(enc.input_ids[i] == im_end for i in runs)


def test_assistant_ids_verbatim(policy):
    tok = policy.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = [{"role": "user", "content": "hello"}]
    head = encode_chat(policy, prompt).input_ids
    ids = [5, 300, 7]
    # Stopped: the sampled <|im_end|> is the last target; nothing added.
    done = encode_chat(policy, prompt + [{"role": "assistant", "content": ids + [im_end]}], add_generation_prompt=False)
    assert done.input_ids[:len(head)] == head
    assert done.input_ids[len(head):len(head) + 4] == ids + [im_end]
    assert done.target_mask[len(head):len(head) + 4] == [1, 1, 1, 1] and sum(done.target_mask) == 4
    # Truncated at max_new_tokens: <|im_end|> closes the turn but is not a target.
    cut = encode_chat(policy, prompt + [{"role": "assistant", "content": ids}], add_generation_prompt=False)
    assert cut.input_ids[len(head):len(head) + 4] == ids + [im_end]
    assert cut.target_mask[len(head):len(head) + 4] == [1, 1, 1, 0]


def test_encode_chats_equals_encode_chat_one_by_one(policy, images):
    # generate() encodes through encode_chats (screenshots processed in threads); it must give
    # exactly what encode_chat gives alone, for chats with 0, 1 and 3 images and sampled ids.
    ids = encode_chat(policy, explore_messages(images[0])).input_ids[:5]
    chats = [[{"role": "user", "content": "no image here"}],
             explore_messages(images[1]),
             uitars_messages("Do it.", images[:3], ["Thought: a\nAction: wait()", "x"]),
             [*explore_messages(images[2]), {"role": "assistant", "content": ids}]]
    for one, many in zip([encode_chat(policy, c) for c in chats], encode_chats(policy, chats)):
        assert one.input_ids == many.input_ids and one.target_mask == many.target_mask
        assert one.image_sizes == many.image_sizes
        if one.pixel_values is None:
            assert many.pixel_values is None and many.image_grid_thw is None
        else:
            assert torch.equal(one.pixel_values, many.pixel_values)
            assert torch.equal(one.image_grid_thw, many.image_grid_thw)
    assert [len(e.image_sizes) for e in encode_chats(policy, chats)] == [0, 1, 3, 1]
    # One lazily opened file shared by a group of prompts (Image.open decodes on first use, and
    # that decoding is not thread-safe): processed once, the same for all.
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    lazy = Image.open(io.BytesIO(buf.getvalue()))
    ref = encode_chat(policy, explore_messages(images[0]))
    for e in encode_chats(policy, [explore_messages(lazy)] * 8):
        assert e.input_ids == ref.input_ids and torch.equal(e.pixel_values, ref.pixel_values)


def test_screenshots_are_processed_once_while_they_live(images, monkeypatch):
    # ARPO re-encodes each desktop's screenshot history at every step: a screenshot object is
    # processed once, a new object (even with the same pixels) again, and an entry goes with its image.
    import gc
    policy = M.load_policy("tiny")
    calls = []
    real = policy.image_processor.__class__.__call__
    monkeypatch.setattr(policy.image_processor.__class__, "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    history = uitars_messages("Do it.", images[:3], ["Thought: a\nAction: wait()"] * 2)
    first = encode_chat(policy, history)
    assert len(calls) == 3
    again = encode_chats(policy, [history, history])  # the next step: nothing new to process
    assert len(calls) == 3 and all(torch.equal(e.pixel_values, first.pixel_values) for e in again)
    copy = images[0].copy()
    encode_chat(policy, explore_messages(copy))  # same pixels, another object
    assert len(calls) == 4 and len(policy.pixels) == 4
    del copy
    gc.collect()
    assert len(policy.pixels) == 3 and set(policy.pixels) == {id(im) for im in images[:3]}


def test_uitars_keeps_only_last_k_images(policy):
    shots = [_img(56 + 28 * i, 56, i) for i in range(5)]  # widths 56..168 tell them apart
    answers = [f"Thought: step {i}\nAction: wait()" for i in range(4)]
    msgs = uitars_messages("Open the calculator.", shots, answers, max_images=2)
    assert "Open the calculator." in msgs[0]["content"] and "click(start_box=" in msgs[0]["content"]
    kept = image_parts(msgs)
    assert [p["image"] for p in kept] == shots[-2:]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == answers  # all answers stay
    assert msgs[-1]["role"] == "user"  # a prompt for step 5
    enc = encode_chat(policy, msgs)
    assert [w for w, h in enc.image_sizes] == [140, 168]
    # Fewer screenshots than K: all kept; equal counts: ends with the last answer (training).
    assert len(image_parts(uitars_messages("x", shots[:3], answers[:3], max_images=15))) == 3
    assert uitars_messages("x", shots[:3], answers[:3])[-1]["role"] == "assistant"


def test_explore_prompt_lists_the_actions(images):
    msgs = explore_messages(images[0])
    text = msgs[0]["content"][1]["text"]
    for a in ["Move(", "Click(", "RightClick(", "DoubleClick(", "ScrollUp(", "ScrollDown(", "Text(", "Key(", '"intent"']:
        assert a in text
    assert msgs[0]["content"][0]["image"] is images[0]


# ----------------------------------------------------------------------------------------------
# Generation


def test_batched_greedy_equals_one_by_one(policy, images):
    prompts = [explore_messages(images[0]), [{"role": "user", "content": "no image at all"}],
               explore_messages(images[2]), uitars_messages("Do it.", images[:2], ["Thought: a\nAction: wait()"])]
    batched = M.generate(policy, prompts, max_new_tokens=12, temperature=0)
    for msgs, b in zip(prompts, batched):
        one = M.generate(policy, [msgs], max_new_tokens=12, temperature=0)[0]
        assert b.ids == one.ids
        assert np.allclose(b.logprobs, one.logprobs, atol=1e-3)
        assert b.prompt.input_ids == one.prompt.input_ids


def test_sampling_logprobs_equal_a_forward_pass(policy, images):
    torch.manual_seed(0)
    prompts = [explore_messages(images[1]), [{"role": "user", "content": "hello"}]]
    for temperature in (1.0, 0.7):
        gens = M.generate(policy, prompts, max_new_tokens=10, temperature=temperature)
        banned = [policy.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
        for msgs, g in zip(prompts, gens):
            assert len(g.logprobs) == len(g.ids) > 0
            assert not set(g.ids) & set(banned)
            enc = encode_chat(policy, msgs + [{"role": "assistant", "content": g.ids}],
                                add_generation_prompt=False)
            n = len(g.prompt.input_ids)
            logits = _forward_logits(policy, enc)[n - 1:n - 1 + len(g.ids)]  # (N, V)
            # The sampling distribution: logits / temperature, vision tokens removed.
            logits = logits / temperature
            logits[:, banned] = float("-inf")
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-4), (g.logprobs, want)


def test_top_p_logprobs_are_renormalised(policy, images):
    # With a nucleus, the sampled token's probability is renormalised over the nucleus, so it can
    # only be higher than (or equal to) its full-softmax probability.
    torch.manual_seed(1)
    msgs = [{"role": "user", "content": "hello"}]
    g = M.generate(policy, [msgs], max_new_tokens=8, temperature=1.0, top_p=0.5)[0]
    enc = encode_chat(policy, msgs + [{"role": "assistant", "content": g.ids}], add_generation_prompt=False)
    n = len(g.prompt.input_ids)
    full = torch.log_softmax(_forward_logits(policy, enc)[n - 1:n - 1 + len(g.ids)], -1)
    full = full.gather(-1, torch.tensor(g.ids)[:, None])[:, 0]
    assert (torch.tensor(g.logprobs) >= full - 1e-5).all() and (torch.tensor(g.logprobs) > full + 1e-3).any()


def test_mrope_positions_are_3d(policy, images):
    # The hook makes a plain forward use the 3D image positions (as generate does): passing the
    # token types explicitly changes nothing, pretending everything is text changes the logits.
    enc = encode_chat(policy, explore_messages(images[0]))
    ids = torch.tensor([enc.input_ids])  # (1, T)
    kw = dict(input_ids=ids, pixel_values=enc.pixel_values, image_grid_thw=enc.image_grid_thw)
    with torch.no_grad():
        plain = policy.model(**kw).logits
        explicit = policy.model(**kw, **qwen_vl.mm_token_types(policy.model, ids)).logits
        text_only = policy.model(**kw, mm_token_type_ids=torch.zeros_like(ids)).logits
    assert torch.equal(plain, explicit)
    assert not torch.allclose(plain, text_only, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# Training modes, save/load, errors


def _step(policy, enc, lr=1e-2):
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    ids = torch.tensor([enc.input_ids])  # (1, T)
    logits = policy.model(input_ids=ids, pixel_values=enc.pixel_values, image_grid_thw=enc.image_grid_thw).logits
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
    loss = -(logp * torch.tensor(enc.target_mask[1:])).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.fixture(scope="module")
def train_enc(images):
    p = M.load_policy("tiny")
    return encode_chat(p, explore_messages(images[0]) + [
        {"role": "assistant", "content": '{"intent": "open", "action": "Click(10, 20)"}'}], add_generation_prompt=False)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_lora_and_full_finetuning_step_and_round_trip(tmp_path, train_enc, lora_rank):
    p = M.load_policy("tiny", lora_rank=lora_rank, gradient_checkpointing=True)
    p.model.train()
    trainable = [n for n, q in p.model.named_parameters() if q.requires_grad]
    if lora_rank:
        assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    else:
        assert len(trainable) == len(list(p.model.parameters()))
    before = _forward_logits(p, train_enc)
    first = _step(p, train_enc)
    after = _forward_logits(p, train_enc)
    assert not torch.allclose(before, after, atol=1e-4)   # the step changed the output
    assert _step(p, train_enc) < first                    # and it went the right way
    after = _forward_logits(p, train_enc)
    if lora_rank:  # adapter off = the untouched base model (grpo.update_policy's KL reference)
        with p.model.disable_adapter():
            assert torch.allclose(_forward_logits(p, train_enc), before, atol=1e-5)
    M.save_policy(p, str(tmp_path))
    back = M.load_policy(str(tmp_path))
    assert not back.lora  # LoRA is saved merged: a plain checkpoint
    # Full: the same weights, so the same logits. LoRA: x @ (W + B A) vs x @ W + (x @ A) @ B round
    # differently in float32, ~1e-5 on logits of magnitude ~10.
    assert torch.allclose(_forward_logits(back, train_enc), after, atol=1e-4 if lora_rank else 1e-6)
    assert back.tokenizer.get_vocab() == p.tokenizer.get_vocab()
    assert back.image_processor.size.longest_edge == p.image_processor.size.longest_edge


def test_bad_model_name_is_one_clear_sentence():
    with pytest.raises(M.ModelNotFound) as e:
        M.load_policy("/no/such/model-folder")
    msg = str(e.value)
    assert "--model tiny" in msg and "\n" not in msg and isinstance(e.value, SystemExit)


def test_a_hub_id_offline_is_said_at_once(monkeypatch):
    """A Hub id that is neither reachable nor cached ends in one sentence within seconds, not after
    huggingface_hub's ~25 s of retries (this machine has no network; with one, the made-up id is
    refused by the Hub just as fast)."""
    import time
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # what a user who set nothing has
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(M.ModelNotFound) as e:
        M.load_policy("no-such-org-4f1c/no-such-model")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "--model tiny" in msg and "\n" not in msg
    try:
        import requests
        requests.head(constants.ENDPOINT, timeout=3)
    except requests.RequestException:  # offline: the message names the Hub and the way out
        assert "did not answer" in msg and "not in the local cache" in msg
