"""The weights a vLLM sync hands over under FSDP2, on every rank (tests/test_vllm_engine.py).

    torchrun --nproc_per_node 2 tests/dist_weights.py OUT_DIR

Each rank builds the same tiny policy for full fine-tuning, shards it with FSDP2 (dist.spread),
streams model.merged_weights(..., every_rank=True) in bf16 and saves what it got, and whether the
model was sharded, into OUT_DIR/rank<r>.pt.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import dist  # noqa: E402
from model import load_policy, merged_weights  # noqa: E402

if __name__ == "__main__":
    dist.init()
    policy = load_policy("tiny", seed=0)
    dist.spread(policy.model, shard=True)
    weights = {k: v.detach().clone() for k, v in merged_weights(policy, torch.bfloat16, every_rank=True)}
    torch.save({"sharded": dist.is_sharded(policy.model), "weights": weights},
               os.path.join(sys.argv[1], f"rank{dist.rank()}.pt"))
    dist.barrier()
