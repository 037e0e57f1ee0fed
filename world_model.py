"""ScreenExplorer's curiosity world model: (s_t, e_t, a_t) -> (s'_t, e'_t), trained online.

Used by train_explore.py; its reward terms (image_world_model, text_world_model: 1 - cos of the
after-screen and the prediction) live in rewards.py. Tests: `python -m pytest -q tests/test_world_model.py`.

Per iteration: predict every step of the buffer with the model as it stood (those predictions are
the curiosity reward), then train it `epochs` passes on the valid steps:

    wm = WorldModel(text_dim=...); opt = AdamW(wm.parameters(), 1e-3, betas=(0.9, 0.95))
    pred_s, pred_e, metrics = update_and_predict(wm, opt, f, actions, valid)   # f: rewards.step_features

Where we depart from the paper / release, and why:
1. The model. The release fine-tunes a Llama-3.2-1B on the action string; we use a 3-layer MLP
   (~1M parameters) on the current features + an action vector built from the Action's fields.
   The release detaches its image prediction before the loss, so its image branch never learns and
   its visual curiosity compares against an untrained projection; here every parameter is trained
   (tests/test_world_model.py checks each one gets a gradient).
2. Curiosity before learning. The release trains the world model 3 epochs on the iteration's buffer
   and scores each transition with the prediction of its last epoch, i.e. after the model has
   already fitted that very transition. After a reset all desktops start from the same screen, so a
   new transition found on several of them is learned within the epochs and loses most of its
   surprise before it is scored (tests/test_world_model.py, synthetic features, a new transition taken
   8 times vs familiar ones: 0.09 vs 0.02 trained first, 0.55 vs 0.004 predicted first). The paper's
   intent is surprise before learning, so we predict (and reward) first, then train;
   `update_and_predict(..., train_first=True)` (train_explore.py --wm-train-first) keeps the
   release's order for comparison, predicting after the update rather than mid-epoch.
"""

import math
import zlib

import numpy as np
import torch
import torch.nn as nn

from actions import ACTION_TYPES, DIRECTIONS  # the action vector's one-hot slots, in the VM protocol's order
from rewards import SCREEN_DIM, StepFeatures, action_fields

HEAT_GRID = (16, 9)  # where the action lands, as a soft spot on a coarse grid
TEXT_BUCKETS = 64  # hashed bag of typed-text trigrams and key names
ACTION_DIM = len(ACTION_TYPES) + 6 + HEAT_GRID[0] * HEAT_GRID[1] + len(DIRECTIONS) + 1 + TEXT_BUCKETS


def encode_actions(actions: list, screen=(1280, 720)) -> torch.Tensor:
    """(N, ACTION_DIM): from the Action's fields, not its string.

    Fields are the same in both text formats (explore and uitars), and *where* a click lands
    matters most on a GUI; a char n-gram of "Click(640, 360)" does not tell the network that 640 is
    near 650. So the point becomes a soft spot on a 16 x 9 grid (a linear layer can map it to the
    screen cells it changes), plus the raw normalised coordinates for finer position. Typed text and
    key names go into a hashed bag (crc32, stable across processes; Python's hash() is salted).
    None (a malformed step) encodes as all zeros.
    """
    w, h = screen
    hw, hh = HEAT_GRID
    cx = (np.arange(hw) + 0.5) / hw  # (hw,) cell centres, 0..1
    cy = (np.arange(hh) + 0.5) / hh  # (hh,)
    # numpy, not torch: hundreds of tiny torch ops per call crawl when the cores are busy.
    out = np.zeros((len(actions), ACTION_DIM), dtype=np.float32)  # (N, A)
    for k, act in enumerate(actions):
        a, v = action_fields(act), out[k]  # v is a view: writing to it fills row k
        if a.get("type") in ACTION_TYPES:
            v[ACTION_TYPES.index(a["type"])] = 1.0
        o = len(ACTION_TYPES)
        x, y, x2, y2 = (_unit(a.get(f), d) for f, d in (("x", w), ("y", h), ("x2", w), ("y2", h)))
        if x is not None and y is not None:
            v[o:o + 3] = (1.0, x, y)
            # Gaussian bump of width one cell around the point, on the 16 x 9 grid.
            heat = np.exp(-((cy[:, None] - y) * hh) ** 2 / 2 - ((cx[None, :] - x) * hw) ** 2 / 2)  # (hh, hw)
            v[o + 6:o + 6 + hw * hh] = heat.reshape(-1)  # (hw*hh,)
        if x2 is not None and y2 is not None:
            v[o + 3:o + 6] = (1.0, x2, y2)
        o += 6 + hw * hh
        if a.get("direction") in DIRECTIONS:
            v[o + DIRECTIONS.index(a["direction"])] = 1.0
        v[o + 4] = min(_unit(a.get("amount"), 20.0) or 0.0, 1.0)
        o += 5
        text = str(a.get("text") or "").lower()
        grams = [text[j:j + 3] for j in range(max(len(text) - 2, 1 if text else 0))]
        grams += [f"key:{kk}".lower() for kk in (a.get("keys") or [])]
        for g in grams:
            v[o + zlib.crc32(g.encode()) % TEXT_BUCKETS] += 1.0
        norm = np.linalg.norm(v[o:])
        if norm > 0:
            v[o:] /= norm
    return torch.from_numpy(out)  # (N, A)


def _unit(value, scale):
    """value / scale clamped to [0, 1], or None when absent or not a number."""
    try:
        return min(max(float(value) / scale, 0.0), 1.0)
    except (TypeError, ValueError):
        return None


class WorldModel(nn.Module):
    """A small MLP: [s_t, e_t, a_t] -> (s'_t, e'_t), predicted as a change to the current features.

    Residual prediction ("the next screen is this screen plus a change") is the right prior on a
    GUI, where most actions change little; the heads start near zero so an untrained model predicts
    "no change". text_dim=0 drops the text branch (text terms off). Rebuild from `wm.config`.
    """

    def __init__(self, screen_dim=SCREEN_DIM, text_dim=0, hidden=256, screen=(1280, 720)):
        super().__init__()
        self.config = dict(screen_dim=screen_dim, text_dim=text_dim, hidden=hidden, screen=tuple(screen))
        self.screen = tuple(screen)
        d_in = screen_dim + text_dim + ACTION_DIM
        # LayerNorm first: unit-norm features have coordinates ~0.03, action one-hots are 1.
        self.trunk = nn.Sequential(nn.LayerNorm(d_in), nn.Linear(d_in, hidden), nn.GELU(),
                                   nn.Linear(hidden, hidden), nn.GELU())
        self.screen_head = nn.Linear(hidden, screen_dim)
        self.text_head = nn.Linear(hidden, text_dim) if text_dim > 0 else None
        for head in (self.screen_head, self.text_head):
            if head is not None:  # small, not zero: zero weights would give the trunk no gradient
                nn.init.normal_(head.weight, std=0.01 / math.sqrt(hidden))
                nn.init.zeros_(head.bias)

    def forward(self, screen, action_vec, text=None):
        """screen (B, D), action_vec (B, A), text (B, E) or None -> ((B, D), (B, E) or None)."""
        parts = [screen, action_vec] if self.text_head is None else [screen, text, action_vec]
        hid = self.trunk(torch.cat(parts, dim=-1))  # (B, hidden)
        next_screen = screen + self.screen_head(hid)  # (B, D)
        next_text = None if self.text_head is None else text + self.text_head(hid)  # (B, E)
        return next_screen, next_text


def world_model_loss(wm, screen, action_vec, next_screen, text=None, next_text=None):
    """ALGO: squared error summed over features, mean over the batch. The targets are unit vectors
    but the predictions are not normalised (screen + a residual), so this is not 2 - 2 cos: it also
    pulls the prediction's norm towards 1, and the curiosity reward (1 - cos) ignores that norm.
    Both predictions carry their gradient (the release detached its image prediction here)."""
    ps, pt = wm(screen, action_vec, text)  # (B, D), (B, E)
    image = ((ps - next_screen) ** 2).sum(-1).mean()
    txt = ((pt - next_text) ** 2).sum(-1).mean() if pt is not None else torch.zeros(())
    return image + txt, {"wm/image_loss": image.item(), "wm/text_loss": txt.item()}


def train_world_model(wm: WorldModel, optimizer, feats, actions, next_feats, text=None, next_text=None,
                      epochs=3, batch_size=16, max_grad_norm=1.0) -> dict[str, float]:
    """ALGO: `epochs` passes over this iteration's transitions (valid steps only: pass those rows),
    after they were scored (update_and_predict says why). Returns the first/last epoch's mean loss."""
    dev = next(wm.parameters()).device
    s, s2 = feats.to(dev).float(), next_feats.to(dev).float()  # (N, D)
    a = encode_actions(actions, wm.screen).to(dev)  # (N, A)
    e, e2 = (None, None) if wm.text_head is None else (text.to(dev).float(), next_text.to(dev).float())
    wm.train()
    per_epoch = []
    for _ in range(epochs):
        order = torch.randperm(len(s))  # (N,)
        total, parts = 0.0, {}
        for j in range(0, len(s), batch_size):
            b = order[j:j + batch_size]  # (B,)
            loss, parts = world_model_loss(wm, s[b], a[b], s2[b], None if e is None else e[b],
                                           None if e2 is None else e2[b])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wm.parameters(), max_grad_norm)
            optimizer.step()
            total += loss.item() * len(b)
        per_epoch.append(total / max(len(s), 1))
    return {"wm/loss_first_epoch": per_epoch[0] if per_epoch else 0.0,
            "wm/loss": per_epoch[-1] if per_epoch else 0.0, **parts}


@torch.no_grad()
def predict_next(wm: WorldModel, feats, actions, text=None):
    """The world model's guesses of (s'_t, e'_t) for curiosity: ((N, D), (N, E) or None), on the CPU."""
    dev = next(wm.parameters()).device
    wm.eval()
    a = encode_actions(actions, wm.screen).to(dev)  # (N, A)
    e = None if wm.text_head is None else text.to(dev).float()
    ps, pt = wm(feats.to(dev).float(), a, e)  # (N, D), (N, E)
    return ps.cpu(), (None if pt is None else pt.cpu())


def update_and_predict(wm: WorldModel, optimizer, f: StepFeatures, actions: list, valid, epochs=3,
                       batch_size=16, train_first=False):
    """ALGO: curiosity before learning: predict all N transitions with the world model as it stood
    before this iteration, then train it on the valid ones (`epochs` passes).

    train_first=True is the release's order (train, then score the same transitions), kept for
    comparison. It leaks: a transition repeated within one buffer (all desktops start from the same
    screen after a reset, so the same first click happens on several of them) is learned during the
    epochs and has its surprise trained away before it is scored. On synthetic features (tests/
    test_world_model.py) a new transition repeated 8 times scores 0.55 against familiar ones' 0.004 when
    predicted first, and 0.09 against 0.02 when trained first.
    Returns (screen_pred (N, D), text_pred (N, E) or None, metrics)."""
    rows = [k for k, ok in enumerate(valid) if ok]
    text = wm.text_head is not None
    if not train_first:
        pred_s, pred_e = predict_next(wm, f.screen_before, actions, f.text_before if text else None)  # (N, D), (N, E)
    metrics = {}
    if rows:  # a buffer with no valid step has nothing to learn from (and earns 0 anyway)
        metrics = train_world_model(wm, optimizer, f.screen_before[rows], [actions[k] for k in rows],
                                    f.screen_after[rows], f.text_before[rows] if text else None,
                                    f.text_after[rows] if text else None, epochs, batch_size)
    if train_first:
        pred_s, pred_e = predict_next(wm, f.screen_before, actions, f.text_before if text else None)  # (N, D), (N, E)
    return pred_s, pred_e, metrics
