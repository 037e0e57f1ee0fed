"""Benchmark: one batched generate call for N prompts vs N one-prompt calls (model.generate).

    python bench/generate.py                       # 8 prompts, 64 new tokens, both image sizes
    python bench/generate.py --n 16 --max-new-tokens 128 --max-pixels 1003520
    python bench/generate.py --threads 1           # steadier on a machine shared with other jobs

The workload is a ScreenExplorer step: N exploration prompts, each with its own 1280x720
screenshot (random pixels), resized under --max-pixels. By default two sizes, one table row pair
each: the library default 1280*28*28 (the full 1288x728 -> 1,196 image tokens, what a run uses
unless told otherwise) and 256*28*28 (588x336 -> 252 image tokens, a common way to save compute).
The headline (last line) is the speedup at the FIRST size given, i.e. the library default.
Tiny random Qwen2.5-VL on CPU. Greedy decoding, so both ways produce the SAME tokens (checked)
and the token counts are equal; the random model rarely stops early, so nearly every prompt
runs the full --max-new-tokens.

Why batching wins: a decode step of a small model costs about the same for 1 row as for 8 (it
is Python + kernel-launch overhead, not arithmetic), so N sequential calls pay N times the steps.
The prefill (vision tower + prompt) is real arithmetic and does not batch for free, which is why
the speedup shrinks as images grow: it is smaller at the default size than at 256*28*28.
Measured on 2 shared CPU cores with --threads 1 (8 prompts, 64 tokens): 1.3x at the default size
(batched 2.0 s vs sequential 2.6 s: the prefill of 8 x 1,352 tokens and 8 x 4,784 vision patches
dominates) and 3.0x at 256*28*28. The issue's >= 4x target is met by neither here.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402


def measure(args, max_pixels: int, shots: list) -> dict:
    """Best-of-`repeats` seconds for both ways at one image size, plus what they produced."""
    policy = M.load_policy("tiny", max_pixels=max_pixels)
    prompts = [M.explore_messages(s) for s in shots]
    enc = M.encode_chat(policy, prompts[0])

    def batched():
        return M.generate(policy, prompts, max_new_tokens=args.max_new_tokens, temperature=0)

    def sequential():
        return [M.generate(policy, [p], max_new_tokens=args.max_new_tokens, temperature=0)[0] for p in prompts]

    batched(), sequential()  # warm-up: first-call allocations, lazy imports
    # The two ways alternate within each repeat, so a burst of load from elsewhere on a shared
    # machine hits both alike; the best time of each is kept.
    times, outs = {"sequential": float("inf"), "batched": float("inf")}, {}
    for _ in range(args.repeats):
        for name, fn in [("sequential", sequential), ("batched", batched)]:
            t = time.perf_counter()
            outs[name] = fn()
            times[name] = min(times[name], time.perf_counter() - t)
    return dict(
        times=times, size=enc.image_sizes[0], prompt=len(enc.input_ids),
        n_img=enc.input_ids.count(policy.model.config.image_token_id),
        same=all(a.completion_ids == b.completion_ids for a, b in zip(outs["sequential"], outs["batched"])),
        tokens=sum(len(g.completion_ids) for g in outs["batched"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8, help="prompts (one screenshot each)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, nargs="+", default=[M.DEFAULT_MAX_PIXELS, 256 * 28 * 28],
                    help="image size caps, one table row pair each; the headline is the first")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads; 0 = all cores (on a machine shared with other jobs, 1 is far steadier)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each way (alternating); the best is kept")
    args = ap.parse_args()

    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    rng = np.random.RandomState(0)
    shots = [Image.fromarray((rng.rand(720, 1280, 3) * 255).astype("uint8")) for _ in range(args.n)]
    results = [(mp, measure(args, mp, shots)) for mp in args.max_pixels]

    print(f"{args.n} prompts, one 1280x720 screenshot each, {args.max_new_tokens} new tokens max, greedy, "
          f"{torch.get_num_threads()} threads")
    print(f"{'max_pixels':>11} {'image':>9} {'img tok':>7} {'prompt':>6} {'way':>10} {'seconds':>8} "
          f"{'new tok':>7} {'tok/s':>7} {'speedup':>7} {'same':>5}")
    for mp, r in results:
        w, h = r["size"]
        for name in ("sequential", "batched"):
            sec = r["times"][name]
            speed = f"{r['times']['sequential'] / sec:.2f}" if name == "batched" else ""
            print(f"{mp:11d} {f'{w}x{h}':>9} {r['n_img']:7d} {r['prompt']:6d} {name:>10} {sec:8.3f} "
                  f"{r['tokens']:7d} {r['tokens'] / sec:7.1f} {speed:>7} {str(r['same']):>5}")
    speedups = {mp: r["times"]["sequential"] / r["times"]["batched"] for mp, r in results}
    first = args.max_pixels[0]
    print(f"speedup at each size: {', '.join(f'{mp}: {s:.2f}x' for mp, s in speedups.items())}; "
          f"headline: max_pixels {first}" + (" (the library default)" if first == M.DEFAULT_MAX_PIXELS else ""))
    print(f"generate_batch_speedup: {speedups[first]:.2f}")


if __name__ == "__main__":
    main()
