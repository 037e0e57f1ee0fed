"""ScreenExplorer's exploration rewards: the terms and their table, the curiosity world model, the
frozen screen features and OCR text they compare, and the exploration measures of its eval.

Used by train_explore.py; tests: `python -m pytest -q tests/test_rewards.py tests/test_world_model.py`.

Per step t of an episode (before-screen s_t, after-screen s'_t, intent i), every weight 1:

    r_t = format_t * (  [1 - cos(s_t, s'_t)]          image_immediate   } the same three terms again on
                      + [1 - mean S[p<t, q>=t]]       image_sequence    } the OCR-text embeddings e_t, e'_t:
                      + [1 - cos(s'_t, WM(s_t, a_t))] image_world_model } text_immediate/_sequence/_world_model
                      + cos(e_t, i) + cos(e'_t, i)                        intent_before, intent_after
                      + cos(E(OCR text under the click), i) )             intent_click

format_t is 0/1: a malformed answer executes nothing and earns exactly 0 (the trainer scores the
format-valid steps and puts them back among the others: scatter). Each term is one function of the
buffer's N steps (`Buffer`) and one line of the table `TERMS` (name -> function, on in the paper's
reward or not, the --rewards switches that turn it off); the flags, metrics, trajectory lines,
console line and view.py read that table. `all` is the paper's reward, `all,no_world_model` an
ablation, and a term that is off by default joins by name (`all,windows`: + the windows a step
opened, our example of a term that reads more than pixels). This follows the authors' release
(niuzaisheng/ScreenExplorer), not its bugs. The file reads: the reward (Buffer, the terms, TERMS,
reward), curiosity (predict_and_learn), the features; then what they call by name: the screen
features' details, the world model's network, the flags' parsing, the eval's measures. The text
a screen shows (OCR, embeddings, their cache) is ocr.py's.

Where we depart from the paper / release, and why:
1. Screen features: a fixed, never-trained function instead of a pretrained image tokenizer
   (Cosmos latents; none can be downloaded here, and a feature trained beside the world model
   could collapse): grayscale, a 32 x 18 grid of cells, per cell the mean (layout, centred on
   mid-grey so a change weighs by its area: screen_features says why) and the standard deviation
   (texture), plus the global brightness, L2-normalised. Deterministic and cheap; it loses text
   and icons below a cell's size, colour and meaning, which the OCR text terms partly cover.
2. Text: the tesseract CLI and a sentence-transformers embedder (the offline all-MiniLM-L6-v2)
   instead of PaddleOCR and BGE-M3; optional: without them the text and intent terms are off (said
   once). Tesseract reads GUI screens worse than PaddleOCR: those terms are noisier. An
   after-screen is read only where it changed (ocr.py says why and what it costs).
3. The world model: a 3-layer MLP on the features and an action vector built from the Action's
   fields (encode_actions) instead of a fine-tuned Llama-3.2-1B on the action string; every
   parameter is trained (the release detaches its image prediction, so its image branch never
   learns); and curiosity is scored BEFORE it learns the buffer (the release scores after 3
   epochs on that very buffer, when a new transition found on several desktops after a reset has
   lost most of its surprise; tests/test_world_model.py measures it). `train_first=True`
   (train_explore.py --wm-train-first) keeps the release's order.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from actions import ACTION_TYPES, DIRECTIONS  # the action vector's one-hot slots, in the VM protocol's order
from ocr import OcrBox, TextTools, embed_texts, ocr_many, screen_text  # the text the text terms compare



# ---------------------------------------------------------------------------------------------
# The reward of a buffer: what every term reads, the terms, their table, the total


@dataclass
class Buffer:
    """What one buffer of N steps recorded, as every reward term gets it. A term reads the fields it
    needs; a field no term that is on needs may be None (the trainer computes the costly ones, OCR
    text, world-model guesses, window lists, only when a term that is on reads them: Term.reads)."""
    episode_ids: list  # (N,) the episode each step belongs to (its desktop's id); one episode's steps in time order
    format_ok: torch.Tensor  # (N,) float 0/1, the format reward: the answer parsed and its action ran
    screen_before: torch.Tensor  # (N, D) s_t
    screen_after: torch.Tensor  # (N, D) s'_t
    screen_pred: torch.Tensor | None = None  # (N, D) the world model's guess of s'_t
    text_before: torch.Tensor | None = None  # (N, E) e_t
    text_after: torch.Tensor | None = None  # (N, E) e'_t
    text_pred: torch.Tensor | None = None  # (N, E) the world model's guess of e'_t
    intent: torch.Tensor | None = None  # (N, E) i
    click_text: torch.Tensor | None = None  # (N, E) E(OCR text under the click); 0 where no hit
    click_hit: torch.Tensor | None = None  # (N,) bool
    actions: list | None = None  # (N,) the actions that ran (Action or its dict; None: malformed)
    windows_before: list | None = None  # (N,) the windows open before the step, {X window id: title} (GET /windows)
    windows_after: list | None = None  # (N,) the same after it

    def __post_init__(self):
        self.format_ok = torch.as_tensor(self.format_ok, dtype=torch.float32).reshape(len(self.episode_ids))  # (N,)

    def episodes(self) -> list[list[int]]:
        """The rows of each episode's format-valid steps, in time order (a malformed step changed
        nothing, so it is left out of the sequences)."""
        rows: dict = {}
        for k, t in enumerate(self.episode_ids):
            if self.format_ok[k] > 0:
                rows.setdefault(t, []).append(k)
        return list(rows.values())


def make_buffer(f: Features, episode_ids: list, format_ok, **more) -> Buffer:
    """A Buffer from step_features' output; `more`: predictions, actions, window lists."""
    return Buffer(episode_ids, format_ok, f.screen_before, f.screen_after, text_before=f.text_before, text_after=f.text_after,
                 intent=f.intent, click_text=f.click_text, click_hit=f.click_hit, **more)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of (N, D) and (N, D) -> (N,). Clamped to [-1, 1]: float32 rounding
    can put two identical screens a hair above 1, and 1 - cos would then be a negative reward."""
    c = (F.normalize(a.float(), dim=-1, eps=1e-8) * F.normalize(b.float(), dim=-1, eps=1e-8)).sum(-1)  # (N,)
    return c.clamp(-1.0, 1.0)


def sequence_similarity(start: torch.Tensor, afters: torch.Tensor) -> torch.Tensor:
    """seq_t = mean(S[p, q] for p < t, q >= t), t = 1..T, S = cos matrix of X = [s_0, s'_1, ..., s'_T].

    Row/column 0 of S is the trajectory's first before-screen s_0; index t >= 1 is step t's
    after-screen. "p < t" is everything seen before step t acted; "q >= t" is step t's result and
    everything after it (the release's term looks ahead: a step is credited when it starts a run of
    screens unlike all earlier ones). Example, T = 3 (X = [s_0, s'_1, s'_2, s'_3]):
        seq_1 = mean(S01, S02, S03)             rows {0},     cols {1, 2, 3}
        seq_2 = mean(S02, S03, S12, S13)        rows {0, 1},  cols {2, 3}
        seq_3 = mean(S03, S13, S23)             rows {0,1,2}, cols {3}
    start (D,), afters (T, D) -> (T,); the reward is 1 - seq_t.
    """
    x = F.normalize(torch.cat([start[None], afters]).float(), dim=-1, eps=1e-8)  # (T+1, D)
    s = x @ x.T  # (T+1, T+1)
    return torch.stack([s[:t, t:].mean() for t in range(1, len(afters) + 1)])  # (T,)


def _require(x, what, flag):
    if x is None:
        raise ValueError(f"The '{flag}' reward is on but {what} was not given; pass it, or switch the "
                         f"term off with no_{flag} (effective_flags does this when text tools are missing).")
    return x.float().cpu() if isinstance(x, torch.Tensor) else x


def _sequence(s: Buffer, before, after) -> torch.Tensor:
    out = torch.zeros(len(s.episode_ids))  # (N,)
    for rows in s.episodes():
        out[rows] = 1 - sequence_similarity(before[rows[0]], after[rows])  # (T,)
    return out


def image_immediate(s: Buffer) -> torch.Tensor:
    return 1 - cosine(s.screen_before, s.screen_after)  # ALGO: the screen changed


def image_sequence(s: Buffer) -> torch.Tensor:
    return _sequence(s, s.screen_before, s.screen_after)  # ALGO: the trajectory keeps reaching new screens


def image_world_model(s: Buffer) -> torch.Tensor:
    pred = _require(s.screen_pred, "the world model's image prediction", "world_model")
    return 1 - cosine(s.screen_after, pred)  # ALGO: curiosity, the world model was wrong


def text_immediate(s: Buffer) -> torch.Tensor:
    return 1 - cosine(_require(s.text_before, "text before", "text"), _require(s.text_after, "text after", "text"))


def text_sequence(s: Buffer) -> torch.Tensor:
    return _sequence(s, _require(s.text_before, "text before", "text"), _require(s.text_after, "text after", "text"))


def text_world_model(s: Buffer) -> torch.Tensor:
    pred = _require(s.text_pred, "the world model's text prediction", "world_model")
    return 1 - cosine(_require(s.text_after, "text after", "text"), pred)


def intent_before(s: Buffer) -> torch.Tensor:  # ALGO: the intent matches the screen it saw
    return cosine(_require(s.text_before, "text before", "intent"), _require(s.intent, "intent embeddings", "intent"))


def intent_after(s: Buffer) -> torch.Tensor:  # ALGO: ... and the screen it reached
    return cosine(_require(s.text_after, "text after", "intent"), _require(s.intent, "intent embeddings", "intent"))


def intent_click(s: Buffer) -> torch.Tensor:
    """cos(E(OCR text under the click), i) where the click hit an OCR box, else 0."""
    hit = _require(s.click_hit, "click_hit", "intent_click") > 0  # (N,)
    c = cosine(_require(s.click_text, "click text embeddings", "intent_click"),
               _require(s.intent, "intent embeddings", "intent_click"))  # (N,)
    return torch.where(hit, c, torch.zeros(len(s.episode_ids)))  # ALGO: clicked on what it meant to


def windows_opened(s: Buffer) -> torch.Tensor:
    """The number of X windows open after the step that were not open before it (a bonus for
    opening apps, dialogs, menus that are windows). Not in the paper: an example of a term that
    reads what the step recorded besides pixels; the rollout asks GET /windows only when it is on."""
    before = _require(s.windows_before, "the window lists before each step", "windows")
    after = _require(s.windows_after, "the window lists after each step", "windows")
    return torch.tensor([float(len(set(a) - set(b))) for b, a in zip(before, after)])  # (N,)


class Term(NamedTuple):
    fn: Callable[[Buffer], torch.Tensor]  # the N steps -> (N,)
    default: bool  # in the paper's reward, i.e. on with `--rewards all`
    switches: tuple  # the --rewards words that switch it; it is on when all of them are
    reads: tuple = ()  # costly inputs beyond the screen features: "text" (OCR), "world_model", "windows"


# ALGO: the reward. Every term on is summed with weight 1, times the format reward (reward()).
# A new term is a function above and a line here: --rewards, metrics (reward/<name>), trajectory
# lines, the console line and view.py's chart all read this table. Off by default (False), it is
# not part of "--rewards all"; `--rewards all,<switch>` adds it.
TERMS = {
    "image_immediate": Term(image_immediate, True, ("image", "immediate")),
    "image_sequence": Term(image_sequence, True, ("image", "sequence")),
    "image_world_model": Term(image_world_model, True, ("image", "world_model"), ("world_model",)),
    "text_immediate": Term(text_immediate, True, ("text", "immediate"), ("text",)),
    "text_sequence": Term(text_sequence, True, ("text", "sequence"), ("text",)),
    "text_world_model": Term(text_world_model, True, ("text", "world_model"), ("text", "world_model")),
    "intent_before": Term(intent_before, True, ("intent",), ("text",)),
    "intent_after": Term(intent_after, True, ("intent",), ("text",)),
    "intent_click": Term(intent_click, True, ("intent_click",), ("text",)),
    "windows": Term(windows_opened, False, ("windows",), ("windows",)),
}
COMPONENTS = tuple(TERMS)  # every term, in the table's order (logged even when off, as 0)
SWITCHES = tuple(dict.fromkeys(w for t in TERMS.values() for w in t.switches))  # every --rewards word
REWARD_FLAGS = tuple(dict.fromkeys(w for t in TERMS.values() if t.default for w in t.switches))  # "all"


@dataclass
class Rewards:
    """Per-step total, format reward and every term of TERMS, all (N,) float32. A term that is off
    is exactly 0; so is every term of a malformed step (it executed nothing). r.image_immediate
    is r.parts["image_immediate"]."""
    total: torch.Tensor
    format: torch.Tensor
    parts: dict

    def __getattr__(self, name):  # only called for names that are not fields: the terms
        parts = self.__dict__.get("parts") or {}
        if name in parts:
            return parts[name]
        raise AttributeError(name)


def reward(s: Buffer, flags: dict[str, bool]) -> Rewards:
    """ALGO: r_t = format_t * sum of the terms that are on (weights 1), for the N steps of `s`."""
    ok = s.format_ok > 0  # (N,)
    parts = {name: torch.zeros(len(s.episode_ids)) for name in TERMS}  # (N,) each
    for name in terms_on(flags):
        parts[name] = TERMS[name].fn(s).float().cpu() * ok  # a malformed step's screens are not its doing
    total = s.format_ok * sum(parts.values())  # ALGO: weights 1, summed, times the format reward
    return Rewards(total=total, format=s.format_ok, parts=parts)


def zeros(n: int) -> Rewards:
    """The rewards of n steps that earned nothing (none was well formed)."""
    return Rewards(torch.zeros(n), torch.zeros(n), {name: torch.zeros(n) for name in TERMS})  # (n,) each


def scatter(r: Rewards, rows: list[int], n: int) -> Rewards:
    """The rewards of `rows` of a buffer of n steps, put back in place; 0 elsewhere (the rows that
    were not scored: malformed steps, which earn exactly 0 anyway)."""
    def put(x):
        out = torch.zeros(n)  # (n,)
        out[rows] = x
        return out
    return Rewards(put(r.total), put(r.format), {name: put(x) for name, x in r.parts.items()})


# ---------------------------------------------------------------------------------------------
# Curiosity: the world model's guesses before it learns the buffer, then it learns


def predict_and_learn(wm: WorldModel, optimizer, f: Features, actions: list, format_ok, epochs=3,
                       batch_size=16, train_first=False):
    """ALGO: curiosity before learning: predict all N transitions with the world model as it stood
    before this iteration, then train it on the valid ones (`epochs` passes).

    train_first=True is the release's order (train, then score the same transitions), kept for
    comparison. It leaks: a transition repeated within one buffer (all desktops start from the same
    screen after a reset, so the same first click happens on several of them) is learned during the
    epochs and has its surprise trained away before it is scored: on synthetic features a new
    transition repeated 8 times stands far above the familiar ones when predicted first, and barely
    when trained first (tests/test_world_model.py asserts both).
    Returns (screen_pred (N, D), text_pred (N, E) or None, metrics)."""
    rows = [k for k, ok in enumerate(format_ok) if ok]
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


@torch.no_grad()
def predict_next(wm: WorldModel, feats, actions, text=None):
    """The world model's guesses of (s'_t, e'_t) for curiosity: ((N, D), (N, E) or None), on the CPU."""
    dev = next(wm.parameters()).device
    wm.eval()
    a = encode_actions(actions, wm.screen).to(dev)  # (N, A)
    e = None if wm.text_head is None else text.to(dev).float()
    ps, pt = wm(feats.to(dev).float(), a, e)  # (N, D), (N, E)
    return ps.cpu(), (None if pt is None else pt.cpu())


# ---------------------------------------------------------------------------------------------
# The features the terms compare: screens always, OCR text when a term reads it


@dataclass
class Features:
    screen_before: torch.Tensor  # (N, D) s_t
    screen_after: torch.Tensor  # (N, D) s'_t
    text_before: torch.Tensor | None = None  # (N, E) e_t = E("Screen OCR: " + OCR(before))
    text_after: torch.Tensor | None = None  # (N, E) e'_t
    intent: torch.Tensor | None = None  # (N, E) i = E(intent string)
    click_text: torch.Tensor | None = None  # (N, E) E(text under the click); 0 where no hit
    click_hit: torch.Tensor | None = None  # (N,) bool
    ocr_before: list | None = None  # list[list[OcrBox]], kept for the trajectory logs
    ocr_after: list | None = None


def step_features(before: list[Image.Image], after: list[Image.Image], intents: list[str | None],
                  actions: list, tools: TextTools | None = None, workers=None) -> Features:
    """Screen features always; OCR + embeddings too when tools is given (None: text fields None).
    Step k's after-screen is read knowing its before-screen (ocr_many's parents: only where it
    changed), and whatever tools.cache already holds is not computed again."""
    f = Features(screen_features(before), screen_features(after))
    if tools is None:
        return f
    n = len(before)
    # images 0..n-1 the before-screens, n..2n-1 the after-screens; after k's parent is before k
    boxes = ocr_many(tools, list(before) + list(after), parents=[None] * n + list(range(n)), workers=workers)
    f.ocr_before, f.ocr_after = boxes[:n], boxes[n:]
    hits = [click_text(a, b) for a, b in zip(actions, f.ocr_before)]
    hit_rows = [k for k, h in enumerate(hits) if h is not None]
    # One embedder call for everything: screens before, screens after, intents, click texts.
    texts = [screen_text(b) for b in boxes] + [s or "" for s in intents] + [hits[k] for k in hit_rows]
    e = embed_texts(tools, texts)  # (2N + N + H, E)
    f.text_before, f.text_after, f.intent = e[:n], e[n:2 * n], e[2 * n:3 * n]  # (N, E) each
    f.click_text = torch.zeros(n, tools.dim)  # (N, E)
    f.click_text[hit_rows] = e[3 * n:]
    f.click_hit = torch.zeros(n, dtype=torch.bool)  # (N,)
    f.click_hit[hit_rows] = True
    return f


# ---------------------------------------------------------------------------------------------
# Below: what the above calls by name. The frozen screen features (see the module docstring
# for why a fixed patch grid)


# Ours: cells of 40 x 40 px, about one desktop icon or a menu entry's height on a 1280 x 720 screen
# (smaller cells only add noise to a flat background); untuned beyond that.
SCREEN_GRID = (32, 18)  # (cells across, cells down); 40 x 40 px cells on a 1280 x 720 screen
_CELL = 8  # each cell is averaged from 8 x 8 pixels of the downsampled image (for its std)
SCREEN_DIM = 2 * SCREEN_GRID[0] * SCREEN_GRID[1] + 1  # means + stds + global brightness = 1153


def screen_features(images: list[Image.Image]) -> torch.Tensor:
    """(N, SCREEN_DIM) float32, unit-norm rows; deterministic and never trained."""
    gw, gh = SCREEN_GRID
    rows = [np.zeros(SCREEN_DIM)] if not images else []  # keeps np.stack happy; sliced off below
    for img in images:
        # One BOX resize to 256 x 144 does the heavy lifting; any screen
        # size or aspect ratio maps onto the same grid, so D does not depend on the desktop.
        g = img.convert("L").resize((gw * _CELL, gh * _CELL), Image.BOX)
        a = np.asarray(g, dtype=np.float32) / 255.0  # (gh*8, gw*8)
        cells = a.reshape(gh, _CELL, gw, _CELL)  # (gh, 8, gw, 8)
        mean = cells.mean(axis=(1, 3))  # (gh, gw) layout
        std = cells.std(axis=(1, 3))  # (gh, gw) texture
        # The means are centred on mid-grey: raw intensities are all positive, so any two screens
        # would have cos ~0.9 and every reward would be tiny. Mid-grey, not the screen's own
        # average, so that a change counts by the area it covers: a desktop is mostly one flat
        # background, which self-centring makes ~0, leaving the few icons to carry the norm and
        # any small thing drawn there a large share of it. On a black screen one 40 px cell
        # turning white is a change (1 - cos) of 0.55 self-centred and 0.0035 here; a quarter of
        # the screen 0.98 and 0.50 (tests/test_rewards.py). On the desktop, self-centring paid a
        # right-click menu almost what it paid an app's window, and the explore bench then learned
        # menus (bench/reward_steps.py prints what each kind of step is paid; docs/log.md).
        # The stds stay raw (0 on flat areas); the brightness number is the grey-centred average.
        v = np.concatenate([(mean - 0.5).ravel(), std.ravel(), [mean.mean() - 0.5]])  # (SCREEN_DIM,)
        rows.append(v / max(np.linalg.norm(v), 1e-8))
    return torch.from_numpy(np.stack(rows).astype(np.float32))[:len(images)]  # (N, D)


CLICK_TYPES = ("click", "double_click", "right_click")  # the release's click-like actions


def action_fields(action) -> dict:
    """An actions.Action, its dict, or None -> a dict (duck-typed so this file needs nothing from env.py)."""
    if action is None:
        return {}
    if isinstance(action, dict):
        return action
    return action.to_dict() if hasattr(action, "to_dict") else dict(vars(action))


def click_text(action, boxes: list[OcrBox]) -> str | None:
    """The text of every before-screen OCR box the click lands in, or None when it hits none."""
    a = action_fields(action)
    if a.get("type") not in CLICK_TYPES or a.get("x") is None or a.get("y") is None:
        return None
    hit = [b.text for b in boxes if b.x0 <= a["x"] <= b.x1 and b.y0 <= a["y"] <= b.y1]
    return "Screen OCR: " + " ".join(hit) if hit else None


# ---------------------------------------------------------------------------------------------
# The world model's network: (s_t, e_t, a_t) -> (s'_t, e'_t), and its training


# Ours, untuned: the action vector's resolution (HEAT_GRID: 80 px cells at 1280 x 720) and its bag of
# typed text (TEXT_BUCKETS: few collisions for the handful of key names and words a step types).
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
    """ALGO: `epochs` passes over this iteration's transitions (valid steps only: pass those rows);
    predict_and_learn calls it after they were scored (or before, with train_first: it says why).
    Returns the first and the last epoch's mean loss."""
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


# ---------------------------------------------------------------------------------------------
# Flags: which terms are on. The paper's terms sit on two axes, as in the release: a modality
# (image, text) times a kind (immediate, sequence, world_model), plus the two intent switches.


def parse_reward_flags(spec: str = "all") -> dict[str, bool]:
    """'all' | 'none' | comma list of switches and no_<switch>, applied left to right.

    'all' is the paper's reward (every switch of a default term on); 'all,no_world_model' ->
    everything but curiosity; 'none,image,immediate' -> only the visual immediate term (image AND
    immediate must both be on for it to count); 'all,windows' adds the windows term. A switch
    that is not in the dict is off (so 'all' holds exactly the paper's switches)."""
    flags = dict.fromkeys(REWARD_FLAGS, True)
    for word in (w.strip().lower() for w in (spec or "all").split(",")):
        name, value = (word[3:], False) if word.startswith("no_") else (word, True)
        if word in ("", "all"):
            flags = dict.fromkeys(REWARD_FLAGS, True)
        elif word == "none":
            flags = dict.fromkeys(REWARD_FLAGS, False)
        elif name in SWITCHES:
            flags[name] = value
        else:
            raise ValueError(f"Unknown reward component '{word}' in '{spec}'; use all, none, or "
                             f"names from {', '.join(SWITCHES)} (each optionally prefixed no_).")
    return flags


def terms_on(flags: dict[str, bool]) -> list[str]:
    """The names of the terms whose every switch is on."""
    return [name for name, t in TERMS.items() if all(flags.get(w, False) for w in t.switches)]


def reads(flags: dict[str, bool]) -> set[str]:
    """The costly inputs the terms that are on read ("text", "world_model", "windows")."""
    return {x for name in terms_on(flags) for x in TERMS[name].reads}


def effective_flags(flags: dict[str, bool], tools) -> dict[str, bool]:
    """The flags actually usable: without text tools (tools is None) every switch that only
    switches terms reading OCR text is off (text, intent, intent_click)."""
    if tools is not None or "text" not in reads(flags):
        return dict(flags)
    text_only = [w for w in SWITCHES if all("text" in t.reads for t in TERMS.values() if w in t.switches)]
    return {**flags, **{w: False for w in text_only if w in flags}}


def exploration_rewards(flags: dict[str, bool], episode_ids: list, format_ok, screen_before: torch.Tensor,
                        screen_after: torch.Tensor, screen_pred: torch.Tensor | None = None,
                        text_before=None, text_after=None, text_pred=None, intent=None,
                        click_text=None, click_hit=None, **more) -> Rewards:
    """reward() with the buffer's fields as arguments (episode_ids, format_ok, then the tensors)."""
    return reward(Buffer(episode_ids, format_ok, screen_before, screen_after, screen_pred, text_before, text_after,
                        text_pred, intent, click_text, click_hit, **more), flags)


def cat(rs: list[Rewards]) -> Rewards:
    """Several buffers' rewards as one (every rank's, in rank order), (sum of N,) each."""
    return Rewards(torch.cat([r.total for r in rs]), torch.cat([r.format for r in rs]),
                   {name: torch.cat([r.parts[name] for r in rs]) for name in rs[0].parts})


def summarize_rewards(r: Rewards) -> dict[str, float]:
    """Means for metrics.jsonl: total over all steps, terms over the valid ones, format rate."""
    ok = r.format > 0
    out = {"reward/total": r.total.mean().item(), "reward/format": r.format.mean().item()}
    for name, x in r.parts.items():
        out[f"reward/{name}"] = x[ok].mean().item() if bool(ok.any()) else 0.0
    return out


# ---------------------------------------------------------------------------------------------
# Exploration measures (train_explore.py --eval-only): what exploring means, which the reward never
# sees. Per episode: the format rate, the immediate and sequence image terms per step, distinct
# screens (a 64-bit perceptual hash, dHash; and feature clusters), the mean pairwise diversity of
# its distinct screens, and the windows it opened.


def dhash(img: Image.Image) -> int:
    """ALGO: the screen's 64-bit perceptual hash (dHash): grayscale, box-averaged down to 9 x 8
    pixels; bit k (row by row, the first bit highest) = pixel k+1 of its row is brighter than pixel k.
    It sees layout (a window, a menu), not detail: typing in a terminal keeps the hash."""
    a = np.asarray(img.convert("L").resize((9, 8), Image.BOX), dtype=np.int16)  # (8, 9)
    bits = (a[:, 1:] > a[:, :-1]).ravel()  # (64,)
    return sum(1 << (63 - k) for k, b in enumerate(bits) if b)


def hash_leaders(hashes: list[int], max_bits: int) -> list[int]:
    """ALGO: greedy leader clustering by Hamming distance: a screen is new when its hash differs
    from every earlier leader's in more than `max_bits` bits. Returns the leaders' indices."""
    leaders = []
    for k, h in enumerate(hashes):
        if all((h ^ hashes[j]).bit_count() > max_bits for j in leaders):
            leaders.append(k)
    return leaders


def distinct_screens(feats: torch.Tensor, same: float) -> int:
    """ALGO: greedy leader clustering of unit feature rows (N, D): a screen is new when its cosine
    to every earlier cluster leader is below `same`. Returns the number of clusters."""
    leaders = []
    for row in feats:
        if not leaders or float((torch.stack(leaders) @ row).max()) < same:
            leaders.append(row)
    return len(leaders)


def pairwise_diversity(feats: torch.Tensor) -> float:
    """ALGO: mean of 1 - cos over all pairs p < q of unit feature rows (N, D); 0 with fewer than 2."""
    n = len(feats)
    if n < 2:
        return 0.0
    sim = feats @ feats.T  # (N, N) cosines (unit rows)
    iu = torch.triu_indices(n, n, offset=1)  # (2, N(N-1)/2) every pair once
    return float((1 - sim[iu[0], iu[1]]).mean())


def opened_windows(windows_before: list, windows_after: list) -> dict:
    """{X window id: title} of the windows seen after some step of an episode (its steps' window
    lists, in order) that were not open at its start (the first title a window was seen with)."""
    start, opened = windows_before[0] or {}, {}
    for after in windows_after:
        for wid, title in (after or {}).items():
            if wid not in start and wid not in opened:
                opened[wid] = title
    return opened


def episode_measures(befores: list[Image.Image], afters: list[Image.Image], format_ok: list[bool],
                     windows_before: list, windows_after: list, same_hash: int, same_screen: float) -> dict:
    """One eval episode (its steps in order): format rate, immediate visual change and sequence
    diversity per step (the image terms, 0 on format failures); over its screens [s_0, s'_1, ...,
    s'_T]: distinct screens (perceptual hash, <= same_hash bits apart = one screen; and feature
    clusters, cosine >= same_screen = one screen), the mean pairwise diversity of the distinct
    ones; windows: how many it opened (opened_windows)."""
    flags = parse_reward_flags("none,image,immediate,sequence")
    sb, sa = screen_features(befores), screen_features(afters)  # (T, D) each
    r = reward(Buffer([0] * len(befores), format_ok, sb, sa), flags)
    screens = torch.cat([sb[:1], sa])  # (T + 1, D): s_0, s'_1 .. s'_T
    hashes = [dhash(im) for im in [befores[0]] + list(afters)]
    lead = hash_leaders(hashes, same_hash)
    windows = opened_windows(windows_before, windows_after)
    return {"steps": len(befores), "format": float(r.format.mean()),
            "immediate": float(r.image_immediate.mean()), "sequence": float(r.image_sequence.mean()),
            "distinct_screens": len(lead), "distinct_screens_feat": distinct_screens(screens, same_screen),
            "diversity": pairwise_diversity(screens[lead]), "windows": len(windows),
            "window_titles": [windows[k] for k in sorted(windows)], "hashes": [f"{h:016x}" for h in hashes]}
