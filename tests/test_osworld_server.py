"""ARPO on OSWorld's own server, end to end: OSWorld's VM-side server (from the checkout that
OSWORLD_SRC names) on a local Xvfb desktop, attached with `--vms osworld:attach:HOST:PORT`; two
tasks in OSWorld's format (tests/osworld_server.py) loaded by osworld_env.load_tasks; played with
the project's own episode code and a scripted policy (a feasible task solved through the GUI,
scored by OSWorld's evaluator on the VM; an infeasible one the agent gives up on), each scoring 1;
then train_arpo.py itself, one iteration of the tiny model on them, as a user runs it.

Skipped unless OSWORLD_SRC names an OSWorld checkout (its desktop_env/server/main.py) and OSWorld's
client is installed (requirements-osworld.txt); needs flask and scrot (docs/osworld.md).

Run: OSWORLD_SRC=~/OSWorld python -m pytest -q tests/test_osworld_server.py    (~60 s)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import osworld_server as S
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import osworld_env  # noqa: E402 -- first: its stand-ins for easyocr and librosa let OSWorld's client import

pytestmark = pytest.mark.skipif(S.source() is None, reason="OSWORLD_SRC names no OSWorld checkout")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("desktop_env.desktop_env", reason="OSWorld's client (requirements-osworld.txt)")
    s = S.start(S.source(), free_port())
    yield s
    s.stop()


def test_a_feasible_and_an_infeasible_task_score_1_with_our_episode_code(server, tmp_path):
    import train_arpo as T
    from plumbing import rundir
    tasks = osworld_env.load_tasks(S.write_tasks(str(tmp_path)))
    args = T.Args(vms=f"osworld:attach:127.0.0.1:{server.port}", settle="0.5", prompt="arpo", vm_timeout=120)
    pool, live, screen = rundir.open_desktops(args.vms, "", args.vm_timeout, (1280, 720), osworld_cache=str(tmp_path / "cache"))
    try:
        assert live == {0} and screen == (1280, 720)

        def policy(observations):  # UI-TARS text, one answer a step, per task
            return [S.SOLUTIONS[o.task.id][o.step] for o in observations]
        eps, out = T.play_tasks(pool, tasks, policy, args)
    finally:
        pool.close()
    feasible, infeasible = eps
    assert (feasible.end, feasible.score, feasible.score_standard) == ("done", 1.0, 1.0), feasible.error
    assert (infeasible.end, infeasible.score, infeasible.score_standard) == ("fail", 1.0, 1.0), infeasible.error
    assert feasible.actions[0] == {"type": "type", "text": "mkdir ~/reports\n"}
    assert os.path.isdir(os.path.join(server.home, "reports"))  # done through the terminal's keys
    assert len(feasible.screenshots) == 2 and feasible.screenshots[0].size == (1280, 720)
    assert not out.failures


def test_train_arpo_runs_an_iteration_on_osworld(server, tmp_path):
    meta = S.write_tasks(str(tmp_path))
    run = tmp_path / "runs"
    cmd = [sys.executable, os.path.join(ROOT, "train_arpo.py"), "--vms", f"osworld:attach:127.0.0.1:{server.port}",
           "--osworld-tasks", meta, "--osworld-cache", str(tmp_path / "cache"), "--model", "tiny-uitars",
           "--screen", "1280x720", "--iterations", "1", "--group-size", "2", "--max-steps", "2",
           "--max-pixels", "12544", "--max-new-tokens", "24", "--runs-dir", str(run), "--run-name", "osw",
           "--task-ids", S.INFEASIBLE["id"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    saved = json.loads((run / "osw" / "args.json").read_text())
    assert (saved["prompt"], saved["settle"], saved["vm_timeout"]) == ("arpo", "0.5", 600.0)  # OSWorld's defaults
    m = [json.loads(line) for line in (run / "osw" / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 1 and m[0]["episodes"] == 2 and m[0]["dropped"] == 0
    assert "success/os" in m[0]  # the domain's success rate


def test_a_setup_that_fails_drops_the_episode_and_the_run_goes_on(server, tmp_path):
    """A config step OSWorld's setup controller cannot run (it raises) is the environment's
    failure: the episode is dropped, not scored, and the next one on the same VM plays."""
    import train_arpo as T
    from env import Task, VMPool
    broken = {**S.INFEASIBLE, "id": "local-os-broken-setup", "config": [{"type": "no_such_step", "parameters": {}}]}
    tasks = [Task(broken["id"], broken["instruction"], [{"type": "osworld", "task": broken}], {"osworld": "infeasible"},
                  infeasible=True, domain="os"),
             *[t for t in osworld_env.load_tasks(S.write_tasks(str(tmp_path))) if t.infeasible]]
    client = osworld_env.OSWorldClient("attach", f"127.0.0.1:{server.port}", str(tmp_path / "cache"), (1280, 720), 120)
    pool = VMPool(clients=[client], timeout=120, screen=(1280, 720))
    try:
        eps, out = T.play_tasks(pool, tasks, lambda obs: [S.SOLUTIONS[S.INFEASIBLE["id"]][0] for _ in obs],
                                T.Args(settle="0.5", prompt="arpo"))
    finally:
        pool.close()
    assert eps[0].end == "dropped" and "OSWorld's setup of local-os-broken-setup raised" in eps[0].error
    assert (eps[1].end, eps[1].score) == ("fail", 1.0) and len(out.failures) == 1
