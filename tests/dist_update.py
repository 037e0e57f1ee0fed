"""One GRPO update on a fixed batch, in one process or as one rank of torchrun (tests/test_dist.py).

    python tests/dist_update.py lora OUT.pt
    torchrun --nproc_per_node 2 tests/dist_update.py full OUT.pt

Every process builds the same tiny policy and the same 8 samples (4 groups of 2,
completions of 3 to 10 tokens, advantages (k % 3) - 0.7), takes its slice (dist.shard_range: 4 of
them on each of 2 ranks), makes one update_policy call per loss aggregation, each from the same start (one optimizer step, micro-batches of 2,
SGD at lr 0.1, so the weights move by exactly lr x the gradient, which Adam's per-weight
normalisation would blur), and rank 0 saves, per aggregation, the metrics and the trainable weights
after the step (FSDP2: gathered to full tensors) into OUT.pt.
"""
import os
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import dist  # noqa: E402
import grpo  # noqa: E402
from model import encode_chat, explore_messages  # noqa: E402
from model import load_policy  # noqa: E402


def samples(policy, n=8):
    out = []
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first_special = policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for k in range(n):
        rng = np.random.default_rng(k)
        img = Image.fromarray(rng.integers(0, 256, (56 + 8 * k, 84, 3), dtype=np.uint8))
        g = torch.Generator().manual_seed(k)
        completion = torch.randint(0, first_special, (3 + k,), generator=g).tolist() + [im_end]
        s = grpo.step_sample(encode_chat(policy, explore_messages(img)), completion, group=k // 2)
        s.advantage = (k % 3) - 0.7
        out.append(s)
    return out


def update(mode: str, agg: str) -> dict:
    torch.manual_seed(0)  # the LoRA adapter's random init: the same on every rank
    policy = load_policy("tiny", lora_rank=4 if mode == "lora" else 0, seed=0)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    batch = samples(policy)
    mine = [batch[k] for k in dist.shard_range(len(batch))]
    dist.spread(policy.model, shard=mode == "full")
    opt = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=0.1)
    m = grpo.update_policy(policy, opt, mine, micro_batch_size=2, agg=agg, max_grad_norm=1e9)
    sd = dist.full_state_dict(policy.model)
    return {"metrics": m, "before": before, "weights": {k: v.detach().clone() for k, v in sd.items() if k in before}}


def main(mode: str, out: str) -> None:
    dist.init()
    result = {agg: update(mode, agg) for agg in ("seq-mean-token-mean", "token-mean")}
    if dist.is_main():
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
