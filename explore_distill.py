"""explore_distill.py: ScreenExplorer's experience-stream distillation data: a generation's best
steps -> a dataset in runs/<name>/distill/ -> SFT samples for the next generation.

    python train_explore.py --generations 3 --iterations-per-generation 100   # uses it at each boundary
    python -m pytest -q tests/test_train_explore.py -k "top_steps or distillation"

At the end of generation g, train_explore.py calls write_distill_dataset: the top --distill-top of
each iteration's format-valid steps, by total reward, read back from the generation's trajectory
files and copied with their screenshots into distill/gen<g>.jsonl + distill/gen<g>/*.png. The next
generation starts from the BASE model fine-tuned on distill_samples(every generation so far).

Where this departs from the paper: the paper does not publish its recipe. The steps are ranked
within each iteration, not over the generation, because the reward's scale drifts as the world
model learns (top_steps says why); the targets are the sampled answer ids verbatim.
"""
from __future__ import annotations

import json
import math
import os
import shutil

from PIL import Image

import grpo
from chat import encode_chat, explore_messages


def top_steps(valid: list[dict], top: float) -> list[dict]:
    """ALGO: per iteration, the ceil(top * n) of its n steps with the highest total reward; iterations
    in order, best first within each, ties in time order. Each step's dict has its "iteration".

    Ranked within an iteration, not over the whole generation: the reward's scale drifts within a
    generation (curiosity decays as the world model learns, the format rate climbs), so a pooled
    ranking would keep mostly the early iterations' steps for their inflated curiosity, not for
    being the best of what the policy did then. Within one iteration every step was scored by the
    same world model, as GRPO's one group compares them. ceil keeps at least one step of every
    iteration that had a format-valid one."""
    by_it = {}
    for step in valid:
        by_it.setdefault(step["iteration"], []).append(step)
    keep = []
    for it in sorted(by_it):
        ranked = sorted(by_it[it], key=lambda step: -step["reward"])  # stable: ties keep time order
        keep += ranked[:math.ceil(top * len(ranked))]
    return keep


def write_distill_dataset(run: str, g: int, iterations: range, top: float) -> int:
    """ALGO: the top `top` fraction (by total reward, ranked within each iteration: top_steps) of the
    generation's format-valid steps, read back from its trajectory files, copied with their
    screenshots. Returns how many were kept.
    Rebuilt only when the generation's iterations changed (a resumed run with more --iterations)."""
    out = os.path.join(run, "distill", f"gen{g}.jsonl")
    meta_path = os.path.join(run, "distill", f"gen{g}.meta.json")
    span = [iterations.start, iterations.stop]
    if os.path.exists(out) and os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta["iterations"] == span:
            return meta["kept"]
    steps = []
    for it in iterations:
        folder = os.path.join(run, "trajectories", f"it{it:06d}")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".jsonl"):
                with open(os.path.join(folder, name)) as fh:
                    steps += [dict(json.loads(line), folder=folder, iteration=it) for line in fh]
    valid = [s for s in steps if s.get("valid") and s.get("completion_ids") and s.get("screenshot")]
    keep = top_steps(valid, top)
    img_dir = os.path.join(run, "distill", f"gen{g}")
    shutil.rmtree(img_dir, ignore_errors=True)
    os.makedirs(img_dir)
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
        for k, s in enumerate(keep):
            name = f"{k:05d}.png"
            shutil.copyfile(os.path.join(s["folder"], s["screenshot"]), os.path.join(img_dir, name))
            fh.write(json.dumps({"image": f"gen{g}/{name}", "text": s["text"], "completion_ids": s["completion_ids"],
                                 "intent": s["intent"], "action": s["action"], "reward": s["reward"],
                                 "source": os.path.relpath(os.path.join(s["folder"], s["screenshot"]), run)}) + "\n")
    os.replace(tmp, out)
    with open(meta_path, "w") as fh:
        json.dump({"iterations": span, "kept": len(keep), "valid": len(valid), "steps": len(steps), "top": top}, fh)
    print(f"E{g}: distilled {len(keep)} of {len(valid)} format-valid steps ({len(steps)} in all) -> {out}", flush=True)
    return len(keep)



def distill_samples(policy, run: str, upto: int) -> list:
    """grpo.Samples of every distilled step of generations 1..upto: the saved screenshot as the
    prompt, the answer's sampled token ids verbatim as the target."""
    samples = []
    for g in range(1, upto + 1):
        path = os.path.join(run, "distill", f"gen{g}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            for line in fh:
                d = json.loads(line)
                with Image.open(os.path.join(run, "distill", d["image"])) as im:
                    enc = encode_chat(policy, explore_messages(im.convert("RGB")))
                samples.append(grpo.step_sample(enc, d["completion_ids"]))
    return samples

