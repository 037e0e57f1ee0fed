"""plumbing/dist.py: the few torch.distributed calls the trainers make, and what they are in one process.

    python train_arpo.py ...                                  # world size 1: no process group at all
    torchrun --nproc_per_node 2 train_arpo.py ...             # 2 ranks (gloo on CPU, nccl on GPUs)
    torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:29500 --nproc_per_node 8 train_arpo.py ...

    from plumbing import dist
    rank, world = dist.init()          # reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    dist.all_sum([loss, tokens])       # the same floats summed over ranks ([loss, tokens] itself at world 1)
    dist.gather(obj)                   # [obj of rank 0, obj of rank 1, ...] on every rank
    dist.cat(rewards)                  # every rank's tensor in rank order, and this rank's slice of it
    dist.sync_grads(params)            # data parallel: every rank's gradients summed, on every rank
    dist.fsdp(model)                   # FSDP2 (fully_shard) over the decoder layers and vision blocks

Every function works at world size 1 without a process group (and without torchrun), so a plain
`python train_*.py` runs exactly the single-process code. Data parallel: every rank holds the whole
model and its own slice of the VMs; the losses are normalised by the GLOBAL count of sequences or
tokens (grpo.update_policy all-sums them first), so summing the ranks' gradients gives the gradient
one process would compute on the whole batch. With LoRA the trainable weights are small and are
summed directly once per optimizer step (what DDP's bucketed all-reduce does, without its forward
wrapper: the ranks accumulate different numbers of micro-batches per step, which DDP would need
Join for). Full fine-tuning shards parameters, gradients and optimizer state with FSDP2.
"""
from __future__ import annotations

import atexit
import contextlib
import os

import torch
import torch.distributed as td


def init() -> tuple[int, int]:
    """Join torchrun's process group (if launched by torchrun with more than one process).
    -> (rank, world size). On a GPU machine each rank takes the GPU of its LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not td.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        td.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        # Leave the group before the interpreter tears down: a gloo group left to the teardown can
        # abort its rank after the work is done ("terminate called without an active exception",
        # SIGABRT; seen once in the suite, tests/test_dist.py), which torchrun reports as a failure.
        atexit.register(_leave)
    return rank(), size()


def _leave() -> None:
    if td.is_initialized():
        td.destroy_process_group()


def size() -> int:
    return td.get_world_size() if td.is_initialized() else 1


def rank() -> int:
    return td.get_rank() if td.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """The device the collectives run on: this rank's GPU under nccl, the CPU under gloo."""
    if td.is_initialized() and td.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[float]) -> list[float]:
    """The same list of numbers on every rank, summed over ranks (float64, so counts stay exact)."""
    if size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device())  # (K,)
    td.all_reduce(t)
    return t.tolist()


def gather(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if size() == 1:
        return [obj]
    out = [None] * size()
    td.all_gather_object(out, obj)
    return out


def every(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (one process: the list itself)."""
    return list(items) if size() == 1 else [x for part in gather(list(items)) for x in part]


def share(n: int) -> tuple[range, int]:
    """This rank owns n things (groups) of a numbering over all ranks, in rank order. -> (the range
    of this rank's numbers, the count over all ranks); one process: (range(n), n)."""
    counts = gather(int(n)) if size() > 1 else [int(n)]
    first = sum(counts[:rank()])
    return range(first, first + counts[rank()]), sum(counts)


def every_rows(rows, items: list, make) -> tuple:
    """Every rank's rows of a record of tensors (`rows`: a dataclass whose tensor fields share their
    first dimension, or None for no rows) and their items, in rank order, and this rank's slice of
    them: -> (make(**joined fields) or None, items, slice). One process: its own, as they are."""
    if size() == 1:
        return rows, list(items), slice(0, len(items))
    parts = gather((rows, list(items)))
    start = sum(len(its) for _, its in parts[:rank()])
    have = [p for p, its in parts if its]
    if not have:
        return None, [], slice(0, 0)
    names = [f for f in vars(have[0]) if isinstance(getattr(have[0], f), torch.Tensor) or getattr(have[0], f) is None]

    def join(name):
        xs = [getattr(p, name) for p in have]
        return None if any(x is None for x in xs) else torch.cat(xs)
    return make(**{n: join(n) for n in names}), [x for _, its in parts for x in its], slice(start, start + len(items))


def cat(t: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """Every rank's `t` (N_r, ...) concatenated in rank order, on every rank, and the slice of it
    that is this rank's own (one process: `t` itself, and all of it)."""
    parts = gather(t.cpu())
    start = sum(len(p) for p in parts[:rank()])
    return torch.cat(parts), slice(start, start + len(t))  # (N_all, ...)


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if size() == 1:
        return obj
    box = [obj]
    td.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if size() > 1:
        td.barrier()


def sync_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum every rank's gradients of `params` (None counts as zeros) into one flat all-reduce."""
    if size() == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(device())  # (P,) one buffer, one collective
    td.all_reduce(flat)
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[off:off + n].view_as(g).to(g.device)
        off += n


def is_sharded(model: torch.nn.Module) -> bool:
    if size() == 1:  # one process never shards (and skips FSDP's import, a second of start-up)
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def grad_scale(model: torch.nn.Module) -> int:
    """What a loss normalised over all ranks' samples is multiplied by before its backward: FSDP2
    averages the ranks' gradients (times the world size, that is their sum); data parallel sums
    them itself (sync_grads), so 1."""
    return size() if is_sharded(model) else 1


def fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each block the model names in `_no_split_modules` (Qwen2.5-VL: its decoder layers and
    vision blocks) its own unit, the rest (embeddings, lm_head, merger) the root's. FSDP2 AVERAGES
    gradients over ranks; update_policy scales each rank's loss by the world size to make it a sum."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    # grpo.per_token_logps reads the root's hidden states (a view) and never writes into them
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    for block in [m for m in model.modules() if type(m).__name__ in kinds]:
        fully_shard(block)
    fully_shard(model)
    return model


@contextlib.contextmanager
def unsharded(model: torch.nn.Module):
    """FSDP2: the whole model gathered on every rank inside the block. Generation needs it: each
    rank decodes its own number of tokens, so its forwards cannot be collectives. Outside, the
    blocks go back to being gathered per forward (the root stays gathered, as FSDP2 keeps it)."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # FSDP2 sets up its units from the root on the root's first forward; unshard() before that
    # would set each one up as a root of its own, so set them up from the root first (no public
    # call does only that in torch 2.13).
    model._get_fsdp_state()._lazy_init()
    for m in units:
        m.unshard()  # a collective: every rank enters the block at the same point of the loop
    blocks = [m for m in units if m is not model]
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def shard_range(n: int, r: int | None = None, w: int | None = None) -> range:
    """The contiguous slice of n items (VMs) rank r owns: the first n % w ranks get one more."""
    r, w = rank() if r is None else r, size() if w is None else w
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def spread(model: torch.nn.Module, shard: bool) -> None:
    """Under torchrun: every rank starts from rank 0's trainable weights (a LoRA adapter's random
    init), and with shard=True (full fine-tuning) the model is sharded with FSDP2. One process:
    the model as it is."""
    if size() > 1:
        broadcast_params([p for p in model.parameters() if p.requires_grad])
        if shard:
            fsdp(model)


def broadcast_params(params: list[torch.nn.Parameter]) -> None:
    """Rank 0's values of `params` on every rank (a LoRA adapter's random init, say)."""
    if size() == 1 or not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(device())  # (P,)
    td.broadcast(flat, src=0)
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[off:off + p.numel()].view_as(p).to(p.device))
            off += p.numel()


def full_state_dict(model: torch.nn.Module) -> dict:
    """The model's whole state dict on the CPU (FSDP2: gathered from every rank; a collective)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def whole_tensors(model: torch.nn.Module):
    """Yield (name, whole tensor) of the model's state dict one at a time, on every rank. FSDP2:
    each one all-gathered where it lives (a collective per tensor: every rank must walk the whole
    generator); otherwise the tensors as they are. For streaming weights, not for saving them."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):  # a DTensor: this rank holds a shard
            tensor = tensor.full_tensor()
        yield name, tensor


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer's state keyed by parameter name, whole (FSDP2: gathered; a collective), so a
    run resumes with any number of ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """optimizer_state's dict back (every rank passes the same one). A dict keyed by parameter
    index (checkpoints before optimizer_state) loads as torch saved it."""
    if all(isinstance(k, int) for k in state.get("state", {})) and not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def mute_others() -> None:
    """Only rank 0 talks: the other ranks' stdout goes nowhere (their errors still reach stderr)."""
    import sys

    from plumbing import progress
    if rank() != 0:
        progress.MUTED = True
        sys.stdout = open(os.devnull, "w")


def seed_ranks(seed: int) -> None:
    """Sampling apart: under torchrun each rank's torch generator gets its own seed (one process:
    left as it is), so two ranks never draw the same answers for the same screen."""
    if size() > 1:
        torch.manual_seed(seed + 1_000_003 * rank())


@contextlib.contextmanager
def same_rng(seed: int):
    """Under torchrun: a block every rank runs with the same torch random numbers (the world
    model's shuffles, so it stays the same model on every rank); one process: the RNG as it is."""
    if size() == 1:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
