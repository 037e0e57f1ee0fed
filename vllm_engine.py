"""vllm_engine.py: generation on vLLM, colocated with the trainer, with in-place weight sync.

    import vllm_engine; from model import load_policy, generate, sync_weights
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)
    vllm_engine.attach(policy, max_images=15, answer_tokens=15 * 262)  # model.generate now runs on vLLM
    gens = generate(policy, prompts)
    ... optimizer step ...; sync_weights(policy)                       # push the new weights to vLLM

One concept per file: model.py holds the policy and HF generation (its generate and sync_weights
hand over to policy.engine when one is set); this file holds only what vLLM needs, on top of
model.py and plumbing/dist.py. vLLM itself is imported only when an engine is built (`--engine
vllm`), and needs CUDA: `pip install vllm==0.32.0`, the release that pins torch==2.13.0 as we do
(0.33.0 pins torch 2.14.0; 0.32.0 also wants transformers < 5.20, which pip picks within ours).

UNTESTED ON A GPU HERE: this file was checked against vLLM 0.32.0's source, and everything in it
that is plain Python or torch runs on CPU in tests/test_vllm_engine.py (the engine's folder, the
process state kept across engine start, the flags, the prompts, the sampling seeds, the tensors a
sync hands over). What only a GPU can show (vLLM's log-probs against ours, the sync, the vision
cache, memory) is checked by `python bench/vllm_smoke.py` on one GPU, which we have not run.

What building an engine does to the trainer's process, and what we do about it (vLLM 0.32.0 files):
  - vLLM reseeds python's, numpy's and torch's RNGs with its own seed (v1/worker/gpu_worker.py:522,
    1062), sets the current CUDA device (:501), drops torch to one CPU thread (:610,
    utils/torch_utils.py:300) and gc.freeze()s the heap (v1/engine/core.py:253, gpu_worker.py:1082):
    all of it is put back after the engine starts (preserved_process_state); vLLM gets its one
    thread back around its own generate calls.
  - Each request gets its own sampling seed drawn from torch's generator, which the trainers seed
    per rank (--sample-seed, dist.seed_ranks) and checkpoint; left alone, vLLM would draw them
    from numpy's generator (v1/worker/gpu/sample/states.py:57), the same on every rank.
  - Under torchrun every rank has its own engine on its own GPU: the "external_launcher" executor
    reads RANK / LOCAL_RANK (v1/executor/uniproc_executor.py:195); the default one puts every
    rank's engine on GPU 0 (:86-87).
  - The engine starts from a folder of our own holding only the config, tokenizer and image
    processor (no weights: load_format="dummy"), one per rank, deleted with the engine; the
    policy's weights then arrive by the same in-place sync as after every update. A user's model
    folder is only ever read.
  - The sync streams one merged tensor at a time, in the engine's dtype, and then empties the
    prefix cache (KV of old weights) and the encoder cache (vision embeddings of old weights;
    full fine-tuning trains the vision tower).

Where this departs from the papers: nothing algorithmic, this is plumbing. The engine runs in the
trainer's own process, so a weight sync is a tensor copy, not a transfer over a socket. Its
log-probs mean what HF generate's mean (model.Answer.logprobs): the sampling distribution,
after temperature, top-p and the vision-token ban (vLLM's logprobs_mode="processed_logprobs";
the default "raw_logprobs" would be the model's before temperature). Its context length is
derived from the run's flags (needed_model_len); ARPO's release leaves vLLM at the model's own.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import random
import shutil
import tempfile
import weakref

import numpy as np
import torch
from PIL import Image

from plumbing import dist
import qwen_vl
from model import encode_chats, image_parts, special_id
from model import Answer, Policy, merged_weights

VLLM_VERSION = "0.32.0"  # its wheel pins torch==2.13.0, the torch of requirements.txt
INSTALL = f"pip install vllm=={VLLM_VERSION}"
# vLLM's SamplingParams refuses temperatures above 2 and raises those in (0, 0.01) to 0.01
# (sampling_params.py:665 and :30), which would no longer be the temperature the trainer scores at.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0


def flag_errors(engine: str, *temperatures: float) -> list[tuple[bool, str]]:
    """rundir.check's (failed, sentence) pairs for the flags vLLM would refuse or bend, so a run
    stops before it loads a model: the sampling temperatures must be 0 (greedy) or in [0.01, 2]."""
    bad = [t for t in temperatures if engine == "vllm" and t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE]
    return [(bool(bad), f"--engine vllm samples at temperature 0 (greedy) or from {MIN_TEMPERATURE} to "
                        f"{MAX_TEMPERATURE:g}, not {bad[0] if bad else ''}; pick one in that range or use --engine hf")]


def needed_model_len(max_images: int, max_pixels: int, answer_tokens: int, prompt_tokens: int = 2048,
                     limit: int | None = None, factor: int = 28) -> int:
    """The longest prompt + answer a run can send vLLM, in tokens, from its flags.

    A screenshot costs at most max_pixels / factor**2 tokens (one per factor x factor px after the
    2x2 merge: Policy.resize_factor, 28 for Qwen2/2.5-VL, 32 for Qwen3-VL; smart_resize keeps
    h * w <= max_pixels) plus its <|vision_start|>, <|vision_end|> and
    the turn's 5 ChatML tokens; answer_tokens is every answer the context can hold (ARPO: all
    max_steps answers of max_new_tokens, plus 6 ChatML tokens per turn); prompt_tokens covers the
    system prompt, the instruction and the rest. ARPO's setting (15 screenshots of 1920x1080 at
    max_pixels 2,116,800: 2,691 tokens each, at most 2,700; 15 answers of 256 tokens) comes to
    47,104, well above a fixed 32,768. Rounded up to a multiple of 1024. Over `limit` (the
    model's position embeddings), ValueError in one sentence.
    """
    per_image = max_pixels // (factor * factor) + 2 + 5
    need = max_images * per_image + answer_tokens + prompt_tokens
    need = math.ceil(need / 1024) * 1024
    if limit is not None and need > limit:
        raise ValueError(f"{max_images} screenshots of up to {max_pixels} pixels need {need} tokens of context, "
                         f"more than this model's {limit}; lower --max-images or --max-pixels.")
    return need


def collapse_image_pads(ids: list[int], pad: int) -> list[int]:
    """Each run of <|image_pad|> collapsed to one pad, as the chat template writes it: vLLM expands
    the pad itself from the image it is given."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


# --------------------------------------------------------------------------------------------
# What the engine is built from, and what building it must not change


def use_inprocess_engine() -> None:
    """The engine core in THIS process, so that weights pass to it as tensors and apply_model runs
    our function on the model itself. Set, not setdefault: an inherited =1 would move the engine
    into a child process, where apply_model's function cannot go (and external_launcher refuses
    to start, v1/executor/uniproc_executor.py:180)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def engine_folder(policy: Policy, owner) -> str:
    """A new temporary folder with what vLLM reads besides weights: config, generation config,
    tokenizer, image processor. A few MB, one per rank (no two ranks write the same files), never
    the user's --model folder, and deleted when `owner` (the engine) is, or at exit."""
    folder = tempfile.mkdtemp(prefix=f"vllm-engine-rank{dist.rank()}-")
    weakref.finalize(owner, shutil.rmtree, folder, True)
    base = policy.model.get_base_model() if policy.lora else policy.model
    config = copy.deepcopy(base.config)
    # vLLM picks its model class from this; a model built from a config (the tiny one) has none.
    config.architectures = [policy.family.architecture]
    config.save_pretrained(folder)
    base.generation_config.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    policy.image_processor.save_pretrained(folder)
    return folder


def engine_args(policy: Policy, folder: str, max_model_len: int, max_images: int,
                gpu_memory_utilization: float, world: int) -> dict:
    """The keyword arguments of vllm.LLM (plain values, so tests can read them without vLLM)."""
    return dict(
        model=folder, dtype=str(policy.dtype).replace("torch.", ""),
        load_format="dummy",  # random weights at start; VLLMEngine's first sync replaces them all
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
        # A modality left out counts as 999 items when vLLM sizes its encoder budget
        # (config/multimodal.py:706): say there is no video.
        limit_mm_per_prompt={"image": max_images, "video": 0}, enable_prefix_caching=True,
        # processed_logprobs: log-probs of the distribution sampled from (temperature, top-p,
        # logit bias applied), the meaning Answer.logprobs has on the HF path too.
        logprobs_mode="processed_logprobs",
        # torchrun: each rank its own engine on the GPU of its LOCAL_RANK (see the docstring)
        distributed_executor_backend="external_launcher" if world > 1 else None,
    )


@contextlib.contextmanager
def preserved_process_state():
    """Whatever the block does to python's, numpy's and torch's RNGs (CPU and every GPU), the
    current CUDA device, torch's CPU thread count and float32 matmul precision is undone after it,
    and a gc.freeze() in it is undone too (so the trainer's dropped objects can still be
    collected). Yields a dict in which the block's thread count is left, under "threads"."""
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.is_available()
    cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
    device = torch.cuda.current_device() if cuda else None
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    inside = {}
    try:
        yield inside
    finally:
        inside["threads"] = torch.get_num_threads()
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda:
            torch.cuda.set_rng_state_all(cuda_rng)
            torch.cuda.set_device(device)
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        gc.unfreeze()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU thread count at n inside the block, as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Requests: prompts, sampling parameters and seeds, as plain values


def request_seeds(n: int) -> list[int]:
    """One sampling seed per request, drawn from torch's CPU generator: the trainers seed it per
    rank (--sample-seed / --seed, dist.seed_ranks) and checkpoint it, so ranks sample apart and a
    resumed run draws what it would have drawn."""
    return torch.randint(0, 2**63 - 1, (n,)).tolist()


def sampling_args(policy: Policy, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
    """The keyword arguments of one request's vllm.SamplingParams."""
    return dict(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed,
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=list(policy.model.generation_config.eos_token_id), skip_special_tokens=True,
                # the vision placeholders are never sampled (model.py's docstring): -100 is 1e-43 odds
                logit_bias={special_id(policy.tokenizer, t): -100.0 for t in qwen_vl.VISION_TOKENS})


def engine_prompts(policy: Policy, batch_messages: list[list[dict]]) -> tuple[list, list[dict]]:
    """(our Encoded prompts, vLLM's prompts): the same token ids, each image pad collapsed (vLLM
    expands it from the image), and the images resized to exactly what our processor saw, so that
    vLLM's own resize is a no-op and its prompt equals the one the trainer will score."""
    encs = encode_chats(policy, batch_messages)
    pad = special_id(policy.tokenizer, qwen_vl.IMAGE_PAD)
    prompts = []
    for messages, enc in zip(batch_messages, encs):
        images = [p["image"].convert("RGB").resize(size, Image.BICUBIC)
                  for p, size in zip(image_parts(messages), enc.image_sizes)]
        prompt = {"prompt_token_ids": collapse_image_pads(enc.input_ids, pad)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        prompts.append(prompt)
    return encs, prompts


# --------------------------------------------------------------------------------------------
# The engine


class VLLMEngine:
    """Generation on vLLM, colocated with the trainer on the same GPU (each rank its own).

        policy.engine = VLLMEngine(policy, max_model_len=8192)   # after load_policy (attach() does it)
        gens = generate(policy, prompts)                         # now runs on vLLM
        ... update ...; sync_weights(policy)                      # after every optimizer step
    """

    def __init__(self, policy: Policy, max_model_len: int, max_images: int = 1,
                 gpu_memory_utilization: float = 0.35):
        if not torch.cuda.is_available():
            raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on this machine.")
        use_inprocess_engine()
        try:
            from vllm import LLM
        except ImportError as e:
            raise SystemExit(f"--engine vllm needs vLLM ({INSTALL}; importing it failed: "
                             f"{str(e).splitlines()[0][:200]}), or use --engine hf.") from None
        self.folder = engine_folder(policy, self)
        self.dtype = policy.dtype
        args = engine_args(policy, self.folder, max_model_len, max_images, gpu_memory_utilization, dist.size())
        with preserved_process_state() as inside:
            self.llm = LLM(**args)
        self.threads = inside["threads"]  # what vLLM runs with (1 unless OMP_NUM_THREADS says otherwise)
        self.sync_weights(policy)  # the dummy weights replaced by the policy's

    def generate(self, policy: Policy, batch_messages, max_new_tokens, temperature, top_p) -> list[Answer]:
        from vllm import SamplingParams
        encs, prompts = engine_prompts(policy, batch_messages)
        params = [SamplingParams(**sampling_args(policy, max_new_tokens, temperature, top_p, seed))
                  for seed in request_seeds(len(prompts))]
        with torch_threads(self.threads):  # the thread count vLLM compiled and profiled with
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        gens = []
        for enc, out in zip(encs, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            # processed log-probs (engine_args): the sampled token's under the sampling distribution
            lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs or [])]
            gens.append(Answer(text=c.text, prompt=enc, ids=ids, logprobs=lps))
        return gens

    def sync_weights(self, policy: Policy) -> None:
        """The trained weights (LoRA merged in) into the engine's model, in place, one tensor at a
        time (a generator: vLLM's load_weights consumes it; HF names, vLLM maps them). FSDP2: a
        collective per tensor, so every rank syncs at the same point."""
        weights = merged_weights(policy, self.dtype, every_rank=True)
        self.llm.apply_model(lambda model: model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached KV of the old weights would be reused otherwise
        self.llm.llm_engine.reset_encoder_cache()  # and so would vision embeddings of the same screenshots


def attach(policy: Policy, max_images: int, answer_tokens: int) -> VLLMEngine:
    """policy.engine = a VLLMEngine sized for the run: prompts of up to max_images screenshots of the
    policy's max_pixels and answer_tokens of answers (needed_model_len). Too long for the model's
    position embeddings: SystemExit in one sentence."""
    ip = policy.image_processor  # transformers 5 keeps max_pixels as size.longest_edge; 4.x as an attribute
    max_pixels = getattr(ip, "max_pixels", None) or getattr(ip.size, "longest_edge", None) or ip.size["longest_edge"]
    try:
        length = needed_model_len(max_images, int(max_pixels), answer_tokens,
                                  limit=policy.model.config.text_config.max_position_embeddings,
                                  factor=policy.resize_factor)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    policy.engine = VLLMEngine(policy, max_model_len=length, max_images=max_images)
    return policy.engine
