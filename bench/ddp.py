"""Update throughput with 1 process vs 2 ranks (torchrun, gloo on this CPU) on the same global batch.

    python bench/ddp.py                      # LoRA (gradients all-reduced) and full fine-tuning (FSDP2)
    python bench/ddp.py --samples 16 --steps 3

Both runs make `--steps` update_policy calls on the same `--samples` samples of the tiny
Qwen2.5-VL (tests/dist_update.py's batch, one optimizer step each): one process takes all of
them, each of 2 ranks half. Printed: seconds per update (the median of the steps after a warm-up
one), samples per second, and the ratio. On a 2-core CPU the two ranks share the cores the one
process had to itself (torchrun gives each OMP_NUM_THREADS=1), so the ratio measures the overhead
of the collectives more than a speed-up; on GPUs each rank has its own device. (The GPU half of
this bench, memory per rank of the 3B update under FSDP2 vs data parallel, is not written:
no GPU was lent to the session that wrote this.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def worker(mode: str, n: int, steps: int, out: str) -> None:
    """One process or one rank: `steps` updates of its share of n samples; rank 0 writes the times."""
    import torch

    from plumbing import dist
    import grpo
    from dist_update import samples
    from model import load_policy
    dist.init()
    torch.manual_seed(0)
    policy = load_policy("tiny", lora_rank=4 if mode == "lora" else 0, seed=0)
    batch = samples(policy, n)
    mine = [batch[k] for k in dist.shard_range(n)]
    dist.spread(policy.model, shard=mode == "full")
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        grpo.update_policy(policy, opt, mine, micro_batch_size=2)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(times[1:], f)  # the first update warms up allocators and thread pools


def measure(mode: str, ranks: int, n: int, steps: int) -> float:
    out = tempfile.mktemp(suffix=".json")
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable]
    subprocess.run([*head, __file__, "--worker", mode, "--samples", str(n), "--steps", str(steps), "--out", out],
                   cwd=ROOT, check=True, capture_output=True)
    with open(out) as f:
        return statistics.median(json.load(f))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.samples, a.steps, a.out)
    print(f"update_policy on {a.samples} samples of the tiny Qwen2.5-VL, median of {a.steps} updates")
    print(f"{'mode':6s} {'1 process s':>12s} {'2 ranks s':>10s} {'1p samples/s':>13s} {'2r samples/s':>13s} {'2r / 1p':>8s}")
    for mode in ("lora", "full"):
        one, two = measure(mode, 1, a.samples, a.steps), measure(mode, 2, a.samples, a.steps)
        print(f"{mode:6s} {one:12.3f} {two:10.3f} {a.samples / one:13.1f} {a.samples / two:13.1f} {one / two:8.2f}")


if __name__ == "__main__":
    main()
