"""Benchmark: one batched generate call for N prompts vs N one-prompt calls (model.generate).

    python bench/generate.py                       # 8 prompts, 128 new tokens, both image sizes
    python bench/generate.py --n 16 --max-new-tokens 64 --max-pixels 1003520
    python bench/generate.py --threads 1           # steadier on a machine shared with other jobs

The workload is a ScreenExplorer step: N exploration prompts, each with its own 1280x720
screenshot (random pixels), resized under --max-pixels, and train_explore's 128-token answer cap.
By default two sizes, one table row pair each: the library default 1280*28*28 (the full 1288x728
-> 1,196 image tokens, what a run uses unless told otherwise) and 256*28*28 (588x336 -> 252 image
tokens, a common way to save compute). The headline (last line) is the speedup at the FIRST size
given, i.e. the library default. Tiny random Qwen2.5-VL on CPU. Greedy decoding, so both ways
produce the SAME tokens (checked) and the token counts are equal; the random model rarely stops
early, so nearly every prompt runs the full --max-new-tokens. Each way is also timed with ONE new
token ("prefill": image processing, vision tower, prompt forward); "decode" is the rest.

Why batching wins, and where it cannot: a decode step of a small model costs about the same for
1 row as for 8 (Python and kernel-launch overhead, not arithmetic), so N sequential calls pay N
times the steps; the decode column shows that. The prefill is per-image arithmetic that does not
batch away: the tiny tower's full-attention block over 4,784 patches and the image processor cost
the same in both ways. So the end-to-end speedup shrinks as images grow, and the script prints its
ceiling (sequential time / batched prefill time). Two things keep the batched prefill small: the
screenshots are processed in parallel threads (model.encode_chats) and the vision tower attends
all windows of one length in one call (qwen_vl.py).
Batching wins most in the decode; end to end the gain shrinks as screenshots grow, since the
batched prefill does as much work as the sequential ones (the printed ceiling; docs/log.md).
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
from actions import MAX_PIXELS  # noqa: E402
from model import encode_chat, explore_messages  # noqa: E402


def measure(args, max_pixels: int, shots: list) -> dict:
    """Best-of-`repeats` seconds for both ways at one image size, plus what they produced."""
    policy = M.load_policy("tiny", max_pixels=max_pixels)
    prompts = [explore_messages(s) for s in shots]
    enc = encode_chat(policy, prompts[0])

    def batched(n=args.max_new_tokens):
        return M.generate(policy, prompts, max_new_tokens=n, temperature=0)

    def sequential(n=args.max_new_tokens):
        return [M.generate(policy, [p], max_new_tokens=n, temperature=0)[0] for p in prompts]

    batched(), sequential()  # warm-up: first-call allocations, lazy imports
    # The two ways alternate within each repeat, so a burst of load from elsewhere on a shared
    # machine hits both alike; the best time of each is kept. "prefill" = the same calls with ONE
    # new token: image processing, vision tower and prompt forward, which is per-image work.
    times, outs = {k: float("inf") for k in ("sequential", "batched", "sequential prefill", "batched prefill")}, {}
    for _ in range(args.repeats):
        for name, fn in [("sequential", sequential), ("batched", batched)]:
            t = time.perf_counter()
            outs[name] = fn()
            times[name] = min(times[name], time.perf_counter() - t)
            t = time.perf_counter()
            fn(1)
            times[name + " prefill"] = min(times[name + " prefill"], time.perf_counter() - t)
    return dict(
        times=times, size=enc.image_sizes[0], prompt=len(enc.input_ids),
        n_img=enc.input_ids.count(policy.model.config.image_token_id),
        same=all(a.ids == b.ids for a, b in zip(outs["sequential"], outs["batched"])),
        tokens=sum(len(g.ids) for g in outs["batched"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8, help="prompts (one screenshot each)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="train_explore's default (the paper's 128)")
    ap.add_argument("--max-pixels", type=int, nargs="+", default=[MAX_PIXELS, 256 * 28 * 28],
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
          f"{'prefill':>7} {'decode':>7} {'new tok':>7} {'tok/s':>7} {'speedup':>7} {'decode x':>8} {'same':>5}")
    for mp, r in results:
        w, h, t = *r["size"], r["times"]
        for name in ("sequential", "batched"):
            sec, pre = t[name], t[name + " prefill"]
            speed = f"{t['sequential'] / sec:.2f}" if name == "batched" else ""
            dec = f"{(t['sequential'] - t['sequential prefill']) / (sec - pre):.2f}" if name == "batched" else ""
            print(f"{mp:11d} {f'{w}x{h}':>9} {r['n_img']:7d} {r['prompt']:6d} {name:>10} {sec:8.3f} "
                  f"{pre:7.3f} {sec - pre:7.3f} {r['tokens']:7d} {r['tokens'] / sec:7.1f} {speed:>7} {dec:>8} "
                  f"{str(r['same']):>5}")
    speedups = {mp: r["times"]["sequential"] / r["times"]["batched"] for mp, r in results}
    first, t = args.max_pixels[0], results[0][1]["times"]
    # Amdahl: the prefill is per-image arithmetic that batching cannot remove. Even a decode that
    # cost nothing in the batched call would leave it; this is the most any batching could give.
    bound = t["sequential"] / t["batched prefill"]
    print(f"speedup at each size: {', '.join(f'{mp}: {s:.2f}x' for mp, s in speedups.items())}; "
          f"headline: max_pixels {first}" + (" (the library default)" if first == MAX_PIXELS else ""))
    print(f"at {first}: the batched prefill alone takes {t['batched prefill']:.3f} s, so no batching can beat "
          f"{bound:.2f}x end to end there; the decode phase alone is "
          f"{(t['sequential'] - t['sequential prefill']) / (t['batched'] - t['batched prefill']):.2f}x")
    print(f"generate_batch_speedup: {speedups[first]:.2f}")


if __name__ == "__main__":
    main()
