"""Benchmark: Qwen2.5-VL-3B's vision tower, batched window attention (qwen_vl.py) vs stock.

    python bench/vision_windows.py                     # GPU if there is one: 32 blocks, 8 screenshots
    python bench/vision_windows.py                     # CPU: depth 2, 1 screenshot, ~1 minute

The tower is the 3B's (width 1280, 16 heads, 112-pixel windows, full attention every 8th block)
with random weights, built from its config (no download); --depth cuts it shorter for a CPU run,
keeping one full-attention block at the end. Input: --n 1280x720 screenshots (4,784 patches, 84
windows each). Timed: forward + backward of the tower (what one update's vision part costs, less
checkpointing's recompute), stock transformers loop vs ours, alternating, best of --repeats. The
outputs are compared too (bf16 on GPU, so to a tolerance).

What to expect: the stock loop's cost is one attention call per window per block, each too small
to keep a GPU busy, so on a GPU the batched version wins by the launch overhead it removes. On a
CPU the calls are not the bottleneck (the matmuls are), so expect a ratio near 1 there.
The outputs must be identical either way (docs/log.md has the CPU and GPU runs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_update as G  # noqa: E402 -- the 3B config lives there
import model as M  # noqa: E402
import qwen_vl  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=0, help="vision blocks; 0 = the 3B's 32 on GPU, 2 on CPU")
    ap.add_argument("--n", type=int, default=0, help="screenshots; 0 = 8 on GPU, 1 on CPU")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VisionTransformerPretrainedModel,
                                                                    Qwen2_5_VLVisionConfig)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    depth, n = args.depth or (32 if cuda else 2), args.n or (8 if cuda else 1)
    vc = dict(G.QWEN25_VL_3B["vision_config"], depth=depth,
              fullatt_block_indexes=[i for i in range(depth) if i % 8 == 7] or [depth - 1])
    config = Qwen2_5_VLVisionConfig(**vc)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)

    ip = M.qwen_image_processor()
    rng = np.random.RandomState(0)
    shots = [Image.fromarray((rng.rand(720, 1280, 3) * 255).astype("uint8")) for _ in range(n)]
    out = ip(images=shots, return_tensors="pt")
    pixels = out["pixel_values"].to(device, dtype)   # (n * 4784, 1176)
    grid = out["image_grid_thw"].to(device)           # (n, 3)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        tower.zero_grad(set_to_none=True)
        y = tower(pixels, grid_thw=grid)
        y = getattr(y, "pooler_output", y)  # (n * 1196, 2048)
        y.float().square().mean().backward()
        sync()
        return y.detach()

    attn = [b.attn for b in tower.blocks]
    ways = {"stock loop": lambda: [setattr(a, "__class__", getattr(a, "stock_class", type(a))) for a in attn],
            "batched windows": lambda: qwen_vl.install_vision_windows(tower, "Qwen2_5_VLVisionAttention")}
    best, outs = {w: float("inf") for w in ways}, {}
    for w, use in ways.items():  # warm-up both
        use()
        outs[w] = step()
    for _ in range(args.repeats):
        for w, use in ways.items():
            use()
            t = time.perf_counter()
            step()
            best[w] = min(best[w], time.perf_counter() - t)

    windows = int(((grid[:, 1] // 8 + (grid[:, 1] % 8 > 0)) * (grid[:, 2] // 8 + (grid[:, 2] % 8 > 0))).sum())
    print(f"vision tower: depth {depth} (full attention at {config.fullatt_block_indexes}), width 1280, "
          f"{device} {str(dtype).replace('torch.', '')}; {n} screenshots 1280x720 = {pixels.shape[0]} patches, "
          f"{windows} windows")
    print(f"{'way':>16} {'fwd+bwd s':>10} {'speedup':>8}")
    for w in ways:
        print(f"{w:>16} {best[w]:10.3f} {best['stock loop'] / best[w]:8.2f}")
    diff = (outs["stock loop"].float() - outs["batched windows"].float()).abs().max().item()
    print(f"max |difference| of the outputs: {diff:.2e}")
    print(f"vision_windows_speedup: {best['stock loop'] / best['batched windows']:.2f}")


if __name__ == "__main__":
    main()
