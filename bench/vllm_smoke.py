"""GPU smoke test of the vLLM path (vllm_engine.py) on random weights: what a CPU cannot check.

    pip install vllm==0.32.0          # the vLLM that pins our torch 2.13.0
    python bench/vllm_smoke.py        # one GPU, ~3 minutes (most of it vLLM's start-up compile)
    python bench/vllm_smoke.py --size 3b   # Qwen2.5-VL-3B's shapes: sync time and memory at scale

Nothing is downloaded: a Qwen2.5-VL with random weights (--size small: 4 layers of 512, a 4-block
vision tower; --size 3b: bench/gpu_update.py's 3B config) and the tiny local tokenizer are saved to
a temporary folder, which the policies load as a user's --model folder. One engine serves two
policies loaded from it, a LoRA one and a full fine-tuning one (a sync replaces every weight, so
the engine follows whichever policy synced last). Each check prints PASS or FAIL with its
numbers; the exit code is 1 if any check failed, 2 if there is no CUDA GPU or no vLLM.

  1. start-up: the trainer's CUDA device, python / numpy / torch CPU / CUDA RNG states, torch
     thread count and gc freeze count are as before the engine; the model folder is unchanged and
     the engine's folder is another one.
  2. prompt ids: vLLM's RequestOutput.prompt_token_ids equal model.encode_chat's ids, for prompts
     of one and two screenshots.
  3. log-probs: vLLM's (processed) log-probs of the tokens it sampled against grpo.per_token_logps
     at T = 1 and T = 0.7 (scored at the wrong T for scale); sampling: the same torch seed gives
     the same answers, another gives others, python's and numpy's RNGs are not used.
  4. LoRA sync: after an update of the adapter the stale engine's log-probs are off; after
     sync_weights they match again.
  5. Full fine-tuning sync of the vision tower: the same screenshot again after a sync gives the
     new weights' log-probs (vLLM's encoder cache emptied), where a sync without emptying it
     would reuse the old vision embeddings (printed for comparison).
  6. sync time and the GPU memory a sync adds on top of what is allocated (streamed: about one
     merged matrix, not a second copy of the model).

Not run by us (no GPU here); the numbers to expect are not known yet. Thresholds: mean |log-prob
difference| < 0.05 and max < 1 nat (both sides bf16, different kernels).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import model as M  # noqa: E402
import vllm_engine as V  # noqa: E402
from model import explore_messages, uitars_messages  # noqa: E402
from qwen_vl import SPECIAL_TOKENS  # noqa: E402

MEAN_TOL, MAX_TOL = 0.05, 1.0  # nats
SMALL = dict(
    text_config=dict(vocab_size=1088, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                     rms_norm_eps=1e-6, initializer_range=0.1,  # peaked enough that samples differ
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]}),
    vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[1, 3], tokens_per_second=2, initializer_range=0.1),
    tie_word_embeddings=False,
)
failed = []


def report(name: str, ok: bool, numbers: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {numbers}", flush=True)
    if not ok:
        failed.append(name)


def stop(sentence: str) -> None:
    """No GPU or no vLLM: one sentence, exit code 2 (not a failed check: nothing was checked)."""
    print(sentence, file=sys.stderr)
    sys.exit(2)


def build_folder(size: str) -> str:
    """A random-weight Qwen2.5-VL saved like a user's checkpoint."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    if size == "3b":
        from gpu_update import QWEN25_VL_3B as shapes  # bench/ is on the path: this script's folder
    else:
        shapes = SMALL
    tok = M.build_tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(**shapes, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    policy = M.wrap_policy(model, tok, M.qwen_image_processor(), "random", "cuda", torch.bfloat16)
    folder = os.path.join(tempfile.mkdtemp(prefix="vllm-smoke-"), "model")
    M.save_policy(policy, folder)
    return folder


def np_state() -> tuple:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, keys.tobytes(), pos, has_gauss, cached


def snapshot() -> dict:
    """The process state an engine start must leave alone."""
    return {"device": torch.cuda.current_device(), "python rng": random.getstate(), "numpy rng": np_state(),
            "torch cpu rng": torch.get_rng_state(), "torch cuda rng": torch.cuda.get_rng_state_all(),
            "threads": torch.get_num_threads(), "gc frozen": gc.get_freeze_count()}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def folder_state(folder: str) -> dict:
    return {f: (os.path.getsize(os.path.join(folder, f)), os.path.getmtime(os.path.join(folder, f)))
            for f in sorted(os.listdir(folder))}


def gaps(policy, gens, temperature: float) -> tuple[float, float, list[float]]:
    """(mean, max) |sampler log-prob - grpo.per_token_logps at `temperature`| over every token, and
    the trainer's log-probs."""
    samples = [grpo.step_sample(g.prompt, g.ids, old_logps=g.logprobs) for g in gens]
    batch = grpo.collate(samples, policy.tokenizer.pad_token_id)
    batch["suppressed"] = policy.suppressed_ids()
    with torch.no_grad():
        ours = grpo.per_token_logps(policy.model, batch, temperature=temperature).float().cpu()  # (B, T)
    on = batch["target_mask"].bool()  # (B, T)
    d = (ours[on] - batch["old_logps"][on]).abs()  # (N,)
    return float(d.mean()), float(d.max()), ours[on].tolist()


def timed_sync(engine, policy) -> tuple[float, float]:
    """(seconds, GB the sync allocated above what was allocated before it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    engine.sync_weights(policy)
    torch.cuda.synchronize()
    return time.perf_counter() - t, (torch.cuda.max_memory_allocated() - base) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["small", "3b"], default="small")
    ap.add_argument("--samples", type=int, default=8, help="answers per log-prob check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        stop(f"bench/vllm_smoke.py needs a CUDA GPU and vLLM ({V.INSTALL}); nothing was checked.")
    try:
        import vllm
    except ImportError as e:
        stop(f"bench/vllm_smoke.py needs vLLM ({V.INSTALL}); importing it failed: {str(e).splitlines()[0][:200]}.")
    if vllm.__version__ != V.VLLM_VERSION:
        print(f"note: vLLM {vllm.__version__} is installed; this path was written against {V.VLLM_VERSION}", flush=True)

    folder = build_folder(args.size)
    full = M.load_policy(folder)                  # full fine-tuning (every weight trainable)
    lora = M.load_policy(folder, lora_rank=16)    # LoRA on the language model
    shots = [Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype("uint8"))
             for i, (w, h) in enumerate([(448, 336), (640, 360), (300, 500)])]
    one = explore_messages(shots[0])
    two = uitars_messages("Open the file manager.", shots[1:], ["Action: click(start_box='(10,20)')"])

    # 1. start-up -------------------------------------------------------------------------------
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    before, files = snapshot(), folder_state(folder)
    t = time.perf_counter()
    engine = V.attach(full, max_images=2, answer_tokens=2 * 70)
    started = time.perf_counter() - t
    after = snapshot()
    changed = [k for k in before if not same(before[k], after[k])]
    report("engine start leaves the trainer's process alone", not changed,
           f"changed: {changed or 'nothing'} (device {after['device']}, {after['threads']} threads, "
           f"{after['gc frozen']} frozen objects); start-up {started:.0f} s")
    report("the model folder is only read", folder_state(folder) == files and engine.folder != folder,
           f"engine folder {engine.folder}")
    lora.engine = engine

    # 2. prompt ids ------------------------------------------------------------------------------
    from vllm import SamplingParams
    encs, prompts = V.engine_prompts(full, [one, two])
    outs = engine.llm.generate(prompts, [SamplingParams(**V.sampling_args(full, 1, 1.0, 1.0, 0))] * 2, use_tqdm=False)
    for enc, out, n in zip(encs, outs, (1, 2)):
        theirs = list(out.prompt_token_ids)
        first = next((i for i, (a, b) in enumerate(zip(theirs, enc.input_ids)) if a != b), None)
        report(f"vLLM's prompt ids equal encode_chat's ({n} screenshot{'s' * (n > 1)})", theirs == enc.input_ids,
               f"{len(theirs)} vs {len(enc.input_ids)} ids, first difference at {first}")

    # 3. log-probs and sampling -------------------------------------------------------------------
    batch = [one, two] * (args.samples // 2)
    for temperature in (1.0, 0.7):
        gens = M.generate(full, batch, max_new_tokens=32, temperature=temperature)
        mean, worst, _ = gaps(full, gens, temperature)
        wrong = gaps(full, gens, 1.0 if temperature != 1.0 else 0.5)[0]
        report(f"vLLM log-probs = per_token_logps at T={temperature}", mean < MEAN_TOL and worst < MAX_TOL and mean < wrong / 2,
               f"mean |diff| {mean:.4f}, max {worst:.4f} over {sum(len(g.logprobs) for g in gens)} tokens "
               f"(scored at the wrong T: {wrong:.4f})")
    states = random.getstate(), np_state(), torch.cuda.get_rng_state_all()
    torch.manual_seed(11)
    a = [g.ids for g in M.generate(full, batch, max_new_tokens=16)]
    torch.manual_seed(11)
    b = [g.ids for g in M.generate(full, batch, max_new_tokens=16)]
    torch.manual_seed(12)
    c = [g.ids for g in M.generate(full, batch, max_new_tokens=16)]
    untouched = same(list(states), [random.getstate(), np_state(), torch.cuda.get_rng_state_all()])
    report("sampling follows torch's seed, one seed per request", a == b and a != c and len({tuple(x) for x in a}) > 1
           and untouched, f"same seed same answers: {a == b}, other seed other answers: {a != c}, "
           f"{len({tuple(x) for x in a})}/{len(a)} distinct answers in a batch of identical pairs, "
           f"python/numpy/CUDA RNG untouched: {untouched}")
    report("torch's thread count is the trainer's after generate", torch.get_num_threads() == before["threads"],
           f"{torch.get_num_threads()} threads")

    # 4. LoRA sync --------------------------------------------------------------------------------
    seconds, extra = timed_sync(engine, lora)
    total = sum(q.numel() for _, q in M.merged_weights(lora)) * 2 / 1e9  # GB in bf16
    gens = M.generate(lora, batch, max_new_tokens=32)
    base_gap, _, old = gaps(lora, gens, 1.0)
    opt = torch.optim.Adam([q for q in lora.model.parameters() if q.requires_grad], lr=2e-2)
    samples = [grpo.step_sample(g.prompt, g.ids) for g in gens]
    train = grpo.collate(samples, lora.tokenizer.pad_token_id)
    train["suppressed"] = lora.suppressed_ids()
    for _ in range(10):  # make the sampled answers likelier: an update that moves the log-probs
        lp = grpo.per_token_logps(lora.model, train, temperature=1.0)  # (B, T)
        (-(lp.sum() / train["target_mask"].sum())).backward()
        opt.step()
        opt.zero_grad()
    moved = float(np.mean(np.abs(np.array(gaps(lora, gens, 1.0)[2]) - np.array(old))))
    stale = gaps(lora, M.generate(lora, batch, max_new_tokens=32), 1.0)[0]
    seconds2, extra2 = timed_sync(engine, lora)
    synced = gaps(lora, M.generate(lora, batch, max_new_tokens=32), 1.0)[0]
    report("a LoRA sync closes the gap after an update", moved > 0.3 and stale > 5 * max(synced, 0.01) and synced < MEAN_TOL,
           f"update moved log-probs by {moved:.3f}; mean |diff| before the update {base_gap:.4f}, "
           f"stale engine {stale:.4f}, after sync {synced:.4f}")

    # 5. full fine-tuning: vision tower changed, same screenshot again ---------------------------------
    timed_sync(engine, full)
    gens = M.generate(full, [one] * args.samples, max_new_tokens=32)  # the encoder cache now holds shots[0]
    ours_before = gaps(full, gens, 1.0)[2]
    with torch.no_grad():  # an update of the vision tower only (full fine-tuning trains it)
        for q in M.inner_model(full.model).visual.merger.parameters():
            q.add_(torch.randn_like(q) * q.float().std().to(q.dtype))
    # a sync WITHOUT emptying the encoder cache, for comparison: the old embeddings of shots[0]
    weights = M.merged_weights(full, engine.dtype, every_rank=True)
    engine.llm.apply_model(lambda m: m.load_weights(weights))
    engine.llm.reset_prefix_cache()
    cached = gaps(full, M.generate(full, [one] * args.samples, max_new_tokens=32), 1.0)[0]
    engine.sync_weights(full)
    fresh_gens = M.generate(full, [one] * args.samples, max_new_tokens=32)
    fresh = gaps(full, fresh_gens, 1.0)[0]
    ours_after = gaps(full, gens, 1.0)[2]
    changed_by = float(np.mean(np.abs(np.array(ours_after) - np.array(ours_before))))
    report("a full sync reaches the vision embeddings (encoder cache emptied)", fresh < MEAN_TOL and changed_by > 0.1,
           f"vision update moved our log-probs by {changed_by:.3f}; mean |diff| after sync_weights {fresh:.4f} "
           f"(after a sync that kept vLLM's encoder cache: {cached:.4f})")

    # 6. sync cost ------------------------------------------------------------------------------
    seconds3, extra3 = timed_sync(engine, full)
    # A LoRA-merged matrix is built in fp32 (B A, then W + B A) and handed over in bf16, while vLLM
    # still holds the one before: about 3x the largest such matrix in fp32. Every other weight is
    # handed over as it is (no copy), so a full fine-tuning sync should add next to nothing.
    from peft.tuners.lora import LoraLayer
    merged = max(m.base_layer.weight.numel() for m in lora.model.modules() if isinstance(m, LoraLayer)) * 4 / 1e9
    report("a sync streams (about one merged matrix of memory, not a model copy)",
           max(extra, extra2) < 3 * merged + 0.02 and extra3 < 0.02,  # + 20 MB of slack
           f"LoRA sync {seconds:.2f}/{seconds2:.2f} s, +{max(extra, extra2):.3f} GB; full sync {seconds3:.2f} s, "
           f"+{extra3:.3f} GB; weights {total:.2f} GB in bf16, largest LoRA-merged matrix {merged:.3f} GB in fp32")

    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
