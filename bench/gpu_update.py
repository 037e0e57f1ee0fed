"""GPU benchmark: one GRPO update of a Qwen2.5-VL-3B (random weights, built from its config).

    python bench/gpu_update.py                 # H100/H200, bf16, full fine-tuning, ~1-2 min
    python bench/gpu_update.py --lora-rank 64  # LoRA r=64 on the language model instead
    python bench/gpu_update.py --dry-run       # CPU: the same code path on the tiny model
                                               # (with small screenshots), only to test the script

Nothing is downloaded: the config below is Qwen/Qwen2.5-VL-3B-Instruct's (36 layers, hidden
2048, 16 heads / 2 KV heads, MLP 11008, vocab 151,936, tied embeddings; vision tower 32 blocks of
1280, window attention with full attention at blocks 7/15/23/31), the weights are random and the
token ids come from the tiny local tokenizer (the compute does not depend on which ids they are).

Workload: 8 ScreenExplorer samples, each = exploration prompt + one 1280x720 screenshot
(1288x728 after resizing: 4,784 patches -> 1,196 image tokens) + 128 completion tokens, with
advantages of +-1. One update = grpo.update_policy (the on-policy single step: forward, clipped
loss, backward, grad clip, AdamW step) over micro-batches of --micro-batch samples, gradient
checkpointing on. A warm-up update, then --steps timed ones.

Reported: tokens/s (all sequence tokens, prompt + image + completion, per second of update),
peak GPU memory, and MFU = model FLOPs / time / peak, with
    model FLOPs = 6 * N_lm * tokens + 6 * N_vision * patches     (full fine-tuning)
    N_lm = language-model parameters incl. the (tied) output projection, N_vision = vision tower
    peak = 989e12 (H100/H200 dense bf16)
i.e. 2N forward + 4N backward per token. Gradient checkpointing's recomputed forward and the
attention's T^2 term are not counted (the usual convention, so MFU is a lower bound on hardware
use). With LoRA the frozen weights get no weight gradients and the vision tower no backward, so
the same 6N formula overstates the work there; it is still printed, for comparison.
It times the project's own grpo.update_policy and nothing else: if that fails, the run fails with
its traceback (a number from some other code would measure nothing we ship).

It prints seconds per update, tokens per second, peak memory and MFU for full fine-tuning and
LoRA (docs/log.md has the H200 runs, with and without the batched vision windows).
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
import grpo  # noqa: E402
import model as M  # noqa: E402
from model import encode_chat, explore_messages  # noqa: E402
from qwen_vl import SPECIAL_TOKENS  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM dense bf16

QWEN25_VL_3B = dict(
    text_config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
        rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False, sliding_window=32768,
        max_window_layers=70, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
    ),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
        out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu",
    ),
    tie_word_embeddings=True,
)


def build_3b(lora_rank: int, device: str):
    """Qwen2.5-VL-3B with random bf16 weights, created directly on the GPU (seconds, no CPU copy)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    tok = M.build_tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        **QWEN25_VL_3B, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    ip = M.qwen_image_processor()
    return M.wrap_policy(model, tok, ip, "qwen2.5-vl-3b-random", device, torch.bfloat16,
                         lora_rank=lora_rank, gradient_checkpointing=True)


def make_samples(policy, n: int, completion: int):
    """n (prompt + screenshot + completion) samples with advantages alternating +1 / -1."""
    rng = np.random.RandomState(0)
    vocab = policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")  # ids below are plain text tokens
    samples = []
    for i in range(n):
        shot = Image.fromarray((rng.rand(720, 1280, 3) * 255).astype("uint8"))
        prompt = encode_chat(policy, explore_messages(shot))
        done = rng.randint(0, vocab, size=completion - 1).tolist() + [policy.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        s = grpo.step_sample(prompt, done, reward=float(i % 2))
        s.advantage = 1.0 if i % 2 else -1.0
        samples.append(s)
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tuning (default)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--completion", type=int, default=128, help="completion tokens per sample")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per forward/backward")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, to test this script")
    args = ap.parse_args()

    if args.dry_run:
        # Small screenshots (~64 image tokens) keep the CPU run to seconds; the code path is the same.
        policy = M.load_policy("tiny", device="cpu", lora_rank=args.lora_rank, gradient_checkpointing=True,
                               max_pixels=64 * 28 * 28)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("No CUDA device: run on a GPU machine, or pass --dry-run to test on CPU.")
        policy = build_3b(args.lora_rank, "cuda")
    base = policy.model.get_base_model() if policy.lora else policy.model
    n_vis = sum(p.numel() for p in base.model.visual.parameters())
    n_all = sum(p.numel() for p in base.parameters())  # tied embedding counted once
    n_lm = n_all - n_vis
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    lr = 4e-5 if policy.lora else 1e-6  # the papers' learning rates (ScreenExplorer LoRA / ARPO full)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)

    samples = make_samples(policy, args.samples, args.completion)
    tokens = sum(len(s.input_ids) for s in samples)
    patches = sum(int(s.image_grid_thw.prod(-1).sum()) for s in samples)
    flops = 6 * n_lm * tokens + 6 * n_vis * patches

    cuda = policy.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    metrics = grpo.update_policy(policy, optimizer, samples, micro_batch_size=args.micro_batch)  # warm-up: allocator, kernels
    sync()
    warm = time.perf_counter() - t
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        metrics = grpo.update_policy(policy, optimizer, samples, micro_batch_size=args.micro_batch)
        sync()
        times.append(time.perf_counter() - t)
    sec = sorted(times)[len(times) // 2]  # median
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    mfu = flops / sec / PEAK_BF16_FLOPS

    mode = f"LoRA r={args.lora_rank}" if policy.lora else "full fine-tuning"
    print(f"model {policy.name}: {n_all / 1e9:.3f}B params (language {n_lm / 1e9:.3f}B, vision {n_vis / 1e9:.3f}B), "
          f"{sum(p.numel() for p in trainable) / 1e6:.1f}M trainable, {mode}, {policy.dtype}, gradient checkpointing")
    print(f"update: {args.samples} samples, {tokens} tokens ({tokens // args.samples}/sample, "
          f"{args.completion} completion), {patches} vision patches, micro-batch {args.micro_batch}")
    print(f"warm-up {warm:.2f}s; timed updates (s): {' '.join(f'{x:.3f}' for x in times)}")
    print(f"{'seconds/update':>16} {'tokens/s':>10} {'peak GB':>8} {'TFLOP/update':>13} {'MFU':>6}")
    print(f"{sec:16.3f} {tokens / sec:10.0f} {peak_gb:8.1f} {flops / 1e12:13.1f} {mfu:6.1%}")
    print(f"update: grpo.update_policy; MFU = (6*N_lm*tokens + 6*N_vision*patches) / seconds / {PEAK_BF16_FLOPS:.3g}; loss {metrics.get('loss', float('nan')):.4f}")
    print(f"gpu_update_tokens_per_s: {tokens / sec:.0f}")


if __name__ == "__main__":
    main()
