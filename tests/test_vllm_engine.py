"""vllm_engine.py on CPU: everything it does that is plain Python or torch, with the real tiny model.

    python -m pytest -q tests/test_vllm_engine.py        (~1 minute on 2 CPU cores)

vLLM itself needs CUDA, so nothing here starts an engine; what only a GPU can check (vLLM's
log-probs against ours, the sync, the vision cache, memory) is bench/vllm_smoke.py's job. Checked
here: the flags vLLM would refuse; the engine's folder (never the user's, one per call, no
weights, deleted with its owner); the process state an engine start changes comes back (RNGs,
threads, gc.freeze); per-request seeds that follow torch's generator and differ per rank; the
prompts vLLM is given equal ours; the tensors a sync hands over (HF names, LoRA merged, the
engine's dtype, no autograd, a generator; under FSDP2 whole on every rank); a dropped policy has
no reference cycle (vLLM's gc.freeze would keep one alive for good); on a machine without CUDA
the engine, the trainers' --engine vllm and the smoke script stop with one sentence.
"""
import gc
import inspect
import json
import os
import random
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

import model as M
import vllm_engine as V
from model import encode_chat, explore_messages, special_id, uitars_messages
from qwen_vl import expand_image_tokens
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _img(w, h, seed):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def policy():
    return M.load_policy("tiny", seed=0)


@pytest.fixture(scope="module")
def lora_policy():
    p = M.load_policy("tiny", seed=0, lora_rank=4)
    with torch.no_grad():  # a trained adapter: B is zero at init, which would merge to nothing
        for n, q in p.model.named_parameters():
            if "lora_B" in n:
                q.copy_(torch.randn_like(q, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    return p


def _run(cmd, **kw):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, **kw)


# ----------------------------------------------------------------------------------------------
# Flags and environment


def test_temperatures_vllm_would_refuse_or_bend_are_flag_errors():
    for t in (0, 0.01, 0.7, 1.0, 2.0):
        assert not any(bad for bad, _ in V.flag_errors("vllm", t)), t
    for t in (0.005, 2.5, -1.0):
        [(bad, msg)] = V.flag_errors("vllm", 1.0, t)
        assert bad and f"not {t}" in msg and "--engine hf" in msg and "\n" not in msg
    assert not any(bad for bad, _ in V.flag_errors("hf", 2.5, 0.005))  # HF generate takes any T


@pytest.mark.parametrize("script", ["train_arpo.py", "train_explore.py"])
def test_trainers_refuse_a_vllm_temperature_before_loading_anything(script, tmp_path):
    r = _run([sys.executable, script, "--engine", "vllm", "--temperature", "2.5", "--runs-dir", str(tmp_path)])
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
    assert "not 2.5" in lines[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert os.listdir(tmp_path) == []  # no run folder


def test_an_inherited_multiprocessing_switch_is_overridden(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    V.use_inprocess_engine()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_engine_args(policy, tmp_path):
    one = V.engine_args(policy, str(tmp_path), 8192, 1, 0.35, world=1)
    assert one["model"] == str(tmp_path) and one["load_format"] == "dummy" and one["dtype"] == "float32"
    assert one["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert one["logprobs_mode"] == "processed_logprobs" and one["max_model_len"] == 8192
    assert one["distributed_executor_backend"] is None  # one process: vLLM's own single-GPU executor
    two = V.engine_args(policy, str(tmp_path), 8192, 15, 0.35, world=2)
    assert two["distributed_executor_backend"] == "external_launcher"  # torchrun: RANK / LOCAL_RANK
    assert two["limit_mm_per_prompt"]["image"] == 15


def test_context_length_fits_the_flags(policy):
    # ARPO: a 1920x1080 screen at max_pixels 2,116,800 is resized to 1932x1092 = 69 x 39 = 2,691
    # tokens. Bound per screenshot: 2,116,800 // 784 = 2,700 + 7 ChatML/vision tokens = 2,707;
    # 15 of them 40,605, + 15 answers of 256 + 6 = 3,930, + 2,048 prompt = 46,583 -> 47,104 (46 x 1024),
    # where a fixed 32,768 would hold fewer than 15 x 2,691 = 40,365 image tokens.
    from actions import smart_resize
    h, w = smart_resize(1080, 1920, max_pixels=2116800)
    assert (w // 28) * (h // 28) == 2691
    assert V.needed_model_len(15, 2116800, 15 * (256 + 6)) == 47104 > 15 * 2691 > 32768
    # ScreenExplorer (one screenshot, one answer of 128): 2,707 + 128 + 2,048 = 4,883 -> 5,120
    assert V.needed_model_len(1, 2116800, 128) == 5120
    # A real prompt at that cap (3 screenshots, 2 answers of 256 tokens so far, and the 256 to come) fits.
    from dataclasses import replace
    big = replace(policy, image_processor=M.qwen_image_processor(max_pixels=2116800), pixels={})
    answer = list(range(100, 356))  # 256 ordinary token ids
    enc = encode_chat(big, uitars_messages("Open the file manager. " * 20, [_img(1920, 1080, 4)] * 3,
                                           [answer] * 2, max_images=3))
    assert len(enc.input_ids) + 256 <= V.needed_model_len(3, 2116800, 3 * (256 + 6))
    with pytest.raises(ValueError, match="lower --max-images or --max-pixels"):
        V.needed_model_len(15, 2116800, 15 * 262, limit=32768)


# ----------------------------------------------------------------------------------------------
# The engine's folder


def test_engine_folder_is_new_small_weightless_and_deleted_with_its_owner(lora_policy, tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    user = tmp_path / "user_model"
    M.save_policy(lora_policy, str(user))
    before = {f: os.path.getmtime(user / f) for f in os.listdir(user)}
    p = M.load_policy(str(user), lora_rank=4)  # a run starting from the user's folder

    class Owner:
        pass

    owners = [Owner(), Owner()]
    folders = [V.engine_folder(p, o) for o in owners]
    assert folders[0] != folders[1] and str(user) not in folders[0]  # one per call (per rank)
    files = sorted(os.listdir(folders[0]))
    assert {"config.json", "generation_config.json", "preprocessor_config.json"} <= set(files)
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".pt"))], files  # weights come by sync
    assert {f: os.path.getmtime(user / f) for f in os.listdir(user)} == before  # the user's folder: untouched
    config = AutoConfig.from_pretrained(folders[0])
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert config.text_config.hidden_size == p.model.config.text_config.hidden_size
    assert AutoTokenizer.from_pretrained(folders[0]).get_vocab() == p.tokenizer.get_vocab()
    with open(os.path.join(folders[0], "preprocessor_config.json")) as f:
        assert json.load(f)["size"]["longest_edge"] == p.image_processor.size.longest_edge  # our max_pixels
    assert p.model.config.architectures in (None, ["Qwen2_5_VLForConditionalGeneration"])  # ours untouched
    del owners[0]  # the engine goes: its folder goes (by refcount, no cyclic GC needed)
    assert not os.path.exists(folders[0]) and os.path.exists(folders[1])


# ----------------------------------------------------------------------------------------------
# What an engine start must not change


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_process_state_comes_back_after_the_engine_start():
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    gc.unfreeze()
    try:
        with V.preserved_process_state() as inside:
            # what vLLM's engine start does (gpu_worker.py, core.py): reseed, one thread, freeze
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
            torch.set_num_threads(1)
            torch.set_float32_matmul_precision("medium")
            gc.freeze()
            _draws()
        after = _draws()
        assert inside["threads"] == 1  # what vLLM chose, for its own generate calls
        assert torch.get_num_threads() == threads and torch.get_float32_matmul_precision() == "highest"
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    assert after == _draws()  # the draws the trainer would have made without an engine


def test_torch_threads_is_scoped():
    n = torch.get_num_threads()
    with V.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_request_seeds_follow_torchs_generator_and_differ_per_rank():
    def seeds_of_rank(rank, seed=3):
        torch.manual_seed(seed + 1_000_003 * rank)  # what dist.seed_ranks does under torchrun
        return V.request_seeds(8), V.request_seeds(8)

    (a1, a2), (b1, b2) = seeds_of_rank(0), seeds_of_rank(1)
    assert (a1, a2) == seeds_of_rank(0)  # reproducible (and a checkpointed RNG state resumes them)
    assert len(set(a1 + a2 + b1 + b2)) == 32  # per request, per call and per rank: all different
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in a1)
    assert seeds_of_rank(0, seed=4)[0] != a1  # --sample-seed matters


# ----------------------------------------------------------------------------------------------
# Requests


def test_sampling_args(policy):
    args = V.sampling_args(policy, 64, 0.7, 0.9, seed=123)
    assert (args["temperature"], args["top_p"], args["max_tokens"], args["seed"], args["logprobs"]) == (0.7, 0.9, 64, 123, 0)
    assert args["stop_token_ids"] == list(policy.model.generation_config.eos_token_id)
    assert sorted(args["logit_bias"]) == sorted(policy.suppressed_ids()) and set(args["logit_bias"].values()) == {-100.0}


def test_vllm_prompts_are_ours_for_one_and_two_screenshots(policy):
    pad = special_id(policy.tokenizer, "<|image_pad|>")
    one = explore_messages(_img(333, 211, 1))
    two = uitars_messages("Open the file manager.", [_img(640, 360, 2), _img(250, 400, 3)], ["Action: wait()"])
    text = [{"role": "user", "content": "hello"}]
    encs, prompts = V.engine_prompts(policy, [one, two, text])
    for enc, prompt, n_images in zip(encs, prompts, (1, 2, 0)):
        ids = prompt["prompt_token_ids"]
        assert ids.count(pad) == n_images
        images = prompt.get("multi_modal_data", {}).get("image", [])
        assert [im.size for im in images] == enc.image_sizes and len(images) == n_images
        if not n_images:
            assert ids == enc.input_ids
            continue
        # vLLM expands each pad into t*h*w/4 of them from the image: that is our prompt, token for token
        expanded, _ = expand_image_tokens(ids, [0] * len(ids), enc.image_grid_thw, pad, 2)
        assert expanded == enc.input_ids
        # the images are already at the size our processor chose: processing them again changes nothing
        again = policy.image_processor(images=images, return_tensors="pt")
        assert torch.equal(again["image_grid_thw"], enc.image_grid_thw)
        torch.testing.assert_close(again["pixel_values"], enc.pixel_values, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# What a sync hands over


def test_sync_tensors_are_merged_hf_named_in_the_engine_dtype_without_autograd(lora_policy):
    from peft.tuners.lora import LoraLayer
    plain = M.load_policy("tiny", seed=0)
    gen = M.merged_weights(lora_policy, torch.bfloat16, every_rank=True)
    assert inspect.isgenerator(gen)  # streamed: the caller holds one tensor at a time
    got = dict(gen)
    assert sorted(got) == sorted(plain.model.state_dict())  # plain HF names: no lora_, no base_layer
    assert all(t.dtype == torch.bfloat16 and not t.requires_grad and t.grad_fn is None for t in got.values())
    base = lora_policy.model.get_base_model()
    layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    assert layers
    for name, m in layers.items():
        A, B = m.lora_A["default"].weight, m.lora_B["default"].weight  # (r, in), (out, r)
        want = m.base_layer.weight + B @ A * m.scaling["default"]  # W + B A * alpha / r
        torch.testing.assert_close(got[name + ".weight"], want.detach().to(torch.bfloat16), rtol=0, atol=0)
        assert float((B @ A).detach().abs().max()) > 1e-3  # the adapter is not zero: the merge is seen
    untouched = "model.visual.blocks.0.attn.qkv.weight"
    assert torch.equal(got[untouched], base.state_dict()[untouched].to(torch.bfloat16))


def test_merged_weights_keep_a_bf16_models_dtype():
    # peft keeps the adapter in fp32 on a bf16 model: W + B A is fp32, handed over as bf16 (the
    # weight's own dtype), never as a second fp32 copy of the language model.
    p = M.load_policy("tiny", seed=0, lora_rank=4, dtype=torch.bfloat16)
    assert any(q.dtype == torch.float32 for n, q in p.model.named_parameters() if "lora_" in n)
    assert {t.dtype for _, t in M.merged_weights(p)} == {torch.bfloat16}
    full = M.load_policy("tiny", seed=0, dtype=torch.bfloat16)
    assert {t.dtype for _, t in M.merged_weights(full, torch.float32, every_rank=True)} == {torch.float32}


def test_fsdp2_sync_tensors_are_whole_on_every_rank(tmp_path):
    script = os.path.join(ROOT, "tests", "dist_weights.py")
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), script, str(tmp_path)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    want = M.load_policy("tiny", seed=0).model.state_dict()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["sharded"]  # the model really was FSDP2-sharded
        assert sorted(got["weights"]) == sorted(want)
        for k, v in want.items():
            assert torch.equal(got["weights"][k], v.to(torch.bfloat16)), k


# ----------------------------------------------------------------------------------------------
# A dropped policy is freed by reference counting alone


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_dropped_policy_has_no_reference_cycle(lora_rank):
    # vLLM gc.freeze()s the trainer's heap at engine start: whatever is alive then is never looked
    # at by the cyclic collector again, so a policy that only a cycle collection could free (the
    # 3D-rope hook's closure and the vision windows' bound methods were such cycles) would keep
    # its GPU memory after train_explore's next generation replaced it.
    p = M.load_policy("tiny", seed=1, lora_rank=lora_rank, gradient_checkpointing=True)
    # used first, as a trainer does: a generate and a backward
    M.generate(p, [explore_messages(_img(120, 90, 0))], max_new_tokens=3)
    enc = encode_chat(p, explore_messages(_img(120, 90, 0)))
    p.model.train()
    p.model(input_ids=torch.tensor([enc.input_ids]), pixel_values=enc.pixel_values,
            image_grid_thw=enc.image_grid_thw).logits.sum().backward()
    inner, params = weakref.ref(M.inner_model(p.model)), [weakref.ref(q) for q in p.model.parameters()]
    gc.collect()
    gc.disable()
    gc.freeze()  # what vLLM does; every object above is now exempt from cyclic collection
    try:
        del p, enc
        assert inner() is None and not [q for q in params if q() is not None]
    finally:
        gc.unfreeze()
        gc.enable()


# ----------------------------------------------------------------------------------------------
# Without CUDA: one sentence


def test_without_cuda_the_engine_is_one_sentence(policy):
    assert not torch.cuda.is_available()  # this machine; on a GPU machine bench/vllm_smoke.py runs instead
    with pytest.raises(SystemExit) as e:
        V.attach(policy, 1, 128)
    msg = str(e.value)
    assert "CUDA" in msg and "--engine hf" in msg and "\n" not in msg
    assert policy.engine is None


def test_smoke_script_without_cuda_or_vllm_is_one_sentence():
    r = _run([sys.executable, "bench/vllm_smoke.py"])
    assert r.returncode == 2, r.stdout + r.stderr
    out = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(out) == 1 and "CUDA" in out[0] and "Traceback" not in r.stderr, out
