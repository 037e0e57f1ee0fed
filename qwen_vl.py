"""qwen_vl.py: everything that is specific to the Qwen-VL model family, in one file.

    python -m pytest -q tests/test_families.py     # Qwen2-VL, Qwen2.5-VL, Qwen3-VL through the whole loop

The rest of the code is written against Hugging Face's generic classes (AutoModelForImageTextToText,
AutoTokenizer) and asks this file for the rest. To try another Qwen-VL checkpoint, nothing needs
editing: load_policy reads config.json's `model_type` and looks it up in FAMILIES below (UI-TARS-1.5
is a Qwen2.5-VL). To try another family, this is the file to rewrite; what the others ask of it:

  model.py         the special tokens, the ChatML turn markers, the image placeholder and how many
                  pads an image becomes (expand_image_tokens), the default system turn
  model.py        FAMILIES (the transformers class, the vision attention class to batch, the
                  tiny test configs), the 3D-rope pre-hook (install_rope_hook), LORA_TARGETS,
                  the image processor, the tiny tokenizer's pieces, and for generate the same
                  image_inputs and mm_token_types as grpo.py
  plumbing/warm_start.py   family and image_processor (its synthetic screenshots, encoded as a run would)
  grpo.py         image_inputs (how a batch's images are joined) and forward_inputs (what a
                  forward gets besides the ids: the image tensors and the token types for 3D rope)
  vllm_engine.py  the architecture name vLLM picks its model by, the resize factor
  actions.py      nothing: smart_resize takes the factor as an argument (Policy.resize_factor:
                  28 for Qwen2/2.5-VL, 32 for Qwen3-VL; 28 is its default)

This file imports nothing of ours (tests/test_layers.py): it sits below model.py.

What the three families share, and so what is written once here: the ChatML turns (`<|im_start|>`,
`<|im_end|>`), one `<|vision_start|><|image_pad|><|vision_end|>` per image that the processor's
grid turns into t*h*w/4 pads (2x2 patches merged into one token), 3D (time, height, width) rotary
positions computed from `mm_token_type_ids`, `pixel_values` + `image_grid_thw` as the image
tensors, and a vision attention with one qkv projection that attends within `cu_seqlens` spans.
What differs is in FAMILIES: patch size (14 / 14 / 16, so a model token covers 28 or 32 pixels),
the default system turn (Qwen3-VL's template adds none), the vision attention class, the image
normalisation, and the tiny configs' shapes.

Where we depart: nothing here is from the papers; it is the model plumbing. We do the Qwen
processor's job ourselves (the image processor for pixels, our own pad expansion), because the
processor class needs torchvision, which cannot load beside CPU torch.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Tokens and the chat format (the same in Qwen2-VL, Qwen2.5-VL and Qwen3-VL)

# The special tokens, in their vocabulary order (151643 ... 151656 in the real ones).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
# Tokens a policy must never sample: they mean "an image goes here" to the model's forward pass.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"         # <|im_start|>role\n ... <|im_end|>\n
IMAGE_START, IMAGE_PAD, IMAGE_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
PAD_TOKEN = "<|endoftext|>"
STOP_TOKENS = [TURN_END, PAD_TOKEN]                          # generation stops at either
QWEN_SYSTEM = "You are a helpful assistant."                 # Qwen2/2.5-VL's default system turn
MERGE = 2  # the vision merger fuses 2x2 patches into one language-model token (all three families)

# The language model's linear layers get LoRA adapters; a regex, because the vision blocks also
# have gate/up/down_proj (and qkv) and stay frozen.
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def chat_template(default_system: str | None) -> str:
    """The ChatML template the real checkpoints ship (images, text, generation prompt; no tools or
    video), written out for the tiny tokenizer. default_system: the system turn added when a chat
    has none (Qwen2/2.5-VL), or None (Qwen3-VL). model.encode_chat builds the same tokens piece by
    piece so it can mark the assistant tokens; tests check that the two agree."""
    system = ("{%- if loop.first and m['role'] != 'system' -%}{{ '<|im_start|>system\\n"
              + default_system + "<|im_end|>\\n' }}{%- endif -%}") if default_system else ""
    return (
        "{%- for m in messages -%}" + system +
        "{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string -%}{{ m['content'] }}"
        "{%- else -%}{%- for p in m['content'] -%}{%- if p['type'] == 'image' -%}"
        "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif p['type'] == 'text' -%}{{ p['text'] }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def expand_image_tokens(ids: list[int], mask: list[int], grid_thw: torch.Tensor, pad_id: int,
                        merge_size: int = MERGE) -> tuple[list[int], list[int]]:
    """Replace the i-th single <|image_pad|> by one pad per visual token of image i.

    The vision tower cuts the resized image into grid_t * grid_h * grid_w patches and its merger
    fuses each merge_size x merge_size block into one token for the language model, so the
    language model reserves grid_t * grid_h * grid_w // merge_size**2 positions per image.
    """
    out_ids, out_mask, image = [], [], 0
    for tok, m in zip(ids, mask):
        if tok == pad_id:
            t, h, w = grid_thw[image].tolist()
            n = t * h * w // merge_size**2
            out_ids += [pad_id] * n
            out_mask += [0] * n  # image tokens are never targets
            image += 1
        else:
            out_ids.append(tok)
            out_mask.append(m)
    assert image == len(grid_thw), "one <|image_pad|> per image"
    return out_ids, out_mask


# --------------------------------------------------------------------------------------------
# The families: one row per config.json `model_type`


@dataclass(frozen=True)
class Family:
    model_type: str               # config.json's "model_type"
    architecture: str             # the transformers class (also how vLLM picks its model)
    default_system: str | None    # the system turn the chat template adds to a chat without one
    vision_attention: str         # the vision tower's attention class (install_vision_windows batches it)
    patch_size: int               # pixels per patch side; a model token covers patch_size * MERGE
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)  # the image processor's normalisation
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)  # (OpenAI CLIP's, Qwen2/2.5-VL)

    @property
    def resize_factor(self) -> int:
        """Both sides of a screenshot as the model sees it are multiples of this (actions.smart_resize)."""
        return self.patch_size * MERGE


FAMILIES = {f.model_type: f for f in [
    Family("qwen2_vl", "Qwen2VLForConditionalGeneration", QWEN_SYSTEM, "VisionAttention", 14),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", QWEN_SYSTEM, "Qwen2_5_VLVisionAttention", 14),
    # Qwen3-VL: 16-pixel patches, its own normalisation, and no default system turn in its template.
    Family("qwen3_vl", "Qwen3VLForConditionalGeneration", None, "Qwen3VLVisionAttention", 16,
           (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
]}

# Random-weight test models of the real classes (model.load_policy("tiny") & co.): no download.
TINY = {"tiny": "qwen2_5_vl", "tiny-qwen2-vl": "qwen2_vl", "tiny-qwen3-vl": "qwen3_vl"}


class UnknownFamily(ValueError):
    """A checkpoint whose model_type has no row in FAMILIES."""


def family(config) -> Family:
    """The row of FAMILIES for a model's config (or a model_type string); UnknownFamily otherwise."""
    model_type = config if isinstance(config, str) else getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnknownFamily(f"model type '{model_type}' is not a Qwen-VL family this code knows "
                            f"({', '.join(FAMILIES)}); add a row for it to FAMILIES in qwen_vl.py")
    return FAMILIES[model_type]


# --------------------------------------------------------------------------------------------
# Image processor and the tiny test models


def image_processor_class():
    # transformers 5.x names the PIL/numpy processor `...Pil`; `Qwen2VLImageProcessor` there is the
    # torchvision one. Older versions only have the PIL one, under the plain name. All three
    # families use this processor (Qwen3-VL with 16-pixel patches).
    import transformers
    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor


def image_processor(fam: Family, min_pixels: int, max_pixels: int):
    """A family's image processor built from its constants (2-frame patches, 2x2 merge), for models
    made from a config: the tiny ones, the random 3B in bench/."""
    return image_processor_class()(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=fam.patch_size,
                                   temporal_patch_size=2, merge_size=MERGE, image_mean=list(fam.image_mean),
                                   image_std=list(fam.image_std))


def tiny_tokenizer(corpus: list[str], fam: Family):
    """A byte-level BPE with Qwen's pre-tokenizer split and special tokens, trained on the spot on
    `corpus` (the prompts and answers it will see, so prompts are a few hundred tokens, not bytes)."""
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
    tok.train_from_iterator(corpus, trainer)
    # Special tokens go after the BPE vocabulary, in Qwen's order.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=TURN_END, pad_token=PAD_TOKEN,
                                   padding_side="left")
    fast.chat_template = chat_template(fam.default_system)
    return fast


def tiny_config(fam: Family, tokenizer, vocab_size: int | None = None):
    """A config of the family's real structure at toy width: ~0.3M parameters (vocab 1088)."""
    import transformers
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=vocab_size or ((len(tokenizer) + 63) // 64 * 64),  # round up like real vocabularies
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,  # head_dim 16, grouped-query attention
        max_position_embeddings=8192, rms_norm_eps=1e-6,
        # mrope: the 8 rotary frequency pairs of a 16-dim head split over (time, height, width),
        # like 3B's [16, 24, 24] for head_dim 128.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        # Larger-than-usual init so the random model's next-token distribution is peaked: greedy
        # decoding then has clear winners (batched vs single-prompt tests are not decided by noise).
        initializer_range=0.2,
        bos_token_id=ids[PAD_TOKEN], eos_token_id=ids[TURN_END], pad_token_id=ids[PAD_TOKEN],
    )
    special = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids[IMAGE_START], vision_end_token_id=ids[IMAGE_END])
    common = dict(depth=2, num_heads=2, patch_size=fam.patch_size, spatial_merge_size=MERGE,
                  temporal_patch_size=2, initializer_range=0.2)
    if fam.model_type == "qwen2_vl":  # full attention in every block, out width = the LM's
        vision = dict(common, embed_dim=32, mlp_ratio=2, hidden_size=64)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    if fam.model_type == "qwen2_5_vl":  # 112-pixel windows in block 0, full attention in block 1
        vision = dict(common, hidden_size=32, intermediate_size=64, window_size=112, out_hidden_size=64,
                      fullatt_block_indexes=[1], tokens_per_second=2)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                             **special)
    if fam.model_type == "qwen3_vl":  # explicit head_dim and q/k norms, interleaved mrope, deepstack
        text = dict(text, head_dim=16, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **special)
    raise UnknownFamily(f"no tiny config for model type '{fam.model_type}'; add one to tiny_config in qwen_vl.py")


# --------------------------------------------------------------------------------------------
# What a forward gets: image tensors and the token types that switch on 3D rotary positions


def image_inputs(items) -> dict:
    """The image tensors of several prompts or samples (each with .pixel_values, .image_grid_thw, or
    None for no image), joined in order: the order their pads appear in when reading the batch
    row-major. {"pixel_values": (sum N_patches, D) or None, "image_grid_thw": (N_img, 3) or None}."""
    pix = [x.pixel_values for x in items if x.pixel_values is not None]
    grids = [x.image_grid_thw for x in items if x.image_grid_thw is not None]
    return {"pixel_values": torch.cat(pix) if pix else None,     # (sum N_patches, D)
            "image_grid_thw": torch.cat(grids) if grids else None}  # (N_img, 3)


def mm_token_types(model_or_inner, input_ids: torch.Tensor) -> dict:
    """{"mm_token_type_ids": (B, T) 0 text / 1 image / 2 video} if this transformers wants it, else {}.

    `model_or_inner`: the ...ForConditionalGeneration (peft-wrapped or not) or its inner model.
    HF generate() computes the prompt's 3D rotary positions from this argument before any forward
    runs, so generate must be given it explicitly (the pre-hook below covers plain forwards)."""
    inner = model_or_inner
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    inner = getattr(inner, "model", inner)  # the outer class holds the inner one as .model
    if "mm_token_type_ids" not in inspect.signature(inner.forward).parameters:
        return {}
    config = inner.config
    types = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()  # (B, T)
    return {"mm_token_type_ids": types}


def _rope_hook(module, args, kwargs):
    # transformers >= 5.x computes the 3D (time, height, width) rotary positions only when the
    # forward is given `mm_token_type_ids`: without them Qwen2/2.5-VL silently fall back to 1D
    # positions (log-probs no longer match generation) and Qwen3-VL raises. The Qwen processor makes
    # them; we don't use it, so this pre-hook on the inner model (which the outer model calls with
    # keywords) derives them from input_ids for EVERY forward (grpo's log-probs, anyone's).
    # A module-level function that reads only its `module` argument: a closure over the model
    # would make model -> hook -> model a reference cycle, which only the cyclic garbage collector
    # frees, and vLLM's gc.freeze() exempts whatever is alive at engine start from it, so a
    # replaced policy would stay in GPU memory (tests/test_vllm_engine.py checks no cycle is left).
    ids = kwargs.get("input_ids")
    if kwargs.get("mm_token_type_ids") is None and ids is not None and kwargs.get("image_grid_thw") is not None:
        kwargs.update(mm_token_types(module, ids))
    return args, kwargs


def install_rope_hook(model) -> None:
    """Every forward of `model` (a ...ForConditionalGeneration, before any peft wrapping) gets 3D
    rotary positions for its image tokens, whoever calls it (see _rope_hook)."""
    model.model.register_forward_pre_hook(_rope_hook, with_kwargs=True)


def forward_inputs(model, batch: dict, device) -> dict:
    """The keyword arguments of the inner model's forward for a batch of ids with images
    (grpo.per_token_logps): ids, attention mask, the image tensors in the model's dtype and the
    token types (explicit here; the hook would add them too)."""
    kwargs = dict(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    if batch.get("pixel_values") is not None:
        kwargs["pixel_values"] = batch["pixel_values"].to(device, getattr(model, "dtype", None))  # (sum N_patches, D)
        kwargs["image_grid_thw"] = batch["image_grid_thw"].to(device)  # (N_img, 3)
        kwargs.update(mm_token_types(model, kwargs["input_ids"]))  # (B, T)
    return kwargs

# --------------------------------------------------------------------------------------------
# The vision tower's window attention, in a handful of calls instead of thousands
#
# model.py's wrap_policy calls install_vision_windows(model, FAMILIES[...].vision_attention).
# Why: Qwen2.5-VL's vision tower cuts every screenshot into 112x112-pixel windows (64 patches each)
# and attends inside each window in 28 of its 32 blocks (the other 4 attend over the whole image).
# Without flash-attention's variable-length kernel, transformers runs that as a Python loop, one
# scaled_dot_product_attention call per window: a 1280x720 screenshot has 84 windows, so 8 of them
# cost 84 * 8 * 32 = 21,504 attention calls per forward, each too small to keep a GPU busy: the
# time goes to launching them (bench/gpu_profile.py, bench/gpu_update.py measure it; on a CPU the
# calls are not the bottleneck, bench/vision_windows.py).
# Instead, windows of equal length are stacked and attended in ONE call per distinct length. A
# screenshot has at most four (whole windows, the right edge, the bottom edge, the corner), and all
# screenshots of one size share them, so a block makes <= 4 calls whatever the batch size. No
# padding and no mask: the same math as the loop (tests/test_vision_windows.py checks outputs and
# gradients against the stock forward), and a GPU still gets its flash / cuDNN kernels.
# Qwen2-VL's and Qwen3-VL's towers attend over each whole image in the same per-span loop with the
# same module layout (qkv, 2D rotary, proj): a batch of equally sized screenshots becomes one call
# per block. An attention class name that matches no module is refused, so a misnamed family is not
# silently left on the slow path.
# Nothing in the model changes: the forward of each vision attention module of this one instance is
# replaced (its class becomes a subclass with our forward), and only when the model does not use
# flash-attention, whose varlen kernel already does this. The forward mirrors transformers
# 5.17-5.24 (qkv projection, 2D rotary, attention, proj); a module without those parts is left alone.


def _windowed_forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                      position_embeddings=None, **kwargs) -> torch.Tensor:
    """Drop-in for the vision attention's forward (Qwen2_5_VLVisionAttention & co.).
    hidden_states: (N_patches, D), all images of the batch concatenated; cu_seqlens: (W+1,) window
    (or image) boundaries, windows contiguous."""
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # 3 x (N, H, Dh)
    cos, sin = position_embeddings
    q, k = self.rotary(q, k, cos, sin)  # (N, H, Dh) each: the 2D rotary of the class's own module

    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]  # (W,), (W,)
    outs, order = [], []
    for length in torch.unique(lengths).tolist():  # <= 4 lengths per screenshot size
        if length == 0:  # transformers drops empty windows already; harmless if one slips through
            continue
        rows = starts[lengths == length, None] + torch.arange(length, device=cu_seqlens.device)  # (w, L)
        qw, kw, vw = (t[rows].transpose(1, 2) for t in (q, k, v))  # (w, H, L, Dh) each
        o = F.scaled_dot_product_attention(qw, kw, vw, scale=self.scaling)  # (w, H, L, Dh)
        outs.append(o.transpose(1, 2).reshape(-1, *o.shape[1:2], o.shape[-1]))  # (w*L, H, Dh)
        order.append(rows.reshape(-1))  # (w*L,) where those rows came from
    # Put the rows back in sequence order: out[order[i]] = outs[i], as a gather (autograd-friendly).
    order_all = torch.cat(order)  # (N,) a permutation of 0..N-1
    inverse = torch.empty_like(order_all)
    inverse[order_all] = torch.arange(n, device=order_all.device)
    out = torch.cat(outs)[inverse]  # (N, H, Dh)
    return self.proj(out.reshape(n, -1))  # (N, D)


_WINDOWED: dict = {}  # a vision attention class -> its subclass with the batched forward


def _windowed_class(cls):
    # The forward goes on a subclass, and the module's __class__ is switched to it (FSDP2's
    # fully_shard switches classes the same way). A bound method stored on the module instead
    # would be a reference cycle (module -> method -> module) that only the cyclic garbage
    # collector frees, which vLLM's gc.freeze() stops for whatever is alive at engine start.
    if cls not in _WINDOWED:
        # The 2D rotary the stock forward applies, from the class's own modeling file.
        rotary = getattr(sys.modules[cls.__module__], "apply_rotary_pos_emb_vision")
        _WINDOWED[cls] = type(cls.__name__, (cls,), {"forward": _windowed_forward, "stock_class": cls,
                                                     "rotary": staticmethod(rotary)})
    return _WINDOWED[cls]


def install_vision_windows(model, class_name: str) -> int:
    """Give every vision attention module of `model` (peft-wrapped or not) whose class is
    `class_name` the batched window forward. Returns how many modules were changed (0:
    flash-attention, or a module layout this forward does not know). ValueError if the model has
    no module of that class at all (a misnamed class in qwen_vl.FAMILIES).
    `module.__class__ = module.stock_class` puts a module's stock forward back."""
    changed = found = 0
    for module in model.modules():
        cls = getattr(module, "stock_class", type(module))
        if cls.__name__ != class_name:
            continue
        found += 1
        impl = getattr(module.config, "_attn_implementation", "sdpa") or "sdpa"
        if "flash" in impl or not all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling")) \
                or not hasattr(sys.modules[cls.__module__], "apply_rotary_pos_emb_vision"):
            continue
        module.__class__ = _windowed_class(cls)
        changed += 1
    if not found:
        raise ValueError(f"the model has no {class_name} module to batch; fix the family's vision_attention "
                         "in qwen_vl.FAMILIES.")
    return changed
