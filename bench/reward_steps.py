"""Benchmark: what ScreenExplorer's reward pays for one step of each kind, a menu against a window.

    python bench/reward_steps.py          # each desktop icon double-clicked and right-clicked, ~1 min
    python bench/reward_steps.py --runs 3

Why it exists: the explore bench (bench/learning_explore.py) once learned to right-click for a
menu on every step instead of opening apps. Whether a reward pays a window more than a menu is a
property of the reward alone, so it is measured here on single steps from a fresh desktop: each of
the desktop's icons double-clicked (its app's window opens) and right-clicked (pcmanfm's menu
opens where the pointer is), one right-click and one click on the empty desktop. Columns, per
step (1 - cos of before vs after):
  image       rewards.image_immediate: screen_features, the means centred on mid-grey (ours)
  self        the same grid with every entry centred on the screen's own average, as the features
              were before (a menu on a flat desktop then scored like a window)
  text        rewards.text_immediate, the OCR text terms' change (when tesseract and the embedder
              are installed; else "-")
  windows     the windows term: X windows open after the step that were not before (GET /windows)
Medians over --runs. The desktop is a real `vm_server.py --xvfb` server on loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import rewards as R  # noqa: E402
import ocr as O  # noqa: E402
from conftest import start_vm_server  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402
from env import VMClient  # noqa: E402


def self_centred(images: list[Image.Image]) -> torch.Tensor:
    """rewards.screen_features as it was: means and stds centred on the screen's own average."""
    gw, gh = R.SCREEN_GRID
    rows = []
    for img in images:
        a = np.asarray(img.convert("L").resize((gw * 8, gh * 8), Image.BOX), dtype=np.float32) / 255.0
        cells = a.reshape(gh, 8, gw, 8)  # (gh, 8, gw, 8)
        mean, std = cells.mean(axis=(1, 3)), cells.std(axis=(1, 3))  # (gh, gw) each
        v = np.concatenate([(mean - mean.mean()).ravel(), (std - std.mean()).ravel(), [mean.mean() - 0.5]])
        rows.append(v / max(np.linalg.norm(v), 1e-8))
    return torch.from_numpy(np.stack(rows).astype(np.float32))  # (N, D)


def steps() -> list[tuple[str, dict]]:
    out = []
    for label, (x, y) in desktop_icons().items():
        out.append((f"double-click {label}", {"type": "double_click", "x": x, "y": y}))
        out.append((f"right-click {label}", {"type": "right_click", "x": x, "y": y}))
    out.append(("right-click the desktop", {"type": "right_click", "x": 640, "y": 400}))
    out.append(("click the empty desktop", {"type": "click", "x": 640, "y": 400}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1, help="times each step is measured (medians)")
    a = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    tools = O.load_text_tools()
    server = start_vm_server()
    vm = VMClient(server.url, server.token, timeout=60)
    rows: dict = {}
    try:
        for _ in range(a.runs):
            for name, action in steps():
                vm.reset()
                before, wins = vm.screenshot(), {w["id"] for w in vm.windows()}
                after = vm.act(action, settle="watch", screenshot=True).image
                opened = len({w["id"] for w in vm.windows()} - wins)
                f = R.step_features([before], [after], ["Try something new"], [action], tools)
                s = R.make_buffer(f, [0], [1.0])
                ours = float(R.image_immediate(s)[0])
                old = float(1 - R.cosine(*self_centred([before, after]).split(1)))
                text = float(R.text_immediate(s)[0]) if tools is not None else None
                rows.setdefault(name, []).append((ours, old, text, opened))
    finally:
        server.stop()
    print(f"{'step (from a fresh desktop)':32s} {'image':>7s} {'self':>7s} {'text':>7s} {'windows':>8s}")
    for name, vals in rows.items():
        med = [statistics.median(v) if None not in v else None for v in zip(*vals)]
        print(f"{name:32s} {med[0]:7.3f} {med[1]:7.3f} " + (f"{med[2]:7.3f}" if med[2] is not None else "      -")
              + f" {med[3]:8.1f}")


if __name__ == "__main__":
    main()
