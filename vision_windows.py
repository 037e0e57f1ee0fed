"""Window attention for the Qwen-VL vision towers in a handful of calls instead of thousands.

    import vision_windows; vision_windows.install(model, "Qwen2_5_VLVisionAttention")
    # model.py's wrap_policy does this, with the class qwen_vl.FAMILIES names for the model's family
    python -m pytest -q tests/test_vision_windows.py          # same outputs and gradients as stock

Why: Qwen2.5-VL's vision tower cuts every screenshot into 112x112-pixel windows (64 patches each)
and attends inside each window in 28 of its 32 blocks (the other 4 attend over the whole image).
Without flash-attention's variable-length kernel, transformers runs that as a Python loop, one
scaled_dot_product_attention call per window: a 1280x720 screenshot has 84 windows, so 8 of them
cost 84 * 8 * 32 = 21,504 attention calls per forward. Each call is tiny, so the time goes to
launching them, not to arithmetic. Measured on an H200 (bench/gpu_profile.py): one GRPO update of
Qwen2.5-VL-3B spent 9.3 s of wall time for 2.3 s of GPU work, with 37,840 attention calls at
~7 us of GPU time each. With this file: 2.29 s per update, GPU-bound (bench/gpu_update.py). On a
CPU the calls were never the bottleneck (bench/vision_windows.py: 0.98x), so nothing changes there.

What this does instead: windows of equal length are stacked into one batch and attended in ONE
call per distinct length. A screenshot has at most four window lengths (whole windows, the right
edge, the bottom edge, the corner), and all screenshots of one size share them, so a block makes
<= 4 calls whatever the batch size. No padding and no mask, so the result is the same math as the
loop (tests/test_vision_windows.py checks outputs and gradients against the stock forward) and a
GPU still gets its flash / cuDNN kernels, which a mask would rule out.

The same holds, with less at stake, for Qwen2-VL's and Qwen3-VL's vision towers: they attend over
each whole image (cu_seqlens are image boundaries) in the same per-span loop with the same module
layout (qkv, 2D rotary, proj), so a batch of equally sized screenshots becomes one call per block
instead of one per screenshot. qwen_vl.FAMILIES names each family's attention class; install()
refuses a name that matches no module, so a family whose class was misnamed is not silently
left on the slow path.

Where we depart: nothing in the model changes; we replace the forward of each vision attention
module of this one model instance (its class becomes a subclass with our forward; other instances
keep the stock one), and only when the model is NOT using flash-attention, whose varlen kernel
already does this (an eager or flex model gets sdpa here:
the same math). install() decides once; switch attention implementations before calling it.
The forward mirrors transformers 5.17-5.24 (qkv projection, 2D rotary, attention, proj);
install() checks that the module still has those parts and leaves the model alone if a future
version changed them.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


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


def install(model, class_name: str) -> int:
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
