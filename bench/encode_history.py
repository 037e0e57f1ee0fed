"""Benchmark: encoding ARPO's screenshot histories, each screenshot processed once vs every step.

    python bench/encode_history.py                 # 8 desktops x 15 screenshots, 1280x720, ~1 min
    python bench/encode_history.py --vms 4 --images 5

ARPO's prompt carries each desktop's last 15 screenshots, so every step re-encodes them all, and
the update encodes them once more. chat._process_images keeps the processed pixels of every live
screenshot (Policy.pixels), so a step only processes the screenshot that is new. Timed here with
model.encode_chats on the tiny model's processor (the processor does not depend on the model):
  - "every image processed": the first step of 8 histories, nothing cached (what every step cost
    before the cache);
  - "1 new image each": the next step, the histories one screenshot longer.
What is left in the second is the rest of encoding: concatenating the pixels of 15 screenshots per
prompt (22.5 MB each at 1280x720) and the tokens.
It prints both times and their ratio (docs/log.md has the runs).
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
from model import encode_chats, uitars_messages  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--images", type=int, default=15, help="screenshots per history (ARPO's --max-images)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rng = np.random.default_rng(0)

    def shot():
        return Image.fromarray(rng.integers(0, 255, (720, 1280, 3), dtype=np.uint8))

    policy = M.load_policy("tiny")
    hist = [[shot() for _ in range(args.images)] for _ in range(args.vms)]

    def encode() -> float:
        chats = [uitars_messages("Do it.", h[-args.images:], ["Thought: a\nAction: wait()"] * (len(h) - 1))
                 for h in hist]
        t = time.perf_counter()
        encode_chats(policy, chats)
        return time.perf_counter() - t

    cold = encode()
    for h in hist:  # the next step: one new screenshot per desktop
        h.append(shot())
    warm = encode()
    print(f"{args.vms} desktops x {args.images} screenshots (1280x720)")
    print(f"{'every image processed':>24} {cold:7.2f} s")
    print(f"{'1 new image each':>24} {warm:7.2f} s   {cold / warm:.1f}x")
    print(f"encode_history_speedup: {cold / warm:.2f}")


if __name__ == "__main__":
    main()
