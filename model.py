"""The policy: a Qwen2.5-VL that looks at screenshots and writes actions.

    from chat import explore_messages; from model import load_policy, generate
    policy = load_policy("tiny")                      # random weights, CPU, no download
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)   # a real checkpoint (GPU)
    gens = generate(policy, [explore_messages(img)] * 8, max_new_tokens=128)

Tests: `python -m pytest -q tests/test_model.py`. Benchmarks: `python bench/generate.py` (one
batched generate vs N sequential calls), `python bench/logprobs.py` (per_token_logps vs the full
log_softmax), `python bench/gpu_update.py` (one GRPO update of a random Qwen2.5-VL-3B on a GPU;
`--dry-run` tests it on CPU).

Top to bottom: load_policy/save_policy (transformers + peft LoRA, or "tiny": a random-weight
Qwen2.5-VL of the REAL class from a small config, with a byte-level BPE tokenizer trained in
milliseconds on an embedded corpus; every test and CPU run uses it); generate (one batched,
left-padded HF generate for N prompts, with sampling log-probs) and sync_weights (push new
weights to a generation engine). Where the other names live: Qwen's special tokens, the chat
template, the prompts and encode_chat (messages -> ids, target mask, pixels) in chat.py, which
this file builds on; the image size caps in actions.py (smart_resize uses the same ones); the vLLM
engine (VLLMEngine) in vllm_engine.py, which builds on this file and is imported only when an
engine is built (GPU only, untested on this CPU machine); the vision tower's batched window
attention in vision_windows.py.

Where we depart from the papers (the prompts' departures are in chat.py):
  - Sampling never emits the vision placeholder tokens (`<|image_pad|>` & co.): a random model
    would otherwise write them into its answer and desynchronise images and placeholders. The
    trainer leaves them out of its softmax too (Policy.suppressed_ids), so it trains the
    distribution that is sampled.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch

import dist
import vision_windows  # the vision tower's batched window attention
from actions import MAX_PIXELS, MIN_PIXELS  # the image size caps
from chat import (CHAT_TEMPLATE, DEFAULT_SYSTEM, EXPLORE_PROMPT, SPECIAL_TOKENS, UITARS_PROMPT, VISION_TOKENS,
                  Encoded, encode_chats, special_id)


class ModelNotFound(SystemExit):
    """A model name that cannot be loaded. A SystemExit, so an uncaught one prints one sentence."""


@dataclass
class Policy:
    model: Any                  # Qwen2_5_VLForConditionalGeneration, or a peft PeftModel around it
    tokenizer: Any              # a fast tokenizer with Qwen's special tokens and chat template
    image_processor: Any        # Qwen2VLImageProcessorPil (PIL + numpy, no torchvision)
    device: torch.device
    dtype: torch.dtype
    name: str
    lora: bool
    engine: Any = None          # a VLLMEngine when generation runs on vLLM, else None (HF generate)
    # id(image) -> (weakref to it, pixel_values, grid) of live screenshots (filled by chat.encode_chat)
    pixels: dict = field(default_factory=dict, repr=False)

    def suppressed_ids(self) -> list[int]:
        """The ids sampling never emits (VISION_TOKENS). The trainer removes them too (grpo's
        per_token_logps), so it scores exactly the distribution the tokens were drawn from."""
        return [special_id(self.tokenizer, t) for t in VISION_TOKENS]


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
# Loading: the tiny model and tokenizer, real checkpoints, LoRA


def _image_processor_class():
    # transformers 5.x names the PIL/numpy processor `...Pil`; `Qwen2VLImageProcessor` there is the
    # torchvision one. Older versions only have the PIL one, under the plain name.
    import transformers
    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor


def qwen_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """Qwen2.5-VL's image processor built from its constants (14-pixel patches, 2x2 merge, 2 frames),
    for models made from a config: the tiny one here, the random 3B in bench/."""
    return _image_processor_class()(min_pixels=min_pixels, max_pixels=max_pixels,
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


# A small corpus for the tiny tokenizer's BPE merges: the prompts and answers it will actually see,
# so that prompts come out a few hundred tokens long instead of one token per byte.
def _tiny_corpus() -> list[str]:
    lines = [EXPLORE_PROMPT, UITARS_PROMPT, DEFAULT_SYSTEM]
    for x, y in [(12, 640), (300, 200), (1000, 512), (77, 33), (640, 360), (5, 715)]:
        lines += [f'{{"intent": "Open the file manager to look at the files", "action": "Click({x}, {y})"}}',
                  f'{{"intent": "Type a note", "action": "Text({x}, {y}, \\"hello world\\")"}}',
                  f'{{"intent": "See more", "action": "ScrollDown({x}, {y})"}} Key(\\"ctrl+c\\")',
                  f"Thought: The calculator is open, I click the button.\nAction: click(start_box='({x},{y})')",
                  "Thought: I type and save.\nAction: type(content='hello world\\n') hotkey(key='ctrl s')"]
    return lines * 4


def build_tiny_tokenizer():
    """A byte-level BPE with Qwen's pre-tokenizer split and special tokens, trained in ~10 ms."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Qwen2's split rule (letters, single digits, punctuation runs, newlines), then bytes -> chars.
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # 256 byte tokens (any text encodes) + merges up to 1024; the BPE trainer is deterministic.
    trainer = trainers.BpeTrainer(vocab_size=1024, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tiny_corpus(), trainer)
    # Special tokens go after the BPE vocabulary, in Qwen's order.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer, vocab_size: int | None = None):
    """A Qwen2.5-VL config with the real structure at toy width: ~0.3M parameters (vocab 1088)."""
    from transformers import Qwen2_5_VLConfig
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = vocab_size or ((len(tokenizer) + 63) // 64 * 64)  # round up like real vocabularies
    text = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,  # head_dim 16, grouped-query attention
        max_position_embeddings=8192, rms_norm_eps=1e-6,
        # mrope: the 8 rotary frequency pairs of a 16-dim head split over (time, height, width),
        # like 3B's [16, 24, 24] for head_dim 128.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        # Larger-than-usual init so the random model's next-token distribution is peaked: greedy
        # decoding then has clear winners (batched vs single-prompt tests are not decided by noise).
        initializer_range=0.2,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=64,
        fullatt_block_indexes=[1], tokens_per_second=2, initializer_range=0.2,
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


def _neutral_generation_config(model, tokenizer):
    # Checkpoints ship sampling defaults (Qwen2.5-VL: top_k=1, repetition_penalty=1.05). In RL we
    # sample from the policy itself, so every such knob is switched off here; generate() passes
    # temperature/top_p explicitly.
    from transformers import GenerationConfig
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config = GenerationConfig(
        eos_token_id=stop, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0,
        top_p=1.0, repetition_penalty=1.0)


def inner_model(model):
    """The Qwen2_5_VLModel inside: model.model, or one level deeper through a peft wrapper."""
    return model.get_base_model().model if hasattr(model, "get_base_model") else model.model


def mm_token_types(model, input_ids: torch.Tensor) -> dict:
    """{"mm_token_type_ids": (B, T) 0 text / 1 image / 2 video} if this transformers wants it, else {}.

    HF generate() computes the 3D rotary positions of the prompt from this argument before any
    forward runs, so generate must be given it explicitly (the hook below only covers forwards).
    """
    return _mm_types(inner_model(model), input_ids)


def _mm_types(inner, input_ids: torch.Tensor) -> dict:
    # `inner`: the Qwen2_5_VLModel (its config has the ids; its forward says if it takes the types)
    if "mm_token_type_ids" not in inspect.signature(inner.forward).parameters:
        return {}
    config = inner.config
    types = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()  # (B, T)
    return {"mm_token_type_ids": types}


def _mrope_hook(module, args, kwargs):
    # transformers >= 5.x computes Qwen2.5-VL's 3D (time, height, width) rotary positions only when
    # the forward is given `mm_token_type_ids`; without them every token silently gets 1D positions
    # and log-probs no longer match generation. The Qwen processor makes them; we don't use it, so
    # this pre-hook on the inner Qwen2_5_VLModel (which the outer model calls with keywords)
    # derives them from input_ids for EVERY forward (grpo's log-probs, anyone's).
    # A module-level function that reads only its `module` argument: a closure over the model
    # would make model -> hook -> model a reference cycle, which only the cyclic garbage collector
    # frees, and vLLM's gc.freeze() exempts whatever is alive at engine start from it, so a
    # replaced policy would stay in GPU memory (tests/test_vllm_engine.py checks no cycle is left).
    ids = kwargs.get("input_ids")
    if kwargs.get("mm_token_type_ids") is None and ids is not None and kwargs.get("image_grid_thw") is not None:
        kwargs.update(_mm_types(module, ids))
    return args, kwargs


def load_policy(name: str = "tiny", lora_rank: int = 0, lora_alpha: int = 16,
                gradient_checkpointing: bool = False, device: str | None = None, dtype=None,
                min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                seed: int = 0, vocab_size: int | None = None) -> Policy:
    """A Hugging Face id, a local checkpoint folder (e.g. one save_policy wrote), or "tiny".

    lora_rank > 0 wraps the language model's q/k/v/o/gate/up/down projections in LoRA adapters
    (the vision tower stays frozen); 0 means full fine-tuning. bf16 on CUDA, fp32 on CPU.
    vocab_size only applies to "tiny" (e.g. 151936 to measure memory at the real vocabulary size).
    """
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ip_class = _image_processor_class()
    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
        # The same seed gives the same weights (tests are reproducible), without touching the
        # caller's RNG: a resumed run has just restored it.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer, vocab_size))
        image_processor = qwen_image_processor(min_pixels, max_pixels)
    else:
        looks_local = name.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(name))
        if looks_local and not os.path.isdir(os.path.expanduser(name)):
            raise ModelNotFound(f"No model folder at '{name}'; pass a checkpoint folder or a Hugging Face "
                                "id, or use --model tiny for the random-weight test model.")
        name = os.path.expanduser(name)
        try:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(name, dtype=dtype, device_map=str(device))
            tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
            # The caps are ours, not the checkpoint's: they set how many tokens a screenshot costs.
            image_processor = ip_class.from_pretrained(name, min_pixels=min_pixels, max_pixels=max_pixels)
        except OSError as e:  # transformers reports missing files, repos and network errors as OSError
            reason = str(e).strip().splitlines()[0][:200]
            raise ModelNotFound(f"Could not load model '{name}' ({reason}); download it first or pass a "
                                "local checkpoint folder, or use --model tiny for the random-weight test model.") from None
    return wrap_policy(model, tokenizer, image_processor, name, device, dtype, lora_rank, lora_alpha,
                       gradient_checkpointing)


def wrap_policy(model, tokenizer, image_processor, name: str, device, dtype, lora_rank: int = 0,
                lora_alpha: int = 16, gradient_checkpointing: bool = False) -> Policy:
    """The common tail of load_policy (also used by bench/gpu_update.py for a model built from a
    config): device and dtype, sampling defaults off, 3D-rope hook, batched vision windows,
    checkpointing, LoRA."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    tokenizer.padding_side = "left"
    _neutral_generation_config(model, tokenizer)
    inner_model(model).register_forward_pre_hook(_mrope_hook, with_kwargs=True)  # 3D rope, see the hook
    vision_windows.install(model)  # one attention call per window length, not per window (see file)
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
        # A regex, because the vision blocks also have gate/up/down_proj and must stay frozen.
        targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                 target_modules=targets, bias="none"))
    return Policy(model=model, tokenizer=tokenizer, image_processor=image_processor,
                  device=torch.device(device), dtype=dtype, name=name, lora=lora_rank > 0)


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

    A LoRA policy is saved MERGED, as a plain Qwen2.5-VL checkpoint: load_policy(path), vLLM and
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
    pix = [e.pixel_values for e in encs if e.pixel_values is not None]
    grids = [e.image_grid_thw for e in encs if e.image_grid_thw is not None]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if pix:
        batch["pixel_values"] = torch.cat(pix)      # (sum N_patches, 1176), in batch order
        batch["image_grid_thw"] = torch.cat(grids)  # (N_img, 3)
        batch.update(mm_token_types(policy.model, input_ids))
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
        batch["pixel_values"] = batch["pixel_values"].to(policy.dtype)  # (sum N_patches, 1176)
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
