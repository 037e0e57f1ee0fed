"""The policy: a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) that reads screenshots and acts.

    from model import load_policy, generate, explore_messages
    policy = load_policy("tiny")                      # random weights, CPU, no download
    policy = load_policy("tiny-explore")              # the tiny model taught the answer format (models/)
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)   # a real checkpoint (GPU)
    gens = generate(policy, [explore_messages(img)] * 8, max_new_tokens=128)
    enc = encode_chat(policy, messages)               # .input_ids, .target_mask, .pixel_values

Tests: `python -m pytest -q tests/test_model.py tests/test_families.py tests/test_warm_start.py`.
Benchmarks: `python bench/generate.py` (one batched generate vs N sequential calls),
`python bench/logprobs.py` (per_token_logps vs the full log_softmax), `python bench/gpu_update.py`
(one GRPO update of a random Qwen2.5-VL-3B on a GPU; `--dry-run` tests it on CPU).

Top to bottom: what the policy is shown (the two prompts; chat messages -> token ids, target mask,
pixels: encode_chat), loading (load_policy / save_policy: transformers' AutoModelForImageTextToText
+ peft LoRA), generation (one batched, left-padded HF generate for N prompts, with sampling
log-probs) and sync_weights (push new weights to a generation engine). Model names besides
checkpoints:
  tiny, tiny-qwen2-vl, tiny-qwen3-vl   random weights of the REAL class from a small config
                  (qwen_vl.tiny_config), with a byte-level BPE tokenizer trained in milliseconds on
                  an embedded corpus; every test and CPU run uses one
  tiny-uitars, tiny-explore   the tiny Qwen2.5-VL after a short supervised warm start on the
                  UI-TARS / ScreenExplorer answer FORMAT (uniform coordinates, no task knowledge):
                  checkpoint folders shipped in models/, built by plumbing/warm_start.py
What is specific to the Qwen-VL family (tokens, chat format, 3D rope, LoRA targets, resize factor,
which vision attention to batch) is in qwen_vl.py, keyed by config.json's model_type: a checkpoint
of a family it knows loads through the auto class, any other is refused in one sentence, and so is
a folder whose weights do not all load (transformers would start the missing ones at random and
only say so in its load report). The vLLM engine (VLLMEngine) is vllm_engine.py, imported only
when an engine is built (GPU only).

We do the Qwen-VL processor's job ourselves (the image processor for the pixels and our own
<|image_pad|> expansion), because the processor class needs torchvision, which cannot load beside
CPU torch. Screenshots are processed once: a policy keeps the processed pixels of every image
object that is still alive (Policy.pixels; an entry goes when its image is garbage-collected). ARPO
re-sends each desktop's last 15 screenshots at every step and once more for the update; without
this cache each would go through the image processor every time. Images are treated as immutable
once encoded: draw on a copy.

Where we depart from the papers:
  - ScreenExplorer's exact prompt text is not published in full; ours asks for the same JSON
    (`intent`, `action`) with the same action names.
  - UI-TARS's multi-turn history drops the user turns whose screenshot fell out of the last K
    (as the UI-TARS/OSWorld agent does); the assistant turns all stay, as text.
  - Sampling never emits the vision placeholder tokens (`<|image_pad|>` & co.): a random model
    would otherwise write them into its answer and desynchronise images and placeholders. The
    trainer leaves them out of its softmax too (Policy.suppressed_ids), so it trains the
    distribution that is sampled.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests
import torch
from PIL import Image

import qwen_vl  # what is specific to the model family
from actions import MAX_PIXELS, MIN_PIXELS  # the image size caps
from plumbing import dist
from qwen_vl import IMAGE_END, IMAGE_PAD, IMAGE_START, TURN_END, TURN_START, VISION_TOKENS, expand_image_tokens

ROOT = os.path.dirname(os.path.abspath(__file__))
# The tiny models taught an answer format, shipped as checkpoint folders (plumbing/warm_start.py builds them).
WARM_STARTED = {"tiny-uitars": os.path.join(ROOT, "models", "tiny-uitars"),
                "tiny-explore": os.path.join(ROOT, "models", "tiny-explore")}

# --------------------------------------------------------------------------------------------
# Prompts: what the policy is shown


EXPLORE_PROMPT = """You are exploring a computer desktop to learn what it can do. Look at the screenshot and choose ONE action that will show you something new: open an application, a menu, a file, a button you have not tried.
Answer with one JSON object and nothing else:
{"intent": "<what you expect to happen>", "action": "<one action>"}
Actions (x, y are pixel coordinates in this screenshot):
Move(x, y)
Click(x, y)
RightClick(x, y)
DoubleClick(x, y)
ScrollUp(x, y)
ScrollDown(x, y)
Text(x, y, "text to type")
Key("ctrl+c")"""

UITARS_PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
click(start_box='(x1,y1)')
left_double(start_box='(x1,y1)')
right_single(start_box='(x1,y1)')
drag(start_box='(x1,y1)', end_box='(x3,y3)')
hotkey(key='ctrl c') # Split keys with a space and use lowercase. At most 3 keys.
type(content='xxx') # Escape ', " and newlines as \\', \\" and \\n. End with \\n to submit.
scroll(start_box='(x1,y1)', direction='down or up or right or left')
wait() # Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # The task is done (or impossible: then say why).
call_user() # The task cannot be done without help from the user.

## Note
- Use English in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
"""


def explore_messages(image: Image.Image) -> list[dict]:
    """ScreenExplorer: the fixed exploration instruction and one screenshot."""
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": EXPLORE_PROMPT}]}]


# ARPO's prompt (`--prompt arpo`, the default with OSWorld's VMs), as ARPO's agent sends it
# (verl/trainer/gui_agent.py: UI-TARS-1.5's computer-use prompt with box tokens and no call_user),
# after its own system turn, whose typo is what the model saw there.
ARPO_SYSTEM = "Your are a helpful assistant."
ARPO_PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space

click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='xxx') # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the content in normal python string format. If you want to submit your input, use \\n at the end of content. 
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format.

## Note
- Use English in `Thought` and `Action` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
{instruction}
"""
PROMPTS = ("uitars", "arpo")


def uitars_messages(instruction: str, screenshots: list, answers: list,
                    max_images: int = 15, prompt: str = "uitars") -> list[dict]:
    """UI-TARS-1.5 multi-turn prompt: instruction, then (screenshot, answer) pairs.

    screenshots[i] was seen before answers[i]. One more screenshot than answers
    is a prompt for the next step; equal counts is a whole trajectory (for training). Only the
    last `max_images` screenshots are kept; the user turns of older ones are dropped, their
    answers stay as text. prompt "arpo": ARPO's system turn and prompt instead of the family's
    system turn and UITARS_PROMPT, the same turns after them (ARPO's agent rewrites the answers
    in the history with box tokens; here they stay the ids the model sampled).
    """
    if prompt == "arpo":
        messages = [{"role": "system", "content": ARPO_SYSTEM},
                    {"role": "user", "content": ARPO_PROMPT.format(instruction=instruction)}]
    else:
        messages = [{"role": "user", "content": UITARS_PROMPT + instruction}]
    first_kept = max(0, len(screenshots) - max_images)
    for i, shot in enumerate(screenshots):
        if i >= first_kept:
            messages.append({"role": "user", "content": [{"type": "image", "image": shot}]})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


# --------------------------------------------------------------------------------------------
# Encoding: messages -> ids, target mask, pixels


def special_id(tokenizer, token: str) -> int:
    """The id of one special token (e.g. "<|image_pad|>") in this tokenizer's vocabulary."""
    return tokenizer.convert_tokens_to_ids(token)


@dataclass
class Encoded:
    input_ids: list[int]
    target_mask: list[int]                # 1 on assistant tokens (content + <|im_end|>), else 0
    pixel_values: torch.Tensor | None     # (N_patches, 3 * 2 * patch**2) for all images, in order
    image_grid_thw: torch.Tensor | None   # (N_img, 3): patches along time, height, width
    image_sizes: list[tuple[int, int]]    # (w, h) of each image as the model saw it (resized)


def _text_ids(policy, text: str) -> list[int]:
    ids = policy.tokenizer(text, add_special_tokens=False).input_ids
    # A vision token written as text ("<|image_pad|>" in a thought) would desynchronise images
    # and placeholders; it carries no meaning in text, so it is dropped.
    vision = {special_id(policy.tokenizer, t) for t in VISION_TOKENS}
    return [i for i in ids if i not in vision]


def encode_chat(policy, messages: list[dict], add_generation_prompt: bool = True,
                processed: tuple | None = None) -> Encoded:
    """Token ids of a chat in the family's ChatML format, with images processed and expanded.

    target_mask is 1 on each assistant turn's content tokens and its <|im_end|>: exactly what the
    model would have sampled. Assistant content may be a list of token ids (the sampled ones),
    used verbatim; if they do not end in <|im_end|> (cut at max_new_tokens), an <|im_end|> closes
    the turn but is NOT a target, since the model never sampled it. `processed` is what
    _process_images returned for this chat's images, if the caller already ran it (encode_chats).
    """
    tok = policy.tokenizer
    im_start, im_end = special_id(tok, TURN_START), special_id(tok, TURN_END)
    pad = special_id(tok, IMAGE_PAD)
    ids, mask, images = [], [], []

    def add(tokens, target=0):
        ids.extend(tokens)
        mask.extend([target] * len(tokens))

    system = policy.family.default_system  # the template's own system turn (Qwen3-VL has none)
    if system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}] + list(messages)
    for msg in messages:
        target = 1 if msg["role"] == "assistant" else 0
        add([im_start] + _text_ids(policy, msg["role"] + "\n"))  # the turn header is never a target
        content = msg["content"]
        if target and isinstance(content, (list, tuple)) and all(isinstance(t, int) for t in content):
            add(list(content), 1)  # sampled ids, verbatim
            if not content or content[-1] != im_end:
                add([im_end], 0)   # closes a truncated turn; never sampled, so not a target
            add(_text_ids(policy, "\n"))
            continue
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts:
            if part["type"] == "image":
                images.append(part["image"])
                add([special_id(tok, IMAGE_START), pad, special_id(tok, IMAGE_END)])
            elif part["type"] == "text":
                add(_text_ids(policy, part["text"]), target)
        add([im_end], target)
        add(_text_ids(policy, "\n"))
    if add_generation_prompt:
        add([im_start] + _text_ids(policy, "assistant\n"))

    pixel_values = grid = None
    sizes = []
    if images:
        ip = policy.image_processor
        pixel_values, grid = processed if processed is not None else _process_images(policy, images)
        ids, mask = expand_image_tokens(ids, mask, grid, pad, ip.merge_size)
        sizes = [(int(w) * ip.patch_size, int(h) * ip.patch_size) for _, h, w in grid.tolist()]
    return Encoded(input_ids=ids, target_mask=mask, pixel_values=pixel_values,
                   image_grid_thw=grid, image_sizes=sizes)


def _process_images(policy, images: list) -> tuple:
    """Resize under the pixel caps, normalise, cut into patches: (pixel_values, image_grid_thw),
    (N_patches, D) and (N_img, 3), D = 3 * 2 * patch**2 (1176 for 14-pixel patches, 1536 for 16).
    An image object processed before comes from Policy.pixels."""
    done = []
    for im in images:
        hit = policy.pixels.get(id(im))  # plain dict get/set/pop: atomic, safe from encode_chats' threads
        if hit is None or hit[0]() is not im:
            out = policy.image_processor(images=[im.convert("RGB")], return_tensors="pt")
            hit = (weakref.ref(im), out["pixel_values"], out["image_grid_thw"])  # (n, D), (1, 3)
            policy.pixels[id(im)] = hit
            # The entry goes with the image (before its id can be reused by another object).
            weakref.finalize(im, policy.pixels.pop, id(im), None)
        done.append(hit)
    return torch.cat([h[1] for h in done]), torch.cat([h[2] for h in done])  # (N_patches, D), (N_img, 3)


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of a chat, in order (what encode_chat turns into <|image_pad|> runs)."""
    return [p for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if isinstance(p, Mapping) and p.get("type") == "image"]


def encode_chats(policy, batch_messages: list[list[dict]]) -> list[Encoded]:
    """encode_chat for N chats, with their screenshots processed in parallel threads.

    The image processor (Pillow resize, numpy normalise/patchify) is the costly part and mostly
    runs outside the GIL, so threads overlap it (bench/encode_history.py). An image object that several
    chats share (one screenshot, a group of prompts) is processed once. The tokenizer part stays
    serial: a Rust tokenizer shared across threads can fail with "Already borrowed".
    """
    chats = [[p["image"] for p in image_parts(msgs)] for msgs in batch_messages]
    unique = list({id(im): im for ims in chats for im in ims}.values())
    for im in unique:
        im.load()  # decode lazily opened files here: Pillow's lazy loading is not thread-safe
    done = {}
    if unique:
        with ThreadPoolExecutor(min(len(unique), os.cpu_count() or 1)) as pool:
            done = dict(zip(map(id, unique), pool.map(lambda im: _process_images(policy, [im]), unique)))
    processed = [(torch.cat([done[id(im)][0] for im in ims]), torch.cat([done[id(im)][1] for im in ims]))
                 if ims else None for ims in chats]  # per chat: (N_patches, D), (N_img, 3)
    return [encode_chat(policy, m, processed=p) for m, p in zip(batch_messages, processed)]


# --------------------------------------------------------------------------------------------
# The policy, and loading it: the tiny models, real checkpoints (refused unless every weight loads), LoRA


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
    family: qwen_vl.Family      # the model family's row of qwen_vl.FAMILIES (encode_chat reads it too)
    engine: Any = None          # a VLLMEngine when generation runs on vLLM, else None (HF generate)
    # id(image) -> (weakref to it, pixel_values, grid) of live screenshots (filled by encode_chat)
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
class Answer:
    text: str                   # the completion, special tokens removed
    prompt: Encoded             # what the model was given
    ids: list[int]              # sampled ids, up to and including the stop token, no padding
    # log-prob of each sampled id under the distribution it was drawn from: softmax(logits / T),
    # top-p renormalised, vision tokens removed; the same on the vLLM path (processed_logprobs),
    # and what grpo.per_token_logps gives at the same T when top_p is 1.
    logprobs: list[float]


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
    """The tiny models' tokenizer (qwen_vl.tiny_tokenizer on the corpus above), built on the spot."""
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
    if not looks_local:
        _check_hub(name)
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


def _check_hub(name: str, timeout: float = 3.0) -> None:
    """A Hub id: say at once when it can be neither fetched nor read from the cache. Offline,
    huggingface_hub retries every file with growing pauses (~25 s here) before transformers says
    it could not connect; one short look at the Hub decides instead. Cached but offline: the load
    goes on from the cache (HF_HUB_OFFLINE=1, so nothing tries the network again)."""
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE:
        return  # the user said so: transformers reads the cache, and says what is missing, at once
    try:
        requests.head(constants.ENDPOINT, timeout=timeout)
        return
    except requests.RequestException as e:
        why = type(e).__name__
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True  # read at import: the environment alone comes too late
        return
    raise ModelNotFound(f"Cannot fetch '{name}': the Hugging Face Hub ({constants.ENDPOINT}) did not answer "
                        f"within {timeout:g} s ({why}) and it is not in the local cache; download it where there is a "
                        "network (`hf download <id>`), pass a local checkpoint folder, or use --model tiny.")


def load_policy(name: str = "tiny", lora_rank: int = 0, lora_alpha: int = 16,
                gradient_checkpointing: bool = False, device: str | None = None, dtype=None,
                min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                seed: int = 0, vocab_size: int | None = None) -> Policy:
    """A Hugging Face id, a local checkpoint folder (e.g. one save_policy wrote), or a tiny name:
    "tiny" (random Qwen2.5-VL), "tiny-qwen2-vl", "tiny-qwen3-vl" (random weights; `seed` picks them),
    "tiny-uitars", "tiny-explore" (the shipped warm-started tiny Qwen2.5-VL, models/; `seed` does
    not change them).

    lora_rank > 0 wraps the language model's linear layers in LoRA adapters (qwen_vl.LORA_TARGETS;
    the vision tower stays frozen); 0 means full fine-tuning. bf16 on CUDA, fp32 on CPU.
    vocab_size only applies to the random tiny models (e.g. 151936 to measure memory at the real
    vocabulary size).
    """
    from transformers import AutoModelForImageTextToText

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    source = name
    source = WARM_STARTED.get(name, name)  # a shipped tiny model is an ordinary checkpoint folder
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
# Generation: one batched HF generate call (-> Answers), and the weight sync of a vLLM engine


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
             temperature: float = 1.0, top_p: float = 1.0) -> list[Answer]:
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
        gens.append(Answer(
            text=policy.tokenizer.decode(ids[:n], skip_special_tokens=True), prompt=enc,
            ids=ids[:n], logprobs=logps[b, :n].tolist()))
    return gens


def sync_weights(policy: Policy) -> None:
    """After an optimizer step: push the new weights to the generation engine (no-op for HF)."""
    if policy.engine is not None:
        policy.engine.sync_weights(policy)
