"""Benchmark: what ScreenExplorer's rewards cost per iteration, next to the policy's GRPO update.

    python bench/world_model.py                  # 8 VMs x 10 steps = 80 steps, 1280x720
    python bench/world_model.py --no-policy      # rewards side only (no tiny-policy update)

One iteration's buffer is N = vms * steps transitions. Timed, each as the median of --repeats:
  screen features   rewards.screen_features on the 2N before/after screenshots
  world model       train_world_model (3 epochs, batch 16) + predict_next, text branch on (E = 384)
  rewards           exploration_rewards with every term on
  OCR               tesseract (one process per core) on the distinct screens (about N + vms: the after-screen of step t is
                    the before-screen of step t+1); measured on --ocr-screens of them, scaled up
  embedder          one embed_texts call on ~3N + hits strings (screens, intents, click texts)
  policy step       grpo.update_policy of the tiny random Qwen2.5-VL on N explore-prompt samples
                    (1280x720 screenshot each, 48 completion tokens), micro-batches of 8
The screenshots are rendered with PIL (windows, text lines, a taskbar), different at every step,
so OCR has real text to read; real desktops would only make OCR slower or faster with their text.
On a GPU the policy step is far faster than here while features / world model / OCR stay on the
CPU side, so the ratio printed here (CPU, tiny policy) flatters the policy; the absolute seconds
are what to look at. Last line: the world-model update's cost as a fraction of the policy step.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards as R  # noqa: E402
import ocr as O  # noqa: E402

WORDS = "File Edit View Search Document Help Terminal Calculator Open Save Close Settings Tools".split()


def render_screens(n: int, size=(1280, 720), seed=0) -> list[Image.Image]:
    """n different desktop-like screenshots: a taskbar, 1-3 windows with a title and text lines."""
    rng = random.Random(seed)
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 13)
    out = []
    for _ in range(n):
        img = Image.new("RGB", size, (20, 40, 70))
        d = ImageDraw.Draw(img)
        d.rectangle([0, size[1] - 28, size[0], size[1]], fill=(30, 30, 30))
        d.text((10, size[1] - 22), "desktop 1   " + " ".join(rng.sample(WORDS, 3)), fill="white", font=font)
        for _ in range(rng.randint(1, 3)):
            x, y = rng.randint(0, 700), rng.randint(0, 350)
            w, h = rng.randint(300, 560), rng.randint(200, 330)
            d.rectangle([x, y, x + w, y + h], fill=(245, 245, 245), outline=(0, 0, 0))
            d.rectangle([x, y, x + w, y + 22], fill=(90, 120, 180))
            d.text((x + 8, y + 4), " ".join(rng.sample(WORDS, 2)), fill="white", font=font)
            for k in range(rng.randint(2, 10)):
                d.text((x + 8, y + 30 + 18 * k), " ".join(rng.sample(WORDS, 4)), fill="black", font=font)
        out.append(img)
    return out


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ocr-screens", type=int, default=8, help="how many screens to actually OCR (then scaled up)")
    ap.add_argument("--no-policy", action="store_true", help="skip the tiny-policy GRPO step")
    args = ap.parse_args()
    torch.manual_seed(0)
    n = args.vms * args.steps
    # Trajectories: one per VM, screens chained (after of step t = before of step t+1).
    chain = render_screens(args.vms * (args.steps + 1))
    before = [chain[v * (args.steps + 1) + s] for v in range(args.vms) for s in range(args.steps)]
    after = [chain[v * (args.steps + 1) + s + 1] for v in range(args.vms) for s in range(args.steps)]
    traj = [v for v in range(args.vms) for _ in range(args.steps)]
    rng = random.Random(1)
    actions = [{"type": "click", "x": rng.randint(0, 1279), "y": rng.randint(0, 719)} for _ in range(n)]
    rows = []

    t_feat, _ = timed(lambda: (R.screen_features(before), R.screen_features(after)), args.repeats)
    rows.append(("screen features (2N images)", t_feat))
    sb, sa = R.screen_features(before), R.screen_features(after)  # (N, D)

    tools = O.load_text_tools()
    e_dim = tools.dim if tools else 384
    eb = torch.nn.functional.normalize(torch.randn(n, e_dim), dim=1)  # (N, E) stand-ins if no embedder
    ea = torch.nn.functional.normalize(torch.randn(n, e_dim), dim=1)  # (N, E)
    wm = R.WorldModel(text_dim=e_dim)
    opt = torch.optim.AdamW(wm.parameters(), lr=1e-3)

    def wm_iter():
        m = R.train_world_model(wm, opt, sb, actions, sa, eb, ea, epochs=3, batch_size=16)
        return m, R.predict_next(wm, sb, actions, eb)

    t_wm, (_, (ps, pt)) = timed(wm_iter, args.repeats)
    n_params = sum(p.numel() for p in wm.parameters())
    rows.append((f"world model update + predict ({n_params / 1e6:.2f} M params)", t_wm))
    hit = torch.rand(n) < 0.3  # (N,)
    t_rew, _ = timed(lambda: R.exploration_rewards(R.parse_reward_flags("all"), traj, [1] * n, sb, sa, ps,
                                                   eb, ea, pt, eb, ea, hit), args.repeats)
    rows.append(("exploration_rewards (all terms)", t_rew))

    if tools is not None:
        k = min(args.ocr_screens, len(chain))
        t_ocr, _ = timed(lambda: O.ocr_many(tools, chain[:k]), 1)  # one process per core
        distinct = len(chain)  # N + vms distinct screens
        rows.append((f"OCR, {distinct} distinct screens (measured {k}, {os.cpu_count()} procs)", t_ocr * distinct / k))
        texts = [" ".join(rng.sample(WORDS, 8)) for _ in range(3 * n + n // 3)]
        t_emb, _ = timed(lambda: O.embed_texts(tools, texts), args.repeats)
        rows.append((f"embedder, {len(texts)} strings", t_emb))
    else:
        print("(text tools missing: OCR and embedder rows skipped)")

    t_policy = None
    if not args.no_policy:
        import grpo
        import model as M
        from model import encode_chat, explore_messages
        policy = M.load_policy("tiny")
        samples = []
        for i in range(n):
            enc = encode_chat(policy, explore_messages(before[i]))
            samples.append(grpo.step_sample(enc, [rng.randint(10, 200) for _ in range(48)], reward=rng.random()))
        for s, a in zip(samples, grpo.group_advantages([s.reward for s in samples]).tolist()):
            s.advantage = a
        popt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-5)
        t_policy, _ = timed(lambda: grpo.update_policy(policy, popt, samples, micro_batch_size=8), 1)
        rows.append((f"policy GRPO step, tiny Qwen2.5-VL, {n} samples", t_policy))

    print(f"per iteration, N = {args.vms} VMs x {args.steps} steps = {n} transitions, 1280x720, "
          f"{torch.get_num_threads()} torch threads")
    for name, t in rows:
        print(f"  {name:<62s} {t:8.3f} s")
    if t_policy:
        print(f"world_model_update_over_policy_step: {t_wm / t_policy:.4f}")
    else:
        print(f"world_model_update_s: {t_wm:.4f}")


if __name__ == "__main__":
    main()
