"""Benchmark: grpo.per_token_logps vs the naive full-vocabulary log_softmax, peak memory and time.

    python bench/logprobs.py                 # both modes, table, last line = headline ratio
    python bench/logprobs.py --mode forward  # only no-grad scoring (old / reference log-probs)

The workload is one ARPO-style sample: a UI-TARS prompt with three 1280x720 screenshots
(3 x 1,196 image tokens) plus text, ~3,980 prompt tokens, and 128 completion tokens. The model is
the tiny random Qwen2.5-VL with the REAL vocabulary size, 151,936, so the logits are as large as
a real 3B/7B model's while the body costs almost nothing: what differs is only the vocabulary
projection and the softmax, which is the point.

naive = what ScreenExplorer's code does: logits for every position (T x V floats), a log_softmax
over all of them, gather the chosen tokens, mask. ours = grpo.per_token_logps: lm_head only at the
128 positions that predict completion tokens, logsumexp in row chunks.

How memory is measured, and why this way: torch's CPU allocations are invisible to tracemalloc,
and a process's max RSS is a high-water mark that the model loading may already have set. So
every variant runs in a FRESH subprocess which loads the model, runs the variant once (warm-up),
then resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), reads
the current RSS, runs the variant again and reports VmHWM - RSS_before: the extra resident memory
at the worst moment of the call, allocator and all. Large torch CPU tensors are mmap'ed and given
back on free, so this sees them. Where clear_refs is not allowed the script falls back to
ru_maxrss minus the RSS before (it says so), which can only under-count the naive variant.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N_IMAGES, N_COMPLETION, VOCAB = 3, 128, 151_936


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def naive_logps(model, batch):
    """Full (B, T, V) logits, log_softmax over all of them, gather, mask."""
    ids = batch["input_ids"]  # (B, T)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"],
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                   mm_token_type_ids=(ids == model.config.image_token_id).int()).logits  # (B, T, V)
    logps = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    picked = logps[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return torch.nn.functional.pad(picked, (1, 0)) * batch["target_mask"]  # (B, T)


def child(variant: str, mode: str) -> dict:
    """Runs in its own process: build, warm up, measure one call."""
    import grpo
    import model as M
    from model import encode_chat, uitars_messages
    from PIL import Image

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    policy = M.load_policy("tiny", vocab_size=VOCAB, seed=0)
    net = policy.model.train() if mode == "train" else policy.model.eval()
    shots = [Image.new("RGB", (1280, 720), (40 * i, 90, 200)) for i in range(N_IMAGES)]
    answer = "Thought: I open the calculator from the desktop.\nAction: left_double(start_box='(40,120)')"
    prompt = encode_chat(policy, uitars_messages("Open the calculator and compute 12 * 34.", shots,
                                                 [answer] * (N_IMAGES - 1)))
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, 700, (N_COMPLETION,), generator=g).tolist()
    batch = grpo.collate([grpo.step_sample(prompt, completion)], pad_id=policy.tokenizer.pad_token_id)
    fn = grpo.per_token_logps if variant == "ours" else naive_logps

    def run():
        if mode == "train":
            net.zero_grad(set_to_none=True)
            out = fn(net, batch)  # (1, T)
            out.sum().backward()  # what the GRPO loss does with them
        else:
            with torch.no_grad():
                out = fn(net, batch)  # (1, T)
        return float(out.detach().sum())

    run()  # warm-up: first-call allocations and lazy inits are not what we measure
    net.zero_grad(set_to_none=True)
    gc.collect()
    exact = _reset_peak()
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    checksum = run()
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "mode": mode, "peak_mb": max(0, peak_kb - rss0) / 1024, "seconds": seconds,
            "checksum": checksum, "tokens": int(batch["input_ids"].shape[1]), "exact_peak": exact}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["both", "forward", "train"], default="both",
                    help="forward = no-grad scoring; train = forward + backward of the log-probs")
    ap.add_argument("--child", choices=["ours", "naive"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mode)))
        return
    modes = ["forward", "train"] if args.mode == "both" else [args.mode]
    rows = {}
    for mode in modes:
        for variant in ("naive", "ours"):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, "--mode", mode],
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"The {variant}/{mode} run failed (exit {p.returncode}; out of memory?): "
                         f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'no message'}")
            rows[mode, variant] = json.loads(p.stdout.strip().splitlines()[-1])
    r0 = next(iter(rows.values()))
    print(f"one sample: {r0['tokens']} tokens ({r0['tokens'] - N_COMPLETION} prompt incl. {N_IMAGES} "
          f"screenshots, {N_COMPLETION} completion), vocab {VOCAB}, tiny Qwen2.5-VL, fp32 CPU, "
          f"peak = {'VmHWM after clear_refs' if r0['exact_peak'] else 'ru_maxrss (fallback)'} minus RSS before")
    print(f"{'mode':8} {'variant':16} {'peak MB':>10} {'seconds':>9} {'sum of logps':>14}")
    ratios = {}
    for mode in modes:
        n, o = rows[mode, "naive"], rows[mode, "ours"]
        for name, r in (("naive", n), ("per_token_logps", o)):
            print(f"{mode:8} {name:16} {r['peak_mb']:10.1f} {r['seconds']:9.3f} {r['checksum']:14.4f}")
        if abs(n["checksum"] - o["checksum"]) > 1e-3 * max(1.0, abs(n["checksum"])):
            sys.exit(f"The two variants disagree ({n['checksum']} vs {o['checksum']}); per_token_logps is wrong.")
        ratios[mode] = (o["peak_mb"] / max(n["peak_mb"], 1e-9), o["seconds"] / max(n["seconds"], 1e-9))
        print(f"{mode:8} {'ours / naive':16} {ratios[mode][0]:10.4f} {ratios[mode][1]:9.3f}")
    # The headline is the worse (larger) of the measured memory ratios.
    print(f"logprobs_peak_mem_ratio: {max(r[0] for r in ratios.values()):.4f}")


if __name__ == "__main__":
    main()
