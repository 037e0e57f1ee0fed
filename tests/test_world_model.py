"""Tests for rewards.py: the action vector, every parameter gets a gradient, curiosity is
scored before the model learns the buffer (and not in the release's order), the model learns and
curiosity decays, on synthetic transitions and on 12 real transitions of a real desktop
(vm_server.py --xvfb, the session's desktop from conftest.py).

Run: python -m pytest -q tests/test_world_model.py        (about 15 s on 2 CPU cores, plus a desktop's start)
"""
import pytest
import torch

import rewards as R


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Everything here is tiny: a second torch thread only adds waiting when other processes share
    the cores. Restored afterwards for the rest of the suite."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


def test_encode_actions():
    a = R.encode_actions([{"type": "click", "x": 640, "y": 360}, None, {"type": "type", "text": "hello"},
                          {"type": "type", "text": "hello"}, {"type": "key", "keys": ["ctrl", "s"]},
                          {"type": "scroll", "x": 0, "y": 0, "direction": "down", "amount": 5}], (1280, 720))
    assert a.shape == (6, R.ACTION_DIM)
    assert torch.count_nonzero(a[1]) == 0  # malformed step -> zeros
    assert torch.equal(a[2], a[3]) and not torch.equal(a[2], a[4])  # stable hashing
    o = len(R.ACTION_TYPES)
    assert a[0, R.ACTION_TYPES.index("click")] == 1 and close(a[0, o:o + 3], [1.0, 0.5, 0.5])
    heat = a[0, o + 6:o + 6 + 144].reshape(9, 16)  # (hh, hw)
    # (0.5, 0.5) lies between cells 7/8 across and in cell 4 down: the peak is there
    assert heat.argmax() // 16 == 4 and heat.argmax() % 16 in (7, 8)


def _transitions(n=48, text_dim=8, seed=0):
    """A deterministic synthetic environment: the next screen depends on the screen and on where
    the click lands (a fixed random direction per 4 x 3 region), normalised like real features."""
    g = torch.Generator().manual_seed(seed)
    s = torch.nn.functional.normalize(torch.randn(n, R.SCREEN_DIM, generator=g), dim=1)  # (N, D)
    e = torch.nn.functional.normalize(torch.randn(n, text_dim, generator=g), dim=1)  # (N, E)
    region_dirs = torch.randn(12, R.SCREEN_DIM, generator=g)  # (12, D)
    region_text = torch.randn(12, text_dim, generator=g)  # (12, E)
    xs = torch.randint(0, 1280, (n,), generator=g)
    ys = torch.randint(0, 720, (n,), generator=g)
    region = (xs * 4 // 1280) * 3 + ys * 3 // 720  # (N,)
    s2 = torch.nn.functional.normalize(s + 0.05 * region_dirs[region], dim=1)  # (N, D)
    e2 = torch.nn.functional.normalize(e + region_text[region], dim=1)  # (N, E)
    actions = [{"type": "click", "x": int(x), "y": int(y)} for x, y in zip(xs, ys)]
    return s, e, actions, s2, e2


def test_world_model_every_parameter_gets_gradient():
    s, e, actions, s2, e2 = _transitions(n=8)
    wm = R.WorldModel(text_dim=8)
    loss, parts = R.world_model_loss(wm, s, R.encode_actions(actions), s2, e, e2)
    loss.backward()
    for name, p in wm.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, f"{name} got no gradient"
    assert parts["wm/image_loss"] > 0 and parts["wm/text_loss"] > 0


def test_predict_and_learn_trains_on_valid_steps_only():
    s, e, actions, s2, e2 = _transitions(n=6)
    f = R.Features(s, s2, text_before=e, text_after=e2)
    wm = R.WorldModel(text_dim=8, hidden=32)
    w0 = [p.detach().clone() for p in wm.parameters()]
    ps, pt, m = R.predict_and_learn(wm, torch.optim.AdamW(wm.parameters(), 1e-3), f, actions, [0] * 6)
    assert m == {} and all(torch.equal(a, b) for a, b in zip(w0, wm.parameters()))  # nothing valid: no update
    assert ps.shape == (6, R.SCREEN_DIM) and pt.shape == (6, 8)  # but a prediction for every step
    _, _, m = R.predict_and_learn(wm, torch.optim.AdamW(wm.parameters(), 1e-3), f, actions, [1, 0, 1, 0, 0, 0])
    assert m["wm/loss"] > 0 and not all(torch.equal(a, b) for a, b in zip(w0, wm.parameters()))


def _warm_world_model_and_novel_buffer(seed=0):
    """A world model that has seen 40 synthetic transitions for 10 iterations (3 epochs each, the
    script's optimizer), and the next buffer: those 40 again + one NEW transition taken 8 times
    (8 desktops, one start screen after a reset, the same first double-click)."""
    torch.manual_seed(seed)
    s, _, actions, s2, _ = _transitions(n=40, seed=seed)
    wm = R.WorldModel(hidden=64)
    opt = torch.optim.AdamW(wm.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(10):
        R.train_world_model(wm, opt, s, actions, s2, epochs=3, batch_size=16)
    g = torch.Generator().manual_seed(seed + 100)
    new = torch.nn.functional.normalize(torch.randn(1, R.SCREEN_DIM, generator=g), dim=1)  # (1, D)
    new2 = torch.nn.functional.normalize(new + 0.05 * torch.randn(1, R.SCREEN_DIM, generator=g), dim=1)  # (1, D)
    f = R.Features(torch.cat([s, new.repeat(8, 1)]), torch.cat([s2, new2.repeat(8, 1)]))  # (48, D) each
    return wm, opt, f, actions + [{"type": "double_click", "x": 100, "y": 650}] * 8


def test_curiosity_scores_before_the_world_model_learns_the_buffer():
    scores = {}
    for train_first in (False, True):  # the same warm model and buffer, each order
        wm, opt, f, actions = _warm_world_model_and_novel_buffer()
        ps, _, m = R.predict_and_learn(wm, opt, f, actions, [1] * 48, epochs=3, batch_size=16,
                                        train_first=train_first)
        assert m["wm/loss"] > 0  # the model learns the buffer in both orders
        cur = 1 - R.cosine(f.screen_after, ps)  # (48,) image curiosity
        scores[train_first] = float(cur[40:].mean()), float(cur[:40].mean())  # (novel, familiar)
    (novel, familiar), (novel_tf, familiar_tf) = scores[False], scores[True]
    # Predicted first, the new transition is a surprise (about its real change, 1 - cos(new, new2))
    # and the familiar ones are not.
    assert novel > 0.3 and novel > 10 * familiar, scores
    # The release's order: 3 epochs on its 8 copies fit it before it is scored, and most of its
    # surprise is gone.
    assert novel_tf < 0.2 * novel and novel_tf - familiar_tf < 0.1, scores


def test_world_model_learns_and_curiosity_decays():
    torch.manual_seed(0)
    s, e, actions, s2, e2 = _transitions()
    wm = R.WorldModel(text_dim=8, hidden=64)
    opt = torch.optim.AdamW(wm.parameters(), lr=3e-3)
    cur = lambda: 1 - R.cosine(s2, R.predict_next(wm, s, actions, e)[0])  # (N,) image curiosity
    cur0 = cur()
    first = R.train_world_model(wm, opt, s, actions, s2, e, e2, epochs=3, batch_size=16)
    for _ in range(20):  # the same transitions again and again, as a desktop that never changes
        m = R.train_world_model(wm, opt, s, actions, s2, e, e2, epochs=3, batch_size=16)
    assert m["wm/loss"] < 0.3 * first["wm/loss_first_epoch"]
    assert cur().mean() < 0.3 * cur0.mean()
    # state_dict round trip: a rebuilt model predicts the same
    wm2 = R.WorldModel(**wm.config)
    wm2.load_state_dict(wm.state_dict())
    assert torch.equal(R.predict_next(wm2, s, actions, e)[0], R.predict_next(wm, s, actions, e)[0])


@pytest.fixture(scope="module")
def real_transitions(vm_desktop):
    """(befores, actions, afters): 12 real transitions of the session's real desktop (conftest.py),
    screenshot -> action -> screenshot, the kinds an explorer takes: open apps from their icons,
    click elsewhere, a context menu, type, keys. The desktop is reset before and after."""
    import time

    from env import VMClient
    from vm.desktop import desktop_icons
    vm = VMClient(vm_desktop.url, vm_desktop.token, timeout=60)
    icons = desktop_icons()
    (tx, ty), (cx, cy) = icons["Terminal"], icons["Calculator"]
    plan = [({"type": "click", "x": 700, "y": 400}, 0.3),           # empty desktop: nothing happens
            ({"type": "right_click", "x": 700, "y": 400}, 0.5),     # the desktop's context menu
            ({"type": "key", "keys": ["escape"]}, 0.3),             # ... closed again
            ({"type": "double_click", "x": tx, "y": ty}, 1.5),      # a terminal window opens
            ({"type": "type", "text": "ls"}, 0.3),                  # a little text in it
            ({"type": "key", "keys": ["enter"]}, 0.5),              # the listing
            ({"type": "click", "x": 1000, "y": 650}, 0.3),          # elsewhere
            ({"type": "double_click", "x": cx, "y": cy}, 1.5),      # a calculator opens
            ({"type": "type", "text": "12"}, 0.3),
            ({"type": "key", "keys": ["escape"]}, 0.3),
            ({"type": "right_click", "x": 1100, "y": 200}, 0.5),
            ({"type": "key", "keys": ["escape"]}, 0.3)]
    vm.reset()
    try:
        befores, actions, afters = [], [], []
        shot = vm.screenshot()
        for action, settle in plan:
            vm.act(action)
            time.sleep(settle)
            befores.append(shot)
            actions.append(action)
            shot = vm.screenshot()
            afters.append(shot)
    finally:
        vm.reset()
    return befores, actions, afters


def test_world_model_learns_on_real_desktop_transitions(real_transitions):
    befores, actions, afters = real_transitions
    s, s2 = R.screen_features(befores), R.screen_features(afters)  # (12, D) each
    change = 1 - R.cosine(s, s2)  # (12,) how much each action changed the screen
    assert change.max() > 0.2, "no action changed the screen: the desktop did not react"
    torch.manual_seed(0)
    wm = R.WorldModel(hidden=64)
    opt = torch.optim.AdamW(wm.parameters(), lr=3e-3)
    cur = lambda: 1 - R.cosine(s2, R.predict_next(wm, s, actions)[0])  # (12,) image curiosity
    cur0 = cur()
    # Untrained, the model predicts "no change" (small heads on a residual): its curiosity is about
    # how much the screen changed.
    assert torch.allclose(cur0, change, atol=0.05)
    first = R.train_world_model(wm, opt, s, actions, s2, epochs=3, batch_size=4)
    for _ in range(20):  # the same real transitions again and again
        m = R.train_world_model(wm, opt, s, actions, s2, epochs=3, batch_size=4)
    assert m["wm/loss"] < 0.3 * first["wm/loss_first_epoch"]
    # The transition that surprised it most (an app window opening) is no longer a surprise.
    k = int(cur0.argmax())
    assert cur()[k] < 0.3 * cur0[k], (actions[k], float(cur0[k]), float(cur()[k]))
    assert cur().mean() < 0.3 * cur0.mean()
