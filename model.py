"""The policy: a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) that reads screenshots and acts.

    from chat import explore_messages; from model import load_policy, generate
    policy = load_policy("tiny")                      # random weights, CPU, no download
    policy = load_policy("tiny-explore")              # the same, taught the answer format (built once, cached)
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)   # a real checkpoint (GPU)
    gens = generate(policy, [explore_messages(img)] * 8, max_new_tokens=128)

Tests: `python -m pytest -q tests/test_model.py tests/test_families.py tests/test_warm_start.py`.
Benchmarks: `python bench/generate.py` (one batched generate vs N sequential calls),
`python bench/logprobs.py` (per_token_logps vs the full log_softmax), `python bench/gpu_update.py`
(one GRPO update of a random Qwen2.5-VL-3B on a GPU; `--dry-run` tests it on CPU).

Top to bottom: load_policy/save_policy (transformers' AutoModelForImageTextToText + peft LoRA);
generate (one batched, left-padded HF generate for N prompts, with sampling log-probs) and
sync_weights (push new weights to a generation engine). Model names besides checkpoints:
  tiny, tiny-qwen2-vl, tiny-qwen3-vl   random weights of the REAL class from a small config
                  (qwen_vl.tiny_config), with a byte-level BPE tokenizer trained in milliseconds on
                  an embedded corpus; every test and CPU run uses one
  tiny-uitars, tiny-explore   the tiny Qwen2.5-VL after a short supervised warm start on the
                  UI-TARS / ScreenExplorer answer FORMAT (uniform coordinates, no task knowledge),
                  built on first use (2-5 minutes on a 2-core CPU) and cached on disk (plumbing/warm_start.py)
What is specific to the Qwen-VL family (tokens, chat format, 3D rope, LoRA targets, resize factor,
which vision attention to batch) is in qwen_vl.py, keyed by config.json's model_type: a checkpoint
of a family it knows loads through the auto class, any other is refused in one sentence, and so is
a folder whose weights do not all load (transformers would start the missing ones at random and
only say so in its load report). Where the other names live: the prompts and encode_chat (messages
-> ids, target mask, pixels) in chat.py, which this file builds on; the image size caps in
actions.py (smart_resize uses the same ones); the vLLM engine (VLLMEngine) in vllm_engine.py,
which builds on this file and is imported only when an engine is built (GPU only); the vision
tower's batched window attention in qwen_vl.py.

Where we depart from the papers (the prompts' departures are in chat.py):
  - Sampling never emits the vision placeholder tokens (`<|image_pad|>` & co.): a random model
    would otherwise write them into its answer and desynchronise images and placeholders. The
    trainer leaves them out of its softmax too (Policy.suppressed_ids), so it trains the
    distribution that is sampled.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from plumbing import dist
import qwen_vl  # what is specific to the model family

from plumbing import warm_start  # the tiny-uitars / tiny-explore recipes and their cache
from actions import MAX_PIXELS, MIN_PIXELS  # the image size caps
from chat import EXPLORE_PROMPT, UITARS_PROMPT, Encoded, encode_chats, special_id


class ModelNotFound(SystemExit):
    """A model name that cannot be loaded. A SystemExit, so an uncaught one prints one sentence."""


@dataclass
class Policy:
    model: Any                  # e.g. Qwen2_5_VLForConditionalGeneration, or a peft PeftModel around it
    tokenizer: Any              # a fast tokenizer with Qwen's special tokens and chat template
    image_processor: Any        # Qwen2VLImageProcessorPil (PIL + numpy, no torchvision)
    device: torch.device
    dtype: torch.dtype
    name: str
    lora: bool
    family: qwen_vl.Family      # the model family's row of qwen_vl.FAMILIES (chat.py reads it too)
    engine: Any = None          # a VLLMEngine when generation runs on vLLM, else None (HF generate)
    # id(image) -> (weakref to it, pixel_values, grid) of live screenshots (filled by chat.encode_chat)
    pixels: dict = field(default_factory=dict, repr=False)

    def suppressed_ids(self) -> list[int]:
        """The ids sampling never emits (VISION_TOKENS). The trainer removes them too (grpo's
        per_token_logps), so it scores exactly the distribution the tokens were drawn from."""
        return [special_id(self.tokenizer, t) for t in qwen_vl.VISION_TOKENS]

    @property
    def resize_factor(self) -> int:
        """Both sides of a screenshot as this model sees it are multiples of this: pass it to
        actions.smart_resize (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        return self.image_processor.patch_size * self.image_processor.merge_size


@dataclass
class Generation:
    text: str                   # the completion, special tokens removed
    prompt: Encoded             # what the model was given
    completion_ids: list[int]   # sampled ids, up to and including the stop token, no padding
    # log-prob of each sampled id under the distribution it was drawn from: softmax(logits / T),
    # top-p renormalised, vision tokens removed; the same on the vLLM path (processed_logprobs),
    # and what grpo.per_token_logps gives at the same T when top_p is 1.
    logprobs: list[float]


# --------------------------------------------------------------------------------------------
# Loading: the tiny models, real checkpoints (refused unless every weight loads), LoRA


def qwen_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, model_type: str = "qwen2_5_vl"):
    """A family's image processor built from its constants, for models made from a config: the
    tiny ones here, the random 3B in bench/."""
    return qwen_vl.image_processor(qwen_vl.FAMILIES[model_type], min_pixels, max_pixels)


# A small corpus for the tiny tokenizer's BPE merges: the prompts and answers it will actually see,
# so that prompts come out a few hundred tokens long instead of one token per byte.
def _tiny_corpus() -> list[str]:
    lines = [EXPLORE_PROMPT, UITARS_PROMPT, qwen_vl.QWEN_SYSTEM]
    for x, y in [(12, 640), (300, 200), (1000, 512), (77, 33), (640, 360), (5, 715)]:
        lines += [f'{{"intent": "Open the file manager to look at the files", "action": "Click({x}, {y})"}}',
                  f'{{"intent": "Type a note", "action": "Text({x}, {y}, \\"hello world\\")"}}',
                  f'{{"intent": "See more", "action": "ScrollDown({x}, {y})"}} Key(\\"ctrl+c\\")',
                  f"Thought: The calculator is open, I click the button.\nAction: click(start_box='({x},{y})')",
                  "Thought: I type and save.\nAction: type(content='hello world\\n') hotkey(key='ctrl s')"]
    return lines * 4


def build_tiny_tokenizer(model_type: str = "qwen2_5_vl"):
    """The tiny models' tokenizer (qwen_vl.tiny_tokenizer on the corpus above), ~10 ms."""
    return qwen_vl.tiny_tokenizer(_tiny_corpus(), qwen_vl.FAMILIES[model_type])


def _neutral_generation_config(model, tokenizer):
    # Checkpoints ship sampling defaults (Qwen2.5-VL: top_k=1, repetition_penalty=1.05). In RL we
    # sample from the policy itself, so every such knob is switched off here; generate() passes
    # temperature/top_p explicitly.
    from transformers import GenerationConfig
    model.generation_config = GenerationConfig(
        eos_token_id=[special_id(tokenizer, t) for t in qwen_vl.STOP_TOKENS], pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, repetition_penalty=1.0)


def inner_model(model):
    """The inner model (e.g. Qwen2_5_VLModel: .visual, .language_model): model.model, or one level
    deeper through a peft wrapper."""
    return model.get_base_model().model if hasattr(model, "get_base_model") else model.model


def _from_pretrained(name: str, device, dtype, min_pixels: int, max_pixels: int):
    """(model, tokenizer, image processor) of a checkpoint folder or Hugging Face id, through the
    auto class, refused (ModelNotFound, one sentence) unless its family is in qwen_vl.FAMILIES and
    EVERY weight of the model came from its files: transformers starts missing or reshaped weights
    at random and only says so in a load report, so a Qwen3-VL folder read as Qwen2.5-VL would
    train a half-random model."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    looks_local = name.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(name))
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ModelNotFound(f"No model folder at '{name}'; pass a checkpoint folder or a Hugging Face "
                            "id, or use --model tiny for the random-weight test model.")
    name = os.path.expanduser(name)
    try:
        config = AutoConfig.from_pretrained(name)
        try:
            qwen_vl.family(config)
        except qwen_vl.UnknownFamily as e:
            raise ModelNotFound(f"Cannot use '{name}': {e}.") from None
        # ignore_mismatched_sizes: report reshaped weights (below) instead of raising mid-load.
        model, info = AutoModelForImageTextToText.from_pretrained(
            name, dtype=dtype, device_map=str(device), ignore_mismatched_sizes=True, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
        # The caps are ours, not the checkpoint's: they set how many tokens a screenshot costs.
        image_processor = qwen_vl.image_processor_class().from_pretrained(
            name, min_pixels=min_pixels, max_pixels=max_pixels)
    except OSError as e:  # transformers reports missing files, repos and network errors as OSError
        reason = str(e).strip().splitlines()[0][:200]
        raise ModelNotFound(f"Could not load model '{name}' ({reason}); download it first or pass a "
                            "local checkpoint folder, or use --model tiny for the random-weight test model.") from None
    # mismatched_keys: (key, checkpoint shape, model shape) tuples, or plain keys in some versions
    bad = sorted(set(info["missing_keys"]) | {k if isinstance(k, str) else k[0] for k in info["mismatched_keys"]})
    if bad:
        stray = len(info["unexpected_keys"])
        raise ModelNotFound(
            f"Refusing '{name}': {len(bad)} of the {len(model.state_dict())} weights of the "
            f"{type(model).__name__} its config.json asks for (model_type '{config.model_type}') are missing "
            f"from its weight files or have another shape there (e.g. {bad[0]})"
            + (f", and {stray} stored tensors fit no weight" if stray else "")
            + "; they would start random, so check that config.json belongs to these weights.")
    return model, tokenizer, image_processor


def load_policy(name: str = "tiny", lora_rank: int = 0, lora_alpha: int = 16,
                gradient_checkpointing: bool = False, device: str | None = None, dtype=None,
                min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                seed: int = 0, vocab_size: int | None = None) -> Policy:
    """A Hugging Face id, a local checkpoint folder (e.g. one save_policy wrote), or a tiny name:
    "tiny" (random Qwen2.5-VL), "tiny-qwen2-vl", "tiny-qwen3-vl" (random weights; `seed` picks them),
    "tiny-uitars", "tiny-explore" (warm-started from the tiny Qwen2.5-VL of `seed`, cached).

    lora_rank > 0 wraps the language model's linear layers in LoRA adapters (qwen_vl.LORA_TARGETS;
    the vision tower stays frozen); 0 means full fine-tuning. bf16 on CUDA, fp32 on CPU.
    vocab_size only applies to the random tiny models (e.g. 151936 to measure memory at the real
    vocabulary size).
    """
    from transformers import AutoModelForImageTextToText

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    source = name
    if name in warm_start.RECIPES:  # built on first use (on the CPU), then an ordinary checkpoint folder
        source = warm_start.folder(name, seed, lambda: load_policy("tiny", seed=seed, device="cpu"), save_policy)
    if name in qwen_vl.TINY:
        fam = qwen_vl.FAMILIES[qwen_vl.TINY[name]]
        tokenizer = build_tiny_tokenizer(fam.model_type)
        # The same seed gives the same weights (tests are reproducible), without touching the
        # caller's RNG: a resumed run has just restored it.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(qwen_vl.tiny_config(fam, tokenizer, vocab_size))
        image_processor = qwen_vl.image_processor(fam, min_pixels, max_pixels)
    else:
        model, tokenizer, image_processor = _from_pretrained(source, device, dtype, min_pixels, max_pixels)
    return wrap_policy(model, tokenizer, image_processor, name, device, dtype, lora_rank, lora_alpha,
                       gradient_checkpointing)


def wrap_policy(model, tokenizer, image_processor, name: str, device, dtype, lora_rank: int = 0,
                lora_alpha: int = 16, gradient_checkpointing: bool = False) -> Policy:
    """The common tail of load_policy (also used by bench/gpu_update.py for a model built from a
    config): device and dtype, sampling defaults off, 3D-rope hook, batched vision windows,
    checkpointing, LoRA."""
    fam = qwen_vl.family(model.config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = qwen_vl.PAD_TOKEN
    tokenizer.padding_side = "left"
    _neutral_generation_config(model, tokenizer)
    qwen_vl.install_rope_hook(model)  # 3D rope for every forward (see qwen_vl._rope_hook's comment)
    qwen_vl.install_vision_windows(model, fam.vision_attention)  # one attention call per window length (see file)
    model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        # Non-reentrant checkpointing also works with frozen inputs (the LoRA case). transformers
        # 5.24 renamed the switch; 5.17 only has the old name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = model.config.text_config.use_cache = False
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                 target_modules=qwen_vl.LORA_TARGETS, bias="none"))
    return Policy(model=model, tokenizer=tokenizer, image_processor=image_processor,
                  device=torch.device(device), dtype=dtype, name=name, lora=lora_rank > 0, family=fam)


@torch.no_grad()
def merged_weights(policy: Policy, dtype: torch.dtype | None = None, every_rank: bool = False):
    """Yield (name, tensor) in the plain Hugging Face naming, LoRA folded in: W + B @ A * scale.

    One tensor at a time and outside autograd, so a caller that streams them (the vLLM sync) holds
    one merged matrix at a time, never a second copy of the model. Each comes in `dtype` (None: the
    weight's own: peft keeps the adapter, and so B @ A, in fp32; the sum is rounded once, back to
    the weight's dtype). The training copy is left untouched (no merge/unmerge round trip, which
    drifts bf16 weights). Used to save checkpoints and to sync vLLM. Full fine-tuning under
    torchrun (FSDP2): every_rank=False gathers the whole state dict onto rank 0's CPU (saving; a
    collective, the other ranks get nothing), every_rank=True all-gathers one weight at a time onto
    every rank (each rank's own vLLM engine; a collective per weight).
    """
    if not policy.lora:
        items = dist.whole_tensors(policy.model) if every_rank else dist.full_state_dict(policy.model).items()
        for key, tensor in items:
            yield key, tensor.to(dtype or tensor.dtype)
        return
    from peft.tuners.lora import LoraLayer
    base = policy.model.get_base_model()
    lora_layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue  # the adapter matrices themselves; folded into the base weight below
        want = dtype or tensor.dtype
        if ".base_layer." in key:
            module, param = key.split(".base_layer.")
            if param == "weight":
                tensor = tensor + lora_layers[module].get_delta_weight("default")  # (out, in), fp32
            key = f"{module}.{param}"
        yield key, tensor.to(want)


def cpu_weights(policy: Policy) -> dict:
    """merged_weights as one CPU state dict, ready for save_pretrained (FSDP2: a collective)."""
    return {k: v.detach().to("cpu").contiguous() for k, v in merged_weights(policy)}


def save_policy(policy: Policy, path: str, state: dict | None = None) -> None:
    """save_pretrained: model (LoRA merged in), tokenizer, image processor.

    A LoRA policy is saved MERGED, as a plain checkpoint of its family: load_policy(path), vLLM and
    `from_pretrained` all load it without peft (the adapter itself is not kept; to continue LoRA
    training from it, load it with lora_rank > 0, which starts a fresh adapter on merged weights).
    """
    os.makedirs(path, exist_ok=True)
    base = policy.model.get_base_model() if policy.lora else policy.model
    if state is None:  # `state`: merged_weights already gathered (under FSDP2, from every rank)
        state = cpu_weights(policy)
    base.save_pretrained(path, state_dict=state)
    policy.tokenizer.save_pretrained(path)
    policy.image_processor.save_pretrained(path)


# --------------------------------------------------------------------------------------------
# Generation: one batched HF generate call, and the weight sync of a vLLM engine


def _left_pad(policy: Policy, encs: list[Encoded]):
    """Stack prompts into (B, T) with padding on the LEFT, so every row's next token is at T."""
    pad = policy.tokenizer.pad_token_id
    T = max(len(e.input_ids) for e in encs)
    input_ids = torch.full((len(encs), T), pad, dtype=torch.long)    # (B, T)
    attention_mask = torch.zeros((len(encs), T), dtype=torch.long)    # (B, T)
    for b, e in enumerate(encs):
        input_ids[b, T - len(e.input_ids):] = torch.tensor(e.input_ids)  # (n,) into the row's right end
        attention_mask[b, T - len(e.input_ids):] = 1  # (n,)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    images = qwen_vl.image_inputs(encs)  # (sum N_patches, D) and (N_img, 3), in batch order
    if images["pixel_values"] is not None:
        batch.update(images)
        batch.update(qwen_vl.mm_token_types(policy.model, input_ids))  # (B, T): generate needs them up front
    return batch


@torch.no_grad()
def generate(policy: Policy, batch_messages: list[list[dict]], max_new_tokens: int = 128,
             temperature: float = 1.0, top_p: float = 1.0) -> list[Generation]:
    """Sample one completion per prompt, all N prompts in ONE generate call.

    temperature 0 means greedy. logprobs[i] is log pi(token_i | prefix) under the distribution the
    token was actually drawn from: the model's softmax at `temperature`, restricted to the top-p
    nucleus and with the vision placeholder tokens removed. At top_p 1 that is exactly what the
    trainer scores at the same temperature (grpo.per_token_logps); for greedy it is the
    temperature-1 log-prob of the argmax.
    """
    if policy.engine is not None:
        return policy.engine.generate(policy, batch_messages, max_new_tokens, temperature, top_p)
    from transformers import GenerationConfig

    encs = encode_chats(policy, batch_messages)  # screenshots processed in parallel threads
    batch = {k: v.to(policy.device) for k, v in _left_pad(policy, encs).items()}
    if "pixel_values" in batch:
        batch["pixel_values"] = batch["pixel_values"].to(policy.dtype)  # (sum N_patches, D)
    stop = list(policy.model.generation_config.eos_token_id)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
        else dict(do_sample=False)  # top_k=0: no top-k cut (HF's default is 50)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, **sampling, eos_token_id=stop, pad_token_id=policy.tokenizer.pad_token_id,
        suppress_tokens=policy.suppressed_ids(),
        output_scores=True, return_dict_in_generate=True, use_cache=True)
    was_training = policy.model.training
    policy.model.eval()
    # synced_gpus off: under torchrun transformers would make every decoding step a collective for an
    # FSDP model, but each rank generates alone (dist.unsharded) and as often as its own desktops
    # ask (rollout.py), so the ranks' generate calls do not pair up.
    out = policy.model.generate(**batch, generation_config=config, synced_gpus=False)
    policy.model.train(was_training)
    T = batch["input_ids"].shape[1]
    new = out.sequences[:, T:]                                     # (B, N_new)
    # scores[t] are the logits after HF's processors (temperature, top-p, suppression): the
    # sampling distribution itself. -inf outside the nucleus, never at the sampled token.
    # Per step, the sampled token's score minus the logsumexp: no (B, N_new, V) stack and no
    # full-vocabulary log_softmax output (0.6 GB at B=8, N_new=128, V=152k).
    logps = torch.empty(new.shape, device=new.device)  # (B, N_new)
    for t, step in enumerate(out.scores):
        step = step.float()  # (B, V)
        logps[:, t] = step.gather(-1, new[:, t:t + 1]).squeeze(-1) - torch.logsumexp(step, dim=-1)  # (B,)
    gens = []
    for b, enc in enumerate(encs):
        ids = new[b].tolist()
        n = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))  # keep the stop token
        gens.append(Generation(
            text=policy.tokenizer.decode(ids[:n], skip_special_tokens=True), prompt=enc,
            completion_ids=ids[:n], logprobs=logps[b, :n].tolist()))
    return gens


def sync_weights(policy: Policy) -> None:
    """After an optimizer step: push the new weights to the generation engine (no-op for HF)."""
    if policy.engine is not None:
        policy.engine.sync_weights(policy)
