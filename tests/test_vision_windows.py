"""qwen_vl.py gives the same vision-tower outputs and gradients as transformers' own loop.

    python -m pytest -q tests/test_vision_windows.py

Real tiny Qwen2.5-VL (model.load_policy("tiny"), which installs the batched forward), real pixels
from the image processor. The reference is the same model with the stock forward put back.
Screenshots of three different sizes in one batch, so the windows come in several lengths (whole,
right edge, bottom edge, corner) and the full-attention block sees images of unequal length.
The same for the tiny Qwen2-VL and Qwen3-VL, whose towers attend over whole images (the class each
family batches is named in qwen_vl.FAMILIES), and a misnamed class is an error, not a silent miss.
"""
import os
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pytest  # noqa: E402

import model as M  # noqa: E402
import qwen_vl  # noqa: E402


def _pixels(policy, sizes):
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = policy.image_processor(images=imgs, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]  # (N_patches, C*T*P*P), (n_images, 3)


def _stock(module):
    # The stock class (and its forward) again.
    module.__class__ = module.stock_class


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_same_outputs_and_gradients_as_the_stock_loop(name):
    policy = M.load_policy(name, seed=3)
    visual = M.inner_model(policy.model).visual
    attn = [b.attn for b in visual.blocks]
    assert all(type(a).forward is qwen_vl._windowed_forward for a in attn), "load_policy must install it"
    assert all(type(a).stock_class.__name__ == policy.family.vision_attention for a in attn)

    # 1280x720 -> 92x52 patches: windows of 64, 32 (right/bottom edges) and 16 (corner) patches
    pixels, grid = _pixels(policy, [(1280, 720), (300, 200), (1280, 720)])
    ref_pixels = pixels.clone().requires_grad_(True)
    new_pixels = pixels.clone().requires_grad_(True)

    new = visual(new_pixels, grid_thw=grid)
    new = getattr(new, "pooler_output", new)  # transformers 5.x returns an output object
    for a in attn:
        _stock(a)
    ref = visual(ref_pixels, grid_thw=grid)
    ref = getattr(ref, "pooler_output", ref)
    assert new.shape == ref.shape and new.shape[0] == int((grid.prod(-1) // 4).sum())
    torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)

    w = torch.randn_like(ref)  # any fixed direction; the gradients must agree too
    (new * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(new_pixels.grad, ref_pixels.grad, rtol=1e-4, atol=1e-5)


def test_window_lengths_really_vary_and_calls_are_few():
    # The point of the file: one attention call per distinct window length, not one per window.
    policy = M.load_policy("tiny")
    visual = M.inner_model(policy.model).visual
    pixels, grid = _pixels(policy, [(1280, 720)] * 4)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real_sdpa(*a, **k)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            visual(pixels, grid_thw=grid)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real_sdpa
    # tiny tower: block 0 windowed (lengths 64, 32, 32, 16 -> 3 calls), block 1 full (1 call)
    lengths = sorted({s[2] for s in calls})
    assert lengths == [16, 32, 64, 92 * 52], lengths
    assert len(calls) == 4, [tuple(s) for s in calls]
    # 4 screenshots x 84 windows would have been 336 calls in the stock loop, plus 4 full ones
    assert sum(s[0] for s in calls if s[2] != 92 * 52) == 4 * 84


def test_install_skips_flash_attention_and_counts_modules():
    policy = M.load_policy("tiny")
    visual = M.inner_model(policy.model).visual
    for b in visual.blocks:
        _stock(b.attn)
    visual.config._attn_implementation = "flash_attention_2"  # its varlen kernel needs no help
    assert qwen_vl.install_vision_windows(policy.model, "Qwen2_5_VLVisionAttention") == 0
    visual.config._attn_implementation = "sdpa"
    assert qwen_vl.install_vision_windows(policy.model, "Qwen2_5_VLVisionAttention") == len(visual.blocks) == 2
    # A class name that matches no module (a family row naming the wrong class) is an error.
    with pytest.raises(ValueError, match="no Qwen3VLVisionAttention module"):
        qwen_vl.install_vision_windows(policy.model, "Qwen3VLVisionAttention")
