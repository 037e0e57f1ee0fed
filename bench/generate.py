"""Benchmark: one batched generate call for N prompts vs N one-prompt calls (model.generate).

    python bench/generate.py                       # 8 prompts, 64 new tokens, table + headline
    python bench/generate.py --n 16 --max-new-tokens 128 --max-pixels 1003520

The workload is a ScreenExplorer step: N exploration prompts, each with its own 1280x720
screenshot (random pixels), resized under --max-pixels (default 256*28*28: 588x336 -> 252 image
tokens; the library default, 1280*28*28, keeps the full 1288x728 -> 1196 tokens).
Tiny random Qwen2.5-VL on CPU. Greedy decoding, so both ways produce the SAME tokens (checked)
and the token counts are equal; the random model rarely stops early, so nearly every prompt
runs the full --max-new-tokens.

Why batching wins: a decode step of a small model costs about the same for 1 row as for 8 (it
is Python + kernel-launch overhead, not arithmetic), so N sequential calls pay N times the steps.
The prefill (vision tower + prompt) is real arithmetic and does not batch for free, which is why
the speedup shrinks as images grow (try --max-pixels 1003520).
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8, help="prompts (one screenshot each)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=256 * 28 * 28, help="image size cap")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each way; the best is kept")
    args = ap.parse_args()

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    policy = M.load_policy("tiny", max_pixels=args.max_pixels)
    rng = np.random.RandomState(0)
    shots = [Image.fromarray((rng.rand(720, 1280, 3) * 255).astype("uint8")) for _ in range(args.n)]
    prompts = [M.explore_messages(s) for s in shots]
    enc = M.encode_chat(policy, prompts[0])
    n_img = enc.input_ids.count(policy.model.config.image_token_id)

    def batched():
        return M.generate(policy, prompts, max_new_tokens=args.max_new_tokens, temperature=0)

    def sequential():
        return [M.generate(policy, [p], max_new_tokens=args.max_new_tokens, temperature=0)[0] for p in prompts]

    batched(), sequential()  # warm-up: first-call allocations, lazy imports
    times, outs = {}, {}
    for name, fn in [("sequential", sequential), ("batched", batched)]:
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs[name] = fn()
            best = min(best, time.perf_counter() - t)
        times[name] = best
    same = all(a.completion_ids == b.completion_ids for a, b in zip(outs["sequential"], outs["batched"]))
    tokens = sum(len(g.completion_ids) for g in outs["batched"])

    w, h = enc.image_sizes[0]
    print(f"{args.n} prompts, 1280x720 screenshot -> {w}x{h} ({n_img} image tokens), "
          f"prompt {len(enc.input_ids)} tokens, {args.max_new_tokens} new tokens max, greedy, "
          f"{torch.get_num_threads()} threads")
    print(f"{'way':12} {'seconds':>9} {'new tokens':>11} {'tokens/s':>9}")
    for name in ("sequential", "batched"):
        print(f"{name:12} {times[name]:9.3f} {tokens:11d} {tokens / times[name]:9.1f}")
    print(f"same tokens both ways: {same}")
    print(f"generate_batch_speedup: {times['sequential'] / times['batched']:.2f}")


if __name__ == "__main__":
    main()
