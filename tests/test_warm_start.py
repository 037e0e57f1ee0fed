"""plumbing/warm_start.py: `--model tiny-uitars` / `tiny-explore` build, cache, and answer in format on a
real desktop.

    python -m pytest -q tests/test_warm_start.py   (seconds with the models cached; a first run on a
                                                    machine builds both: a few minutes on 2 CPU cores)

The two models come from the cache a user's run reads ($WARM_START_CACHE, else
~/.cache/gui-agent-rl/warm_start): a first run builds them exactly as the quickstart's would, and
every later run of the suite loads them. What the cache itself does is tested in temporary caches
with a 2-step recipe (the cache, not the model, is what those tests are about): a build is an
ordinary checkpoint folder recorded with its recipe and losses, changes the language model and not
the vision tower; a second load does not build again (the trainer is replaced by one that fails);
the key changes with the seed and the recipe; two processes building at once leave one complete
folder and nothing half-written. And the point of it all: the format rate when sampling at
temperature 1 on a real desktop's screenshots (the reset desktop and one with a window open), at
full size and at the small size the CPU benchmarks use.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import model as M
import qwen_vl
from plumbing import warm_start
from actions import MAX_PIXELS, parse_action
from chat import explore_messages, uitars_messages
from conftest import vm_call
from env import VMClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("tiny-uitars", "tiny-explore")
# A first run builds both models (a few minutes each on 2 busy cores), inside the first test's time.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def built():
    """name -> the Policy, from the user's cache (built there if it has none)."""
    return {name: M.load_policy(name) for name in NAMES}


def test_the_built_models_learned_the_format_and_only_the_language_model_changed(built):
    random_tiny = M.load_policy("tiny").model.state_dict()
    for name in NAMES:
        path = warm_start.folder(name, 0, None, None)  # cached: neither make nor save is called
        with open(os.path.join(path, "warm_start.json")) as f:
            record = json.load(f)
        assert record["name"] == name and record["seed"] == 0, record
        assert record["nll_last"] < record["nll_first"] / 4, record  # it learned the answers' tokens
        weights = built[name].model.state_dict()
        assert type(built[name].model).__name__ == "Qwen2_5_VLForConditionalGeneration"
        # the tiny model of its seed, changed by the warm start: not the random one
        assert not torch.equal(weights["lm_head.weight"], random_tiny["lm_head.weight"])
        vision = "model.visual.patch_embed.proj.weight"  # the warm start leaves the vision tower as it was
        assert torch.equal(weights[vision], random_tiny[vision])


def test_a_build_is_a_cached_checkpoint_folder_loaded_without_rebuilding(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_START_CACHE", str(tmp_path))
    monkeypatch.setattr(warm_start, "RECIPES", {n: replace(r, steps=2) for n, r in warm_start.RECIPES.items()})
    first = M.load_policy("tiny-explore")
    entries = sorted(os.listdir(tmp_path))
    folders = [e for e in entries if not e.endswith(".lock")]
    assert len(folders) == 1 and not [e for e in entries if e.startswith(".")], entries  # no build leftovers
    path = warm_start.folder("tiny-explore", 0, None, None)  # cached: neither make nor save is called
    assert path == os.path.join(tmp_path, folders[0])
    with open(os.path.join(path, "warm_start.json")) as f:
        record = json.load(f)
    assert record["name"] == "tiny-explore" and record["recipe"]["steps"] == 2
    assert os.path.exists(os.path.join(path, "config.json"))  # an ordinary save_policy folder
    monkeypatch.setattr(warm_start, "train", lambda *a: pytest.fail("the cached model was built again"))
    again = M.load_policy("tiny-explore")
    weights = first.model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in again.model.state_dict().items())
    # Another seed is another model: not in the cache, so it would be built (and train() fails here).
    with pytest.raises(pytest.fail.Exception, match="built again"):
        M.load_policy("tiny-explore", seed=1)


def test_the_key_follows_the_seed_and_the_recipe(monkeypatch):
    k = warm_start.key("tiny-explore", 0)
    assert k == warm_start.key("tiny-explore", 0) and k != warm_start.key("tiny-explore", 1)
    assert k != warm_start.key("tiny-uitars", 0)
    recipes = dict(warm_start.RECIPES, **{"tiny-explore": replace(warm_start.RECIPES["tiny-explore"], steps=1)})
    monkeypatch.setattr(warm_start, "RECIPES", recipes)
    assert warm_start.key("tiny-explore", 0) != k


BUILD = """
import sys; sys.path.insert(0, {root!r})
from dataclasses import replace
import model, warm_start
# a 2-step recipe: this test is about the cache, not the model
warm_start.RECIPES["tiny-explore"] = replace(warm_start.RECIPES["tiny-explore"], steps=2)
print("FOLDER", warm_start.folder("tiny-explore", 5, lambda: model.load_policy("tiny", seed=5), model.save_policy))
"""


def test_two_processes_building_at_once_leave_one_complete_folder(tmp_path):
    env = dict(os.environ, WARM_START_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", BUILD.format(root=ROOT)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    folders = {line.split(" ", 1)[1] for out, _ in outs for line in out.splitlines() if line.startswith("FOLDER ")}
    assert len(folders) == 1
    assert sum("warm_start: building" in err for _, err in outs) == 1  # the other waited, then loaded
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(f) for f in folders] +
                                                  [os.path.basename(f) + ".lock" for f in folders])
    assert M.load_policy(folders.pop()).family.model_type == "qwen2_5_vl"


def _screens(vm_desktop) -> list:
    """Two real screenshots: the reset desktop, and the same with a terminal window open."""
    url, token, _ = vm_desktop
    vm_call(vm_desktop, "POST", "/reset")
    client = VMClient(url, token)
    shots = [client.screenshot()]
    # A setup that launched an app answers once the desktop has settled: the window is up and drawn.
    vm_call(vm_desktop, "POST", "/setup", {"steps": [{"type": "launch", "argv": ["xterm"]}]})
    assert vm_call(vm_desktop, "GET", "/windows").json()["windows"]
    shots.append(client.screenshot())
    vm_call(vm_desktop, "POST", "/reset")
    return shots


def format_rate(policy, style: str, screens: list, n: int, max_pixels: int, seed: int = 0) -> float:
    """The share of n answers sampled at temperature 1 (n/len(screens) per screenshot) that parse."""
    p = replace(policy, image_processor=qwen_vl.image_processor(policy.family, 56 * 56, max_pixels), pixels={})
    shots = [screens[i % len(screens)] for i in range(n)]
    if style == "explore":
        prompts = [explore_messages(s) for s in shots]
    else:
        prompts = [uitars_messages(t, [s], []) for s, t in
                   zip(shots, ["Open the calculator.", "Save the file as notes.txt in the home folder."] * n)]
    torch.manual_seed(seed)
    gens = M.generate(p, prompts, max_new_tokens=128, temperature=1.0)
    ok = [parse_action(g.text, style, s.size, g.prompt.image_sizes[0]) is not None for g, s in zip(gens, shots)]
    return sum(ok) / len(ok)


# The floor each must clear, on 64 answers: 52 of them. Builds of the same recipe are not
# bit-identical (two of tiny-uitars differed by up to 1.3 in a weight; the cause is not traced):
# two builds of tiny-uitars measured 0.94 and 0.84 at full size on 32 answers here, the second 0.97
# on 64 (1.00 at 140x84; tiny-explore 0.97 / 0.97), and 0.96-0.98 with bench/warm_start.py's
# sampling. A model at 0.9 misses 52/64 about one run in a hundred. After 250 steps instead of 1000,
# tiny-uitars parsed 0.72-0.92 on 32 answers here.
FLOOR = {"tiny-explore": 0.8, "tiny-uitars": 0.8}


@pytest.mark.parametrize("name,style", [("tiny-uitars", "uitars"), ("tiny-explore", "explore")])
def test_format_rate_at_temperature_1_on_a_real_desktop(built, vm_desktop, name, style):
    screens = _screens(vm_desktop)
    for max_pixels in (MAX_PIXELS, 12544):  # 1288x728 (1,196 image tokens) and 140x84 (15)
        rate = format_rate(built[name], style, screens, 64, max_pixels)
        print(f"{name} at max_pixels {max_pixels}: format rate {rate:.2f}")
        assert rate >= FLOOR[name], (name, max_pixels, rate)
    # The random tiny model it starts from: no answer parses (why these models exist).
    assert format_rate(M.load_policy("tiny"), style, screens, 8, 12544) == 0.0
