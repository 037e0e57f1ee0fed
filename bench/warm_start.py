"""Benchmark: the warm-started tiny models (`--model tiny-uitars`, `tiny-explore`): build time,
format rate at temperature 1 on real desktop screenshots, and where their clicks land.

    python bench/warm_start.py                 # builds both into a fresh cache, then samples 4 x 96 answers
    python bench/warm_start.py --samples 192   # more answers per row (tighter rates)

Each model is built from scratch into a temporary cache ($WARM_START_CACHE), timed (the first
load_policy: the warm start plus the save and the load), then sampled at temperature 1 (the
trainers' default) on screenshots of one real local desktop (vm_server.py --xvfb, started here):
the reset desktop and the same with a terminal and a calculator open. One row per model and pixel
cap: full size (actions.MAX_PIXELS: 1280x720 -> 1288x728, 1,196 image tokens) and the small size
of the CPU benchmarks (12544: 140x84, 15 tokens). Columns: the share of answers that parse
(actions.parse_action), and how the parsed points spread over the screen: the share in each
quarter of the width and of the height (uniform would be 0.25 each). Last line per model:
`warm_start <name>: build <s> s (<CPU-s>, load <1-min load average>) format <full> / <small>`;
the CPU seconds (all threads) say more than the wall time on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import model as M  # noqa: E402
from actions import MAX_PIXELS, parse_action  # noqa: E402
from model import explore_messages, uitars_messages  # noqa: E402
from env import VMPool  # noqa: E402

STYLE = {"tiny-uitars": "uitars", "tiny-explore": "explore"}
TASKS = ("Open the calculator.", "Save the file as notes.txt in the home folder.", "Show the clock.",
         "Find the file manager and open the Documents folder.")


def real_screens() -> list:
    """Three screenshots of one real desktop: reset, a terminal open, a calculator open too."""
    with VMPool(1, timeout=60) as pool:
        pool.reset()
        shots = [pool.screenshots()[0].value]
        for argv in (["xterm"], ["xcalc"]):
            pool.map("setup", [[{"type": "launch", "argv": argv}]])  # answers once the window is up and drawn
            shots.append(pool.screenshots()[0].value)
    return shots


def sample(policy, style: str, screens: list, n: int, max_pixels: int) -> dict:
    """n answers at temperature 1 at this pixel cap: format rate and the quarters the points fall in."""
    from dataclasses import replace
    p = replace(policy, image_processor=M.qwen_image_processor(M.MIN_PIXELS, max_pixels), pixels={})
    shots = [screens[i % len(screens)] for i in range(n)]
    prompts = [explore_messages(s) if style == "explore" else uitars_messages(TASKS[i % len(TASKS)], [s], [])
               for i, s in enumerate(shots)]
    torch.manual_seed(0)
    gens = []
    for i in range(0, n, 16):  # batches of 16: bounded memory at full size
        gens += M.generate(p, prompts[i:i + 16], max_new_tokens=128, temperature=1.0)
    parsed = [parse_action(g.text, style, s.size, g.prompt.image_sizes[0]) for g, s in zip(gens, shots)]
    pts = [(a.action.x / s.size[0], a.action.y / s.size[1]) for a, s in zip(parsed, shots)
           if a is not None and a.action.x is not None]

    def quarters(vals):
        return [sum(min(int(v * 4), 3) == q for v in vals) / max(1, len(vals)) for q in range(4)]
    return {"format": sum(a is not None for a in parsed) / n, "points": len(pts),
            "x": quarters([x for x, _ in pts]), "y": quarters([y for _, y in pts]),
            "bad": [g.text[:100] for g, a in zip(gens, parsed) if a is None][:2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=96, help="answers per model and pixel cap")
    ap.add_argument("--models", default="tiny-explore,tiny-uitars")
    ap.add_argument("--cache", default="", help="the warm-start cache to build into (default: a new temp folder)")
    a = ap.parse_args()
    os.environ["WARM_START_CACHE"] = a.cache or tempfile.mkdtemp(prefix="warm-start-bench-")
    screens = real_screens()
    print(f"cache {os.environ['WARM_START_CACHE']}; {len(screens)} real screenshots {screens[0].size}; "
          f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':13} {'max_pixels':>10} {'format':>6} {'x quarters':>23} {'y quarters':>23}")
    for name in a.models.split(","):
        t, cpu = time.perf_counter(), time.process_time()
        policy = M.load_policy(name)
        build, cpu = time.perf_counter() - t, time.process_time() - cpu  # wall, and CPU of all threads
        rates = []
        for cap in (MAX_PIXELS, 12544):
            r = sample(policy, STYLE[name], screens, a.samples, cap)
            rates.append(r["format"])
            q = lambda v: " ".join(f"{x:.2f}" for x in v)  # noqa: E731
            print(f"{name:13} {cap:>10} {r['format']:>6.2f} {q(r['x']):>23} {q(r['y']):>23}  e.g. failed: {r['bad']}")
        print(f"warm_start {name}: build {build:.0f} s ({cpu:.0f} CPU-s, load {os.getloadavg()[0]:.1f}) "
              f"format {rates[0]:.2f} / {rates[1]:.2f} "
              f"(full size / 140x84, T=1, {a.samples} answers each)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
