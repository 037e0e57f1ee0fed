"""Benchmark: how fast the tiny random Qwen2.5-VL is on a CPU (generate, forward + backward).

    python bench/tiny_model.py                    # 5 repeats, one table, last line = headline
    python bench/tiny_model.py --repeats 20 --threads 1

The tiny model (`model.load_policy("tiny")`) is what every CPU test and smoke run trains, so its
speed sets how long they take; the target is "well under a second" for each of: one generate call
of 16 new tokens on one explore prompt (a 200x120 screenshot), and one forward + backward of that
prompt with its answer (the log-likelihood of the assistant tokens). Each is timed --repeats times
after a warm-up call (first-call overheads); the table shows the best, the median and the worst, so
a machine shared with other jobs shows up as a spread between them rather than as a slower model.
Headline: `tiny_model: generate_s B forward_backward_s B` (the best of each, in seconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import model as M  # noqa: E402
from model import encode_chat, explore_messages  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of each kind (after one warm-up)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each generate call makes")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    policy = M.load_policy("tiny", seed=0)
    image = Image.fromarray((np.random.RandomState(0).rand(120, 200, 3) * 255).astype("uint8"))
    msgs = explore_messages(image)
    M.generate(policy, [msgs], max_new_tokens=4)  # warm-up (first-call overheads)
    t_gen, t_bwd = [], []
    for _ in range(a.repeats):
        t = time.perf_counter()
        gen = M.generate(policy, [msgs], max_new_tokens=a.new_tokens)[0]
        t_gen.append(time.perf_counter() - t)
        enc = encode_chat(policy, msgs + [{"role": "assistant", "content": gen.ids}],
                          add_generation_prompt=False)
        t = time.perf_counter()
        ids = torch.tensor([enc.input_ids])  # (1, T)
        logits = policy.model(input_ids=ids, pixel_values=enc.pixel_values,
                              image_grid_thw=enc.image_grid_thw).logits  # (1, T, V)
        logits[0, :-1][torch.tensor(enc.target_mask[1:]).bool()].logsumexp(-1).sum().backward()
        t_bwd.append(time.perf_counter() - t)
        policy.model.zero_grad(set_to_none=True)

    print(f"tiny Qwen2.5-VL, {len(ids[0])} tokens with the answer, {torch.get_num_threads()} torch threads, "
          f"{a.repeats} repeats")
    print(f"{'':28s}{'best s':>10s}{'median s':>10s}{'worst s':>10s}")
    for name, ts in ((f"generate {a.new_tokens} tokens", t_gen), ("forward + backward", t_bwd)):
        print(f"{name:28s}{min(ts):>10.3f}{statistics.median(ts):>10.3f}{max(ts):>10.3f}")
    print(f"tiny_model: generate_s {min(t_gen):.3f} forward_backward_s {min(t_bwd):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
