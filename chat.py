"""chat.py: what the policy is shown. The two prompts, and chat messages -> token ids, target
mask, pixels.

    from model import load_policy; from chat import explore_messages, encode_chat
    enc = encode_chat(policy, explore_messages(screenshot))   # .input_ids, .target_mask, .pixel_values
    python -m pytest -q tests/test_model.py                   # exact masks, chat template, image tokens

The bottom of the learner side, on top of qwen_vl.py only: the model family's special tokens, turn
markers, image placeholder and default system turn come from there, so this file holds what does not
change with the family (the prompts, the target mask, the screenshot cache). model.py loads, saves
and samples from the policy and imports the encoding from here. A `policy` argument below is a
model.Policy, used through four attributes only: .tokenizer, .image_processor, .family (its
qwen_vl.FAMILIES row) and .pixels (the cache of processed screenshots). We do the Qwen-VL
processor's job ourselves: the image processor for the pixels and our own <|image_pad|> expansion,
because the processor class needs torchvision, which cannot load beside CPU torch.

Screenshots are processed once: a policy keeps the processed pixels of every image object that is
still alive (Policy.pixels; an entry goes when its image is garbage-collected). ARPO re-sends each
desktop's last 15 screenshots at every step and once more for the update; without this cache, each
would go through the image processor (~45 ms at 1280x720) every time. No size cap is needed: the
entries live as long as the screenshots the trainer holds anyway, and the batch that uses them
holds the same pixels. Images are treated as immutable once encoded: draw on a copy.

Where we depart from the papers:
  - ScreenExplorer's exact prompt text is not published in full; ours asks for the same JSON
    (`intent`, `action`) with the same action names.
  - UI-TARS's multi-turn history drops the user turns whose screenshot fell out of the last K
    (as the UI-TARS/OSWorld agent does); the assistant turns all stay, as text.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from PIL import Image

from qwen_vl import IMAGE_END, IMAGE_PAD, IMAGE_START, TURN_END, TURN_START, VISION_TOKENS, expand_image_tokens


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


# --------------------------------------------------------------------------------------------
# Prompts

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


def uitars_messages(instruction: str, screenshots: list, thoughts_actions: list,
                    max_images: int = 15) -> list[dict]:
    """UI-TARS-1.5 multi-turn prompt: instruction, then (screenshot, answer) pairs.

    screenshots[i] was seen before answer thoughts_actions[i]. One more screenshot than answers
    is a prompt for the next step; equal counts is a whole trajectory (for training). Only the
    last `max_images` screenshots are kept; the user turns of older ones are dropped, their
    answers stay as text.
    """
    messages = [{"role": "user", "content": UITARS_PROMPT + instruction}]
    first_kept = max(0, len(screenshots) - max_images)
    for i, shot in enumerate(screenshots):
        if i >= first_kept:
            messages.append({"role": "user", "content": [{"type": "image", "image": shot}]})
        if i < len(thoughts_actions):
            messages.append({"role": "assistant", "content": thoughts_actions[i]})
    return messages


# --------------------------------------------------------------------------------------------
# Encoding: messages -> ids, target mask, pixels


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

    The image processor (Pillow resize, numpy normalise/patchify) costs ~45 ms per 1280x720
    screenshot and mostly runs outside the GIL, so threads overlap it: 8 screenshots took 0.26 s
    on 2 threads against 0.7 s in one call on this 2-core machine. An image object that several
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
