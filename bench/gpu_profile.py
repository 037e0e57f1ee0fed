"""Where does one GRPO update of Qwen2.5-VL-3B spend its time? (GPU; companion of gpu_update.py)

    python bench/gpu_profile.py              # H100/H200: ~1 min
    python bench/gpu_profile.py --dry-run    # CPU, tiny model: only tests the script

Same workload as bench/gpu_update.py (8 samples = exploration prompt + one 1280x720 screenshot +
128 completion tokens, full fine-tuning, gradient checkpointing). Prints the time of the pieces
side by side (vision tower forward alone, a no-grad log-prob pass, the whole update), then the
operators with the most GPU and CPU self time from torch.profiler over one update. A GPU that is
idle while the CPU works shows up as CPU-side operators (Python loops, host syncs) whose self time
rivals the kernels'. Last line: `gpu_update_share_vision_fwd: <vision forward / update>`.

With transformers' stock vision attention (one call per window) the GPU waits on Python
launching tiny attention calls; with qwen_vl.install_vision_windows (what wrap_policy installs) the
update is GPU-bound, its top kernels the matmuls (docs/log.md has the H200 numbers).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_update as G  # noqa: E402
import grpo  # noqa: E402
import model as M  # noqa: E402


def timed(fn, sync, reps=2):
    """Median wall seconds of fn() over reps runs, after one warm-up."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, to test this script")
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    if args.dry_run:
        policy = M.load_policy("tiny", device="cpu", gradient_checkpointing=True, max_pixels=64 * 28 * 28)
    else:
        policy = G.build_3b(0, "cuda")
    cuda = policy.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    samples = G.make_samples(policy, 8, 128)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-6)
    base = policy.model
    pix = torch.cat([s.pixel_values for s in samples]).to(policy.device, policy.dtype)  # (N_patches, 1176)
    thw = torch.cat([s.image_grid_thw for s in samples]).to(policy.device)              # (8, 3)

    def vision():
        with torch.no_grad():
            base.model.visual(pix, grid_thw=thw)

    def logps():
        with torch.no_grad():
            for mb in grpo.micro_batches(samples, args.micro_batch):
                grpo.per_token_logps(base, grpo.collate(mb, policy.tokenizer.pad_token_id))

    def update():
        grpo.update_policy(policy, opt, samples, micro_batch_size=args.micro_batch)

    t_vis, t_lp, t_up = timed(vision, sync), timed(logps, sync), timed(update, sync)
    print(f"{'piece':<38} {'seconds':>8} {'share of update':>16}")
    for name, t in [("vision tower forward (8 images)", t_vis), ("log-prob pass, no grad", t_lp),
                    ("whole update (fwd + recompute + bwd + step)", t_up)]:
        print(f"{name:<38} {t:8.3f} {t / t_up:16.1%}")

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        update()
        sync()
    ka = prof.key_averages()
    if cuda:
        print("\ntop operators by GPU self time:")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print("\ntop operators by CPU self time:")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    print(f"gpu_update_share_vision_fwd: {t_vis / t_up:.3f}")


if __name__ == "__main__":
    main()
