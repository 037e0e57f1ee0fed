"""The model family seam (qwen_vl.py): Qwen2-VL, Qwen2.5-VL and Qwen3-VL through the whole loop, and
loading that refuses what would half-load.

    python -m pytest -q tests/test_families.py        (about a minute on 2 CPU cores)

Each family is a tiny model of its REAL transformers class built from qwen_vl.tiny_config (random
weights, CPU): generate, the trainer's log-probs of what was sampled (equal to the sampler's),
update_policy, save and load, with LoRA and full fine-tuning; the chat template; the resize factor
the coordinates are mapped with (28 / 28 / 32). Loading goes through the auto class and refuses,
in one sentence, a folder whose weights do not all load: a config of one family over the weights
of another (the Qwen3-VL-read-as-Qwen2.5-VL case), a folder missing one weight, and a model type
qwen_vl.FAMILIES does not know.
"""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
import model as M
import qwen_vl
from actions import smart_resize
from model import encode_chat, explore_messages, uitars_messages

FAMILIES = {"tiny-qwen2-vl": ("Qwen2VLForConditionalGeneration", 28),
            "tiny": ("Qwen2_5_VLForConditionalGeneration", 28),
            "tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration", 32)}


def _img(w, h, seed):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def name(request):
    return request.param


def _logits(policy, enc):
    with torch.no_grad():
        return policy.model(input_ids=torch.tensor([enc.input_ids]), pixel_values=enc.pixel_values,
                            image_grid_thw=enc.image_grid_thw).logits[0]  # (T, V)


def test_the_real_class_its_family_and_its_resize_factor(name):
    cls, factor = FAMILIES[name]
    p = M.load_policy(name, seed=0)
    assert type(p.model).__name__ == cls == p.family.architecture
    assert p.family is qwen_vl.FAMILIES[p.model.config.model_type]
    assert p.resize_factor == factor == p.family.resize_factor
    # The image the model sees is smart_resize's with this factor (both sides multiples of it), so
    # a coordinate the model writes maps back to the screen through actions.to_screen correctly.
    for w, h in [(1280, 720), (333, 211), (1920, 1080)]:
        enc = encode_chat(p, explore_messages(_img(w, h, 0)))
        sh, sw = smart_resize(h, w, factor=p.resize_factor, min_pixels=M.MIN_PIXELS, max_pixels=M.MAX_PIXELS)
        assert enc.image_sizes == [(sw, sh)] and sw % factor == 0 and sh % factor == 0
        pads = enc.input_ids.count(p.model.config.image_token_id)
        assert pads == (sw // factor) * (sh // factor)  # one token per factor x factor pixels


def test_encoding_matches_the_families_chat_template(name):
    p = M.load_policy(name, seed=0)
    msgs = uitars_messages("Open it.", [_img(200, 120, 1), _img(120, 200, 2)], ["Thought: a\nAction: wait()"])
    ours = encode_chat(p, msgs).input_ids
    pad = p.model.config.image_token_id
    ours = [t for i, t in enumerate(ours) if t != pad or ours[i - 1] != pad]  # one pad per image, as the template
    theirs = p.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    text = p.tokenizer.decode(ours)
    # Qwen2/2.5-VL's template adds a default system turn, Qwen3-VL's does not.
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.") == (name != "tiny-qwen3-vl")


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_generate_logprobs_update_save_load(name, lora_rank, tmp_path):
    p = M.load_policy(name, seed=0, lora_rank=lora_rank)
    prompts = [explore_messages(_img(200, 120, 3)),
               uitars_messages("Do it.", [_img(160, 160, 4), _img(250, 140, 5)], ["Thought: x\nAction: wait()"]),
               [{"role": "user", "content": "no image"}]]
    torch.manual_seed(0)
    gens = M.generate(p, prompts, max_new_tokens=12, temperature=0.7)
    samples = [grpo.step_sample(g.prompt, g.ids, old_logps=g.logprobs) for g in gens]
    # The trainer scores the sampled tokens exactly as the sampler drew them (3D rope, left vs
    # right padding, images of several sizes, the vision tokens banned).
    batch = {**grpo.collate(samples, p.tokenizer.pad_token_id), "temperature": 0.7, "suppressed": p.suppressed_ids()}
    with torch.no_grad():
        lp = grpo.per_token_logps(p.model, batch)  # (B, T)
    on = batch["target_mask"].bool()
    gap = (lp[on] - batch["old_logps"][on]).abs().max().item()
    assert gap < 1e-4, gap
    # Batched greedy decoding equals one prompt at a time (left padding with 3D rope positions).
    batched = M.generate(p, prompts, max_new_tokens=6, temperature=0)
    for msgs, b in zip(prompts, batched):
        assert b.ids == M.generate(p, [msgs], max_new_tokens=6, temperature=0)[0].ids
    # One GRPO update moves the policy, with the sampler's log-probs agreeing with the trainer's.
    for s, a in zip(samples, (1.0, -1.0, 0.5)):
        s.advantage = a
    params = [q for q in p.model.parameters() if q.requires_grad]
    before = [q.detach().clone() for q in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    m = grpo.update_policy(p, opt, samples, temperature=0.7)
    assert np.isfinite(m["loss"]) and m["logp_gap"] < 1e-4 and m["tokens"] > 0
    assert any(not torch.equal(q, b) for q, b in zip(params, before))
    if lora_rank:
        assert all("lora_" in n and "language_model" in n for n, q in p.model.named_parameters() if q.requires_grad)
    # Save and load: the same class, the same outputs (LoRA is saved merged, a plain checkpoint).
    enc = encode_chat(p, prompts[1])
    want = _logits(p, enc)
    M.save_policy(p, str(tmp_path))
    back = M.load_policy(str(tmp_path))
    assert type(back.model) is type(p.model.get_base_model() if lora_rank else p.model) and not back.lora
    assert back.family is p.family and back.resize_factor == p.resize_factor
    assert torch.allclose(_logits(back, encode_chat(back, prompts[1])), want, atol=1e-4 if lora_rank else 1e-6)


# ----------------------------------------------------------------------------------------------
# Loading refuses what would half-load


def test_a_qwen3_vl_folder_loads_as_qwen3_vl(tmp_path):
    # What the old hard-coded Qwen2_5_VLForConditionalGeneration.from_pretrained got wrong.
    p = M.load_policy("tiny-qwen3-vl", seed=2)
    M.save_policy(p, str(tmp_path))
    back = M.load_policy(str(tmp_path))
    assert type(back.model).__name__ == "Qwen3VLForConditionalGeneration"
    want = p.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.model.state_dict().items())


def _refused(path) -> str:
    with pytest.raises(M.ModelNotFound) as e:
        M.load_policy(str(path))
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, SystemExit), msg
    return msg


def test_a_config_of_one_family_over_another_familys_weights_is_refused(tmp_path):
    M.save_policy(M.load_policy("tiny-qwen3-vl", seed=0), str(tmp_path / "q3"))
    M.save_policy(M.load_policy("tiny", seed=0), str(tmp_path / "q25"))
    # Qwen3-VL weights with a Qwen2.5-VL config.json: transformers would build a Qwen2.5-VL and
    # start every weight it does not find at random.
    os.replace(tmp_path / "q25" / "config.json", tmp_path / "q3" / "config.json")
    n = len(M.load_policy("tiny", seed=0).model.state_dict())
    msg = _refused(tmp_path / "q3")
    missing = int(msg.split("Refusing")[1].split(": ")[1].split(" of the")[0])
    assert 0 < missing < n and f"of the {n} weights of the Qwen2_5_VLForConditionalGeneration" in msg
    assert "model_type 'qwen2_5_vl'" in msg and "stored tensors fit no weight" in msg


def test_a_folder_missing_one_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    M.save_policy(M.load_policy("tiny", seed=0), str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["visual.merger.mlp.0.weight"]  # the file keeps the original checkpoints' names
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    n = len(M.load_policy("tiny", seed=0).model.state_dict())
    msg = _refused(tmp_path)
    assert f"Refusing '{tmp_path}': 1 of the {n} weights" in msg and "(e.g. model.visual.merger.mlp.0.weight)" in msg


def test_a_model_type_of_no_known_family_is_refused(tmp_path):
    from transformers import Qwen2Config
    config = Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    config.save_pretrained(tmp_path)  # a text-only Qwen2: a model type with no row in qwen_vl.FAMILIES
    msg = _refused(tmp_path)
    assert "model type 'qwen2'" in msg and "qwen_vl.py" in msg and "qwen3_vl" in msg


# ----------------------------------------------------------------------------------------------
# What vLLM is handed (tests/test_vllm_engine.py has the rest, on the tiny Qwen2.5-VL)


def test_vllm_gets_the_familys_architecture_and_the_same_prompt_ids(name):
    import vllm_engine as V
    from transformers import AutoConfig
    p = M.load_policy(name, seed=0)

    class Owner:
        pass

    owner = Owner()
    config = AutoConfig.from_pretrained(V.engine_folder(p, owner))
    assert config.architectures == [FAMILIES[name][0]] and config.model_type == p.family.model_type
    msgs = uitars_messages("Open it.", [_img(333, 211, 6), _img(640, 360, 7)], ["Action: wait()"])
    [enc], [prompt] = V.engine_prompts(p, [msgs])
    pad = p.model.config.image_token_id
    ids = prompt["prompt_token_ids"]
    assert ids.count(pad) == 2  # vLLM expands each pad from its image: back to ours, token for token
    assert qwen_vl.expand_image_tokens(ids, [0] * len(ids), enc.image_grid_thw, pad)[0] == enc.input_ids
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == enc.image_sizes


def test_context_length_counts_tokens_of_the_familys_size():
    import vllm_engine as V
    # Qwen3-VL: one token per 32x32 pixels. 1920x1080 at max_pixels 2,116,800 -> 1920x1088 =
    # 60 x 34 = 2,040 tokens; bound 2,116,800 // 1,024 = 2,067 + 7 = 2,074 a screenshot, 15 of them
    # 31,110, + 15 answers of 256 + 6 = 3,930, + 2,048 prompt = 37,088 -> 37,888 (37 x 1,024);
    # at 28 pixels a token (Qwen2.5-VL) the same flags need 47,104.
    h, w = smart_resize(1080, 1920, factor=32, max_pixels=2116800)
    assert (h, w) == (1088, 1920) and (h // 32) * (w // 32) == 2040
    assert V.needed_model_len(15, 2116800, 15 * 262, factor=32) == 37888
    assert V.needed_model_len(15, 2116800, 15 * 262) == 47104
