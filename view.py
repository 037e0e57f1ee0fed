"""view.py: a run folder -> one static HTML report of what the agent saw, did and earned.

    python view.py runs/<name>                  # writes runs/<name>/report.html (screenshots linked in place)
    python view.py runs/<name> --out /tmp/rep   # /tmp/rep/report.html + copies of the screenshots it shows
    python view.py runs/<name> --last 5 --open  # only the last 5 iterations' trajectories; open a browser

The report is one HTML file with no server, no CDN and no JS library: the screenshots are plain
<img> tags; the action of each step is an inline SVG drawn over its screenshot in screen pixels
(click marker, drag arrow, scroll arrow, typed text, key badge), so the PNGs stay untouched; the
training curves are inline SVG drawn by `chart_svg` below (no matplotlib). ~40 lines of inline
vanilla JS give the iteration and VM selectors (also as the URL hash, `report.html#it=all&vm=0`)
and count what is shown into <body data-steps-shown data-img-loaded ...> (the test reads those).

Both run types are read (detected from args.json, else from the metrics and trajectory keys):
- train_explore.py: per step the intent, the action, the total reward, the advantage and every reward
  component (rewards.py's names); curves of reward/*, wm/*, actor/* and the rest of metrics.jsonl.
- train_arpo.py: per step the thought and the action, per episode the task, its instruction and its
  final line (end, score, standard score, format penalty, reward); curves of reward_mean,
  success_rate, actor/kl, actor/clip_* and the rest; replay injections in the iteration header.
  Metric lines of ARPO runs written before the shared vocabulary (kl, time_total, ...) are read
  under today's names (ARPO_KEYS).
A run killed mid-iteration is shown as far as it got: a torn metrics line or trajectory line is
skipped, a missing screenshot becomes a grey box (the action is still drawn on it), PNGs without a
trajectory line are shown as bare steps. Nothing about the papers here: this file is plumbing.
"""
import argparse
import html
import json
import math
import os
import re
import shutil
import struct
import sys
import webbrowser

# -----------------------------------------------------------------------------------------------
# Reading a run (every reader tolerates torn, missing and odd files: a run may still be writing)


def read_jsonl(path: str) -> list[dict]:
    """The JSON object lines of a file; blank, torn or non-object lines are skipped."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if isinstance(d, dict):
                    out.append(d)
    except OSError:
        pass
    return out


def png_size(path: str) -> tuple[int, int] | None:
    """(w, h) from a PNG's IHDR header (24 bytes read; no image library needed), None if not a PNG."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    w, h = struct.unpack(">II", head[16:24])
    return (w, h) if w > 0 and h > 0 else None


def load_trajectories(run: str) -> dict:
    """{iteration: {vm: {"steps": [step dicts], "final": dict | None}}} from trajectories/itN/vmK.jsonl.

    A step dict is the trajectory line as written (plus "screenshot" when a PNG was saved);
    ARPO's last line ({"final": true, ...}) goes to "final". PNGs no line names become bare steps."""
    root, out = os.path.join(run, "trajectories"), {}
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        m = re.fullmatch(r"it(\d+)", d)
        if not m or not os.path.isdir(os.path.join(root, d)):
            continue
        it, names = int(m.group(1)), sorted(os.listdir(os.path.join(root, d)))
        vms = {}
        for name in names:
            v = re.fullmatch(r"vm(\d+)\.jsonl", name)
            if v:
                lines = read_jsonl(os.path.join(root, d, name))
                vms[int(v.group(1))] = {"steps": [x for x in lines if not x.get("final")],
                                        "final": next((x for x in lines if x.get("final")), None)}
        for name in names:  # screenshots whose line never got written (killed mid-save)
            v = re.fullmatch(r"vm(\d+)_step(\d+)\.png", name)
            if v:
                traj = vms.setdefault(int(v.group(1)), {"steps": [], "final": None})
                if name not in {s.get("screenshot") for s in traj["steps"]}:
                    traj["steps"].append({"step": int(v.group(2)), "screenshot": name, "orphan": True})
        for traj in vms.values():
            traj["steps"].sort(key=lambda s: s.get("step") if isinstance(s.get("step"), int) else 0)
        if vms:
            out[it] = dict(sorted(vms.items()))
    return out


def run_kind(args: dict, metrics: list[dict], trajs: dict) -> str:
    """'explore' (train_explore.py), 'arpo' (train_arpo.py) or 'unknown'."""
    if "group_size" in args or "tasks" in args:
        return "arpo"
    if "rewards" in args or "wm_epochs" in args:
        return "explore"
    keys = {k for m in metrics for k in m}
    if "success_rate" in keys or any(t["final"] for vms in trajs.values() for t in vms.values()):
        return "arpo"
    if "reward/total" in keys or any("rewards" in s for vms in trajs.values() for t in vms.values()
                                     for s in t["steps"]):
        return "explore"
    return "unknown"


# Metric names of older runs (train_arpo.py's before both scripts shared one vocabulary, and
# train_explore.py's time/generate) -> today's names
ARPO_KEYS = {**{k: f"actor/{k}" for k in ("loss", "pg_loss", "kl", "clip_low", "clip_high", "clip_dual", "ratio_mean",
                                          "grad_norm", "tokens", "lr", "logp_gap")},
             **{f"time_{k}": f"time/{k}" for k in ("reset", "generation", "env", "evaluate", "update", "save")},
             "time_total": "time/iteration",
             "time/generate": "time/generation",  # train_explore.py's name before rollout.py
             "zero_std_groups": "flat_groups"}  # train_arpo.py's name for groups with no learning signal


def load_run(run: str) -> dict:
    """Everything the report shows, from the run folder; one sentence if it is not a run folder."""
    if not os.path.isdir(run):
        raise SystemExit(f"{run}: no such folder; pass a run folder such as runs/<name>.")
    try:
        with open(os.path.join(run, "args.json")) as f:
            args = json.load(f)
        args = args if isinstance(args, dict) else {}
    except (OSError, ValueError):
        args = {}
    metrics = [{ARPO_KEYS.get(k, k): x for k, x in m.items()} for m in read_jsonl(os.path.join(run, "metrics.jsonl"))]
    trajs = load_trajectories(run)
    if not args and not metrics and not trajs:
        raise SystemExit(f"{run} holds no args.json, metrics.jsonl or trajectories/; pass a folder a train script wrote.")
    return {"name": os.path.basename(os.path.abspath(run)), "path": run, "args": args, "metrics": metrics,
            "trajectories": trajs, "kind": run_kind(args, metrics, trajs)}


# -----------------------------------------------------------------------------------------------
# Actions drawn over a screenshot: SVG in screen pixels (the overlay's viewBox is the screen)

COLORS = {"click": "#ff3b30", "double_click": "#ff9500", "right_click": "#af52de", "move": "#0a84ff",
          "drag": "#34c759", "scroll": "#00c7be", "type": "#ffcc00", "key": "#1c1c1e"}


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def esc(s) -> str:
    """HTML-escaped text; control characters (random-model output is full of them) shown as U+FFFD."""
    return html.escape(re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "\ufffd", str(s)))


def _label(x, y, text: str, u: float, w: int, color: str = "#fff") -> str:
    """Text next to (x, y), outlined so it reads on any screen, kept inside the image."""
    anchor, dx = ("end", -2.2 * u) if x > 0.7 * w else ("start", 2.2 * u)
    return (f'<text x="{x + dx:.0f}" y="{max(y - 1.2 * u, 2.2 * u):.0f}" text-anchor="{anchor}" font-size="{2 * u:.0f}" '
            f'fill="{color}" stroke="#000" stroke-width="{0.4 * u:.1f}" paint-order="stroke">{esc(text)}</text>')


def _badge(text: str, u: float, color: str, row: int = 0) -> str:
    """A filled box with white text in the top-left corner (key combos, done/fail/wait, no action)."""
    fs, pad = 2.2 * u, 0.7 * u
    bw, y = len(text) * fs * 0.62 + 2 * pad, u + row * (fs + 2.5 * pad)
    return (f'<rect x="{u:.0f}" y="{y:.0f}" width="{bw:.0f}" height="{fs + 2 * pad:.0f}" rx="{pad:.0f}" fill="{color}" '
            f'fill-opacity="0.85" stroke="#fff" stroke-width="{0.2 * u:.1f}"/>'
            f'<text x="{u + pad:.0f}" y="{y + pad + 0.82 * fs:.0f}" font-size="{fs:.0f}" fill="#fff" '
            f'font-family="monospace">{esc(text)}</text>')


def _arrow(x1, y1, x2, y2, u: float, color: str) -> str:
    """A line with a filled head at (x2, y2); the head is computed here, so no <marker> ids clash."""
    ang, hl = math.atan2(y2 - y1, x2 - x1), 2.5 * u
    pts = [(x2, y2)] + [(x2 - hl * math.cos(ang + s), y2 - hl * math.sin(ang + s)) for s in (0.45, -0.45)]
    return (f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}" stroke-width="{0.6 * u:.1f}"/>'
            f'<polygon points="{" ".join(f"{a:.0f},{b:.0f}" for a, b in pts)}" fill="{color}"/>')


def _marker(x, y, u: float, color: str, hollow=False, double=False) -> str:
    """A target: ring + centre dot (hollow for a move, two rings for a double click)."""
    rings = (1.8, 2.8) if double else (1.8,)
    out = "".join(f'<circle cx="{x:.0f}" cy="{y:.0f}" r="{k * u:.0f}" fill="none" stroke="{color}" '
                  f'stroke-width="{0.5 * u:.1f}"/>' for k in rings)
    return out + ("" if hollow else f'<circle cx="{x:.0f}" cy="{y:.0f}" r="{0.5 * u:.1f}" fill="{color}"/>')


def action_svg(action, w: int, h: int) -> str:
    """The step's action as SVG shapes for an overlay with viewBox "0 0 w h" (screen pixels).
    One <g class="act" data-type="..."> per step; None (a format failure) is a red badge."""
    u = max(w, h) / 100  # one unit = 1% of the longer side: 12.8 px on a 1280x720 screen
    if not isinstance(action, dict) or action.get("type") not in COLORS.keys() | {"wait", "done", "fail"}:
        return f'<g class="act" data-type="none">{_badge("no action (format failure)", u, "#d70015")}</g>'
    t, c = action["type"], COLORS.get(action["type"], "#636366")
    x, y, x2, y2 = (_num(action.get(k)) for k in ("x", "y", "x2", "y2"))
    body = ""
    if t in ("click", "double_click", "right_click", "move") and x is not None and y is not None:
        body = _marker(x, y, u, c, hollow=t == "move", double=t == "double_click") + _label(x, y, t.replace("_", " "), u, w)
    elif t == "drag" and None not in (x, y, x2, y2):
        body = _marker(x, y, u, c, hollow=True) + _arrow(x, y, x2, y2, u, c) + _label(x, y, "drag", u, w)
    elif t == "scroll":
        cx, cy = (x, y) if x is not None and y is not None else (w / 2, h / 2)
        cx, cy = min(max(cx, 3 * u), w - 3 * u), min(max(cy, 3 * u), h - 3 * u)  # a point on the edge: arrow inside
        dx, dy = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}.get(action.get("direction"), (0, 1))
        n = _num(action.get("amount"))
        body = (_arrow(cx, cy, cx + dx * 10 * u, cy + dy * 10 * u, u, c)
                + _label(cx, cy, f"scroll {action.get('direction', '?')}" + (f" x{n:g}" if n else ""), u, w))
    elif t == "type":
        text = str(action.get("text", ""))
        shown = '"' + (text[:40] + "..." if len(text) > 40 else text) + '"'
        body = (_marker(x, y, u, c) + _label(x, y, shown, u, w, c)) if x is not None and y is not None else _badge(
            "type " + shown, u, "#8a6d00")
    elif t == "key":
        keys = action.get("keys")
        body = _badge("+".join(map(str, keys)) if isinstance(keys, list) else str(keys), u, c)
    else:  # wait / done / fail, or a pointer action without coordinates (it acts where the pointer is)
        body = _badge(t.replace("_", " ") + (f" {action['amount']}s" if _num(action.get("amount")) else ""), u,
                      {"done": "#248a3d", "fail": "#d70015"}.get(t, "#636366"))
    if action.get("refused"):  # ARPO: the VM refused the action (it counted as a format failure)
        body += _badge(f"refused: {str(action['refused'])[:60]}", u, "#d70015", row=1)
    return f'<g class="act" data-type="{esc(t)}">{body}</g>'


# -----------------------------------------------------------------------------------------------
# Training curves: inline SVG line charts (several series per chart, shared axes)

# Where an iteration's time goes (rollout.py's vocabulary): the learner computing or idle, and the
# desktops that failed; both trainers log these.
TIME = [("seconds: iteration, learner computing (generation, update) and idle (VM wait)",
         ["time/iteration", "time/generation", "time/update", "time/vm_wait"]),
        ("learner idle share (VM wait)", ["vm_wait_share"]), ("environment failures", ["env_failures"]),
        ("settle: mean seconds after an action, share that hit the watch's cap", ["settle/seconds", "settle/capped"])]
# The charts a reader wants first, by run type: (title, metric keys); every other number follows.
HEADLINE = {
    "explore": [("total reward", ["reward/total"]), ("format reward", ["reward/format"]),
                ("reward components", ["reward/*"]),  # every reward/<term> the run logged (rewards.TERMS)
                ("world-model loss", ["wm/loss", "wm/loss_first_epoch"]), ("KL to the start", ["actor/kl"]),
                ("clip fraction", ["actor/clip_low", "actor/clip_high", "actor/clip_dual"]), ("policy loss", ["actor/loss"]),
                *TIME],
    "arpo": [("reward (score - format penalty)", ["reward_mean", "score_mean"]), ("success rate", ["success_rate"]),
             ("format rate", ["format_rate"]), ("KL to the start", ["actor/kl"]),
             ("clip fraction", ["actor/clip_low", "actor/clip_high", "actor/clip_dual"]),
             ("replay", ["n_injections", "flat_groups", "replay_size"]), ("policy loss", ["actor/loss"]), *TIME],
}
PALETTE = ["#0a84ff", "#ff3b30", "#34c759", "#ff9500", "#af52de", "#00c7be", "#ffcc00", "#8e8e93", "#5e5ce6"]


def numeric_series(metrics: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{key: [(iteration, value)]} for every finite number in the metric lines (nested dicts as a/b)."""
    out = {}

    def walk(d, prefix, it):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/", it)
            elif _num(v) is not None and f"{prefix}{k}" != "iteration":
                out.setdefault(f"{prefix}{k}", []).append((it, float(v)))
    for i, m in enumerate(metrics):
        walk(m, "", _num(m.get("iteration")) if _num(m.get("iteration")) is not None else i)
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-2) else f"{v:.4g}"


def chart_svg(title: str, series: dict, w: int = 340, h: int = 170) -> str:
    """One line chart; series = {label: [(x, y)]}. Each line is a <path class="curve" data-key=...>."""
    pts = [p for s in series.values() for p in s]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 - y0 < 1e-12:  # a flat line sits in the middle, not on the frame
        y0, y1 = y0 - 1, y1 + 1
    L, R, T, B = 46, 8, 22, 22  # plot margins: y labels left, title top, x labels bottom
    sx = lambda x: L + (x - x0) / (x1 - x0) * (w - L - R) if x1 > x0 else (L + w - R) / 2  # noqa: E731
    sy = lambda y: h - B - (y - y0) / (y1 - y0) * (h - T - B)  # noqa: E731
    out = [f'<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">',
           f'<text x="{L}" y="14" font-size="12" font-weight="bold">{esc(title)}</text>',
           f'<rect x="{L}" y="{T}" width="{w - L - R}" height="{h - T - B}" fill="#fafafa" stroke="#ccc"/>']
    for v in (y0, y1):
        out.append(f'<text x="{L - 4}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{_fmt(v)}</text>')
    for v, a in ((x0, "start"), (x1, "end")) if x1 > x0 else ((x0, "middle"),):
        out.append(f'<text x="{sx(v):.1f}" y="{h - 6}" font-size="10" text-anchor="{a}">it {v:g}</text>')
    for k, (name, s) in enumerate(series.items()):
        c = PALETTE[k % len(PALETTE)]
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(s))
        if len(s) == 1:
            d += " l0,0"  # a lone point: the round cap draws it as a dot
        out.append(f'<path class="curve" data-key="{esc(name)}" data-points="{len(s)}" d="{d}" fill="none" '
                   f'stroke="{c}" stroke-width="2" stroke-linecap="round" stroke-linejoin="round"/>')
        if len(s) <= 60:  # hover a point for its exact value (no JS: an SVG <title> is a tooltip)
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"><title>{esc(name)} it {x:g}: '
                    f'{_fmt(y)}</title></circle>' for x, y in s]
    # Several series with one prefix ("reward/..."): the legend drops it, the title already says it.
    head, slash, _ = os.path.commonprefix(list(series)).rpartition("/")
    cut = len(head + slash) if len(series) > 1 else 0
    legend = "".join(f'<span><i style="background:{PALETTE[k % len(PALETTE)]}"></i>{esc(n[cut:])} '
                     f'<b>{_fmt(s[-1][1])}</b></span>' for k, (n, s) in enumerate(series.items()))
    return f'<figure>{"".join(out)}</svg><figcaption>{legend}</figcaption></figure>'


def headline(kind: str, have) -> list[tuple[str, list[str]]]:
    """HEADLINE of this run type with "prefix/*" spelled out: every key of `have` (in its order)
    under that prefix that no other headline chart names. So the reward terms a run logged
    (reward/<term>, whatever rewards.TERMS held when it ran) are charted without a list here."""
    named = {k for _, keys in HEADLINE.get(kind, []) for k in keys}
    return [(title, [x for k in keys for x in ([h for h in have if h.startswith(k[:-1]) and h not in named]
                                               if k.endswith("/*") else [k])])
            for title, keys in HEADLINE.get(kind, [])]


def charts_html(kind: str, metrics: list[dict]) -> str:
    """The headline charts of this run type, then one chart per remaining numeric metric (folded)."""
    series = numeric_series(metrics)
    if not series:
        return '<p class="empty">No metrics yet (metrics.jsonl gets one line per finished iteration).</p>'
    head, used = [], set()
    for title, keys in headline(kind, series):
        s = {k: series[k] for k in keys if k in series}
        used.update(keys)
        if s:
            head.append(chart_svg(title, s))
    rest = [chart_svg(k, {k: v}) for k, v in sorted(series.items()) if k not in used]
    return (f'<div class="charts">{"".join(head)}</div>'
            f'<details><summary>every other metric ({len(rest)})</summary><div class="charts">{"".join(rest)}</div></details>')


# -----------------------------------------------------------------------------------------------
# Steps and trajectories as HTML


def _kv_table(rows: list[tuple[str, object]], cls: str = "kv") -> str:
    cells = []
    for k, v in rows:
        n = _num(v)
        zero = ' class="zero"' if n == 0 else ""
        cells.append(f"<tr{zero}><th>{esc(k)}</th><td>{esc(_fmt(n) if n is not None else v)}</td></tr>")
    return f'<table class="{cls}">{"".join(cells)}</table>'


def step_html(step: dict, img_src: str | None, size: tuple[int, int], kind: str) -> str:
    """One step: the screenshot with the action drawn over it, and beside it what the model said and earned."""
    w, h = size
    shot = (f'<img data-src="{esc(img_src)}" alt="step {esc(step.get("step", "?"))}" decoding="sync" width="{w}" height="{h}">'
            if img_src else f'<div class="noshot" style="aspect-ratio:{w}/{h}">screenshot missing</div>')
    overlay = (f'<svg class="overlay" viewBox="0 0 {w} {h}" preserveAspectRatio="none">'
               f'{action_svg(step.get("action"), w, h)}</svg>') if not step.get("orphan") else ""
    said = step.get("intent") if kind != "arpo" else step.get("thought")
    info = [f'<h4>step {esc(step.get("step", "?"))}</h4>']
    if step.get("orphan"):
        info.append('<p class="warn">no trajectory line for this screenshot (the run stopped while saving)</p>')
    else:
        info.append(f'<p class="said"><b>{"thought" if kind == "arpo" else "intent"}:</b> {esc(said) if said else "<i>-</i>"}</p>')
        act = step.get("action")
        info.append(f'<p><b>action:</b> <code>{esc(json.dumps(act)) if act else "none (the answer did not parse)"}</code></p>')
        if step.get("error"):
            info.append(f'<p class="warn">the VM refused it: {esc(step["error"])}</p>')
        if isinstance(step.get("rewards"), dict):  # train_explore.py: total, advantage, every component
            rows = [("reward (total)", step.get("reward")), ("advantage", step.get("advantage"))]
            info.append(_kv_table(rows + list(step["rewards"].items())))
        elif "format_ok" in step:  # train_arpo.py: the score comes once per episode, in its final line
            info.append(f'<p><b>format ok:</b> {esc(step["format_ok"])}</p>')
        if step.get("text"):
            info.append(f'<details><summary>raw answer</summary><pre>{esc(step["text"])}</pre></details>')
    return (f'<div class="step"><div class="shot">{shot}{overlay}</div>'
            f'<div class="info">{"".join(info)}</div></div>')


def _screenshot_size(run: str, folder: str, step: dict, default: tuple[int, int]) -> tuple[tuple[int, int], bool]:
    """(w, h) of the step's screenshot and whether its file exists; the overlay's viewBox is that size."""
    name = step.get("screenshot")
    size = png_size(os.path.join(run, folder, name)) if isinstance(name, str) else None
    if size:
        return size, True
    s = step.get("screen")
    if isinstance(s, list) and len(s) == 2 and all(_num(v) for v in s):
        return (int(s[0]), int(s[1])), False
    return default, False


def trajectory_html(run: str, it: int, vm: int, traj: dict, kind: str, default: tuple, images: list) -> str:
    """One VM's episode of one iteration; appends (run-relative path) of each screenshot it shows to `images`."""
    folder = os.path.join("trajectories", f"it{it:06d}")
    steps = []
    for s in traj["steps"]:
        size, exists = _screenshot_size(run, folder, s, default)
        rel = f"{folder}/{s['screenshot']}" if exists else None
        if rel:
            images.append(rel)
        steps.append(step_html(s, rel, size, kind))
    fin, head = traj["final"], [f"vm {vm}", f"{len(traj['steps'])} steps"]
    task = fin or next((s for s in traj["steps"] if s.get("task")), {})
    if task.get("task"):
        head.append(f'task <b>{esc(task["task"])}</b>' + (f' ({esc(task["domain"])})' if task.get("domain") else ""))
    rewards = [_num(s.get("reward")) for s in traj["steps"] if _num(s.get("reward")) is not None]
    if rewards:
        head.append(f"reward sum {_fmt(sum(rewards))}")
    foot = ""
    if fin:
        good = (_num(fin.get("score")) or 0) > 0.1
        head.append(f'<span class="{"good" if good else "bad"}">score {_fmt(_num(fin.get("score")) or 0)}</span>')
        foot = ('<div class="final"><b>episode end</b>' + _kv_table(
            [(k, fin.get(k)) for k in ("end", "score", "score_standard", "format_penalty", "reward", "group", "error")
             if fin.get(k) is not None]) + "</div>")
    instr = f'<p class="instr">{esc(fin["instruction"])}</p>' if fin and fin.get("instruction") else ""
    return (f'<div class="traj" data-vm="{vm}"><h3>{" · ".join(head)}</h3>{instr}'
            f'{"".join(steps) or "<p class=empty>no steps saved</p>"}{foot}</div>')


def iteration_header(m: dict | None, kind: str) -> str:
    """A compact line of the iteration's headline numbers (and ARPO's replay injections)."""
    if not m:
        return '<p class="empty">no metrics line for this iteration (the run stopped before logging it)</p>'
    keys = list(dict.fromkeys([k for _, ks in headline(kind, m) for k in ks] + ["time/iteration"]))
    chips = "".join(f"<span>{esc(k)} <b>{_fmt(m[k])}</b></span>" for k in keys if _num(m.get(k)) is not None)
    inj = "".join(f'<span class="good">replay: group {esc(r.get("group"))} got a success of it {esc(r.get("from_iteration"))} '
                  f'vm {esc(r.get("from_vm"))}</span>' for r in m.get("replay_injections") or [] if isinstance(r, dict))
    return f'<div class="chips">{chips}{inj}</div>'


def _grid(head: list, rows: list[list]) -> str:
    cell = lambda v: esc("-" if v is None else _fmt(v) if _num(v) is not None else v)  # noqa: E731
    return (f'<table class="grid"><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}</tr>'
            + "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows) + "</table>")


def evals_html(run: str) -> str:
    """The evaluations in the run folder: train_explore.py's eval.json (policy vs random actions),
    train_arpo.py's eval_it<N>.json (success per task, both protocols) and selected_tasks.json."""
    parts = []
    for name in sorted(os.listdir(run)):
        if not re.fullmatch(r"eval(_it\d+)?\.json|selected_tasks\.json", name):
            continue
        try:
            with open(os.path.join(run, name)) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict):
            continue
        std, hard = d.get("standard"), d.get("hard")
        if isinstance(std, dict) and isinstance(hard, dict):  # ARPO --eval-only
            per_std, per_hard = std.get("per_task") or {}, hard.get("per_task") or {}
            dom_std, dom_hard = std.get("per_domain") or {}, hard.get("per_domain") or {}  # OSWorld's tasks
            rows = ([[t, per_std.get(t), per_hard.get(t)] for t in per_std]
                    + [[f"domain {d}", dom_std.get(d), dom_hard.get(d)] for d in dom_std]
                    + [["overall", std.get("overall"), hard.get("overall")]])
            parts.append(f"<h3>{esc(name)}: success rate, {esc(d.get('episodes'))} episodes ({esc(d.get('lost'))} lost), "
                         f"temperature {esc(d.get('temperature'))}</h3>" + _grid(["task", "standard", "hard"], rows))
        elif isinstance(d.get("successes"), dict):  # ARPO --select-tasks
            kept = set(d.get("selected") or [])
            parts.append(f"<h3>{esc(name)}: task selection, {esc(d.get('k'))} rollouts per task</h3>" + _grid(
                ["task", "successes", "kept"], [[t, n, "yes" if t in kept else "no"] for t, n in d["successes"].items()]))
        else:  # train_explore.py --eval-only: per-episode means of the policy and of random actions
            who = [k for k in ("policy", "random") if isinstance(d.get(k), dict) and isinstance(d[k].get("summary"), dict)]
            if who:
                keys = list(d[who[0]]["summary"])
                parts.append(f"<h3>{esc(name)}: exploration, per episode</h3>" + _grid(
                    [""] + keys, [[w] + [d[w]["summary"].get(k) for k in keys] for w in who]))
    return f'<section id="eval"><h2>evaluation</h2>{"".join(parts)}</section>' if parts else ""


# -----------------------------------------------------------------------------------------------
# The page

CSS = """body{font:14px system-ui,sans-serif;margin:0;color:#1c1c1e;background:#f2f2f7}
header,nav,main>section{padding:8px 16px}header h1{margin:4px 0;font-size:20px}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid #ccc;z-index:2}nav label{margin-right:14px}
.charts{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0;background:#fff;padding:6px;border-radius:6px;width:340px}
figcaption span{margin-right:8px;font-size:11px}figcaption i{display:inline-block;width:10px;height:10px;margin-right:3px}
.iter{margin:12px 0}.traj{background:#fff;border-radius:8px;padding:8px 12px;margin:10px 0}.traj h3{margin:4px 0;font-size:15px}
.step{display:flex;flex-wrap:wrap;gap:12px;border-top:1px solid #e5e5ea;padding:8px 0}
.shot{position:relative;width:min(640px,100%);line-height:0}.shot img{width:100%;height:auto;border:1px solid #ccc}
.overlay{position:absolute;left:0;top:0;width:100%;height:100%;pointer-events:none}
.noshot{background:#d1d1d6;color:#555;display:flex;align-items:center;justify-content:center;line-height:1.2}
.info{flex:1;min-width:260px}.info h4{margin:0}pre{white-space:pre-wrap;word-break:break-all;font-size:12px}
.kv{border-collapse:collapse;font-size:12px}.kv th{text-align:left;font-weight:normal;padding-right:12px}
.kv td{font-family:monospace}.zero{color:#aaa}.warn,.bad{color:#d70015}.good{color:#248a3d}
.chips span{display:inline-block;background:#fff;border-radius:10px;padding:2px 8px;margin:2px;font-size:12px}
.grid{border-collapse:collapse;background:#fff}.grid td,.grid th{border:1px solid #ddd;padding:2px 8px;font-size:12px}
.instr{font-style:italic}.empty{color:#888}.final{border-top:1px solid #e5e5ea;padding-top:6px}"""

# Selectors + image bookkeeping. Images carry data-src and get their src only when shown, so a run
# of 100 iterations x 8 VMs x 10 steps does not load 8000 PNGs at once. <body data-*> counts what is
# shown, loaded and broken (tests/test_view.py reads it from the dumped DOM).
JS = """(function(){var si=document.getElementById('sel-it'),sv=document.getElementById('sel-vm'),b=document.body;
function count(){var shown=[].slice.call(document.querySelectorAll('.iter:not([hidden]) .traj:not([hidden]) img'));
b.dataset.imgShown=shown.length;b.dataset.imgLoaded=shown.filter(function(i){return i.complete&&i.naturalWidth>0}).length;
b.dataset.imgBroken=shown.filter(function(i){return i.complete&&i.getAttribute('src')&&i.naturalWidth==0}).length;
b.dataset.stepsShown=document.querySelectorAll('.iter:not([hidden]) .traj:not([hidden]) .step').length;
document.getElementById('shown').textContent=b.dataset.stepsShown+' steps shown';}
function show(){var it=si.value,vm=sv.value;
document.querySelectorAll('.iter').forEach(function(s){s.hidden=!(it=='all'||s.dataset.it==it);
s.querySelectorAll('.traj').forEach(function(t){t.hidden=!(vm=='all'||t.dataset.vm==vm);
if(!s.hidden&&!t.hidden)t.querySelectorAll('img[data-src]').forEach(function(i){
i.onload=i.onerror=count;i.src=i.dataset.src;i.removeAttribute('data-src');});});});
history.replaceState(null,'','#it='+it+'&vm='+vm);count();}
var h=new URLSearchParams(location.hash.slice(1));
[[si,h.get('it')],[sv,h.get('vm')]].forEach(function(p){if(p[1]!==null&&[].some.call(p[0].options,function(o){return o.value==p[1]}))p[0].value=p[1];});
si.onchange=sv.onchange=show;document.addEventListener('keydown',function(e){if(e.target.tagName=='SELECT')return;
var d={ArrowLeft:1,ArrowRight:-1}[e.key];if(d&&si.selectedIndex+d>=0&&si.selectedIndex+d<si.options.length){si.selectedIndex+=d;show();}});
show();})();"""


def build_report(run: str, out: str | None = None, last: int = 0) -> str:
    """Write <out>/report.html (default out: the run folder) and return its path.

    Screenshots are linked in place when out is the run folder, else copied under out with the same
    relative paths, so the out folder is self-contained (zip it, mail it, serve it)."""
    r = load_run(run)
    out = out or run
    os.makedirs(out, exist_ok=True)
    kind, args, metrics, trajs = r["kind"], r["args"], r["metrics"], r["trajectories"]
    by_it = {m.get("iteration"): m for m in metrics}
    its = sorted(trajs)[-last:] if last > 0 else sorted(trajs)
    screen = args.get("screen")  # train_arpo.py keeps "1280x720"; explore steps carry their own "screen"
    default = tuple(int(v) for v in screen.split("x")) if isinstance(screen, str) and re.fullmatch(r"\d+x\d+", screen) \
        else (1280, 720)
    images, sections = [], []
    for it in its:
        body = "".join(trajectory_html(run, it, vm, t, kind, default, images) for vm, t in trajs[it].items())
        sections.append(f'<section class="iter" data-it="{it}"><h2>iteration {it}</h2>'
                        f'{iteration_header(by_it.get(it), kind)}{body}</section>')
    vms = sorted({vm for it in its for vm in trajs[it]})
    opt = lambda v, label: f'<option value="{v}">{label}</option>'  # noqa: E731
    sel_it = "".join(opt(i, f"iteration {i}") for i in reversed(its)) + opt("all", "all iterations")
    sel_vm = opt("all", "all VMs") + "".join(opt(v, f"vm {v}") for v in vms)
    what = {"explore": "ScreenExplorer (train_explore.py)", "arpo": "ARPO (train_arpo.py)"}.get(kind, "unknown run type")
    args_rows = _kv_table([(k, json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in args.items()])
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(r["name"])}</title>
<style>{CSS}</style></head><body data-kind="{kind}"><header><h1>{esc(r["name"])}</h1>
<p>{what} · {len(metrics)} iterations logged · {sum(len(v) for v in trajs.values())} trajectories saved
{f"(showing the last {len(its)} iterations)" if len(its) < len(trajs) else ""}</p>
<details><summary>args.json</summary>{args_rows}</details></header>
<main><section id="curves"><h2>training curves</h2>{charts_html(kind, metrics)}</section>{evals_html(run)}
<nav><label>iteration <select id="sel-it">{sel_it}</select></label><label>VM <select id="sel-vm">{sel_vm}</select></label>
<span id="shown"></span> <small>(arrow keys: previous / next iteration)</small></nav>
<section id="trajectories">{"".join(sections) or '<p class="empty">No trajectories saved yet.</p>'}</section></main>
<script>{JS}</script></body></html>"""
    if os.path.abspath(out) != os.path.abspath(run):
        for rel in images:  # same relative layout under out; files copied before are not copied again
            src, dst = os.path.join(run, rel), os.path.join(out, rel)
            try:
                if not (os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src)):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copyfile(src, dst)
            except OSError:  # deleted since we looked (a resumed run redoes an iteration): a broken image
                pass
    path = os.path.join(out, "report.html")
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # a browser reloading mid-write sees the old page
        f.write(page)
    os.replace(path + ".tmp", path)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a run folder, e.g. runs/<name>")
    p.add_argument("--out", default="", help="folder for report.html (+ copied screenshots); default: the run folder")
    p.add_argument("--last", type=int, default=0, help="only the last N iterations' trajectories (curves: all); 0 = all")
    p.add_argument("--open", action="store_true", help="open the report in the default web browser")
    a = p.parse_args(argv)
    path = build_report(a.run, a.out or None, a.last)
    print(f"report: {path}")
    if a.open and not webbrowser.open(f"file://{os.path.abspath(path)}"):
        print(f"No web browser found here; open {os.path.abspath(path)} on a machine with one.", file=sys.stderr)


if __name__ == "__main__":
    main()
