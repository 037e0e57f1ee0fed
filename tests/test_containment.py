"""The agent stays inside its own desktop: each attack, typed by the agent into a real desktop's Terminal.

Run: python -m pytest -q tests/test_containment.py      (~1 min; needs bwrap, `bash setup.sh`)

Three local desktops: two as a trainer starts them (env.VMPool(2)), one started as the README says
(`VM_TOKEN=... python vm_server.py --xvfb`). On one of them the agent does what a policy can do
through POST /action alone: a double-click on the Terminal icon, then a typed command line,
`sh attack.sh > attack.out 2>&1` (the script is what the agent would type; the test writes it into
that desktop's HOME first only to keep the typing short). The commands' output lands in HOME,
which the test reads from the host: what the agent's commands printed, not what it claims.

- Tokens: no process the agent can inspect shows any desktop's token in /proc/*/environ or
  /proc/*/cmdline (the server reads its token from a pipe and is not dumpable).
- Servers: with a token it was handed on purpose, the agent still reaches neither another
  desktop's server nor its own (its network namespace has only a loopback of its own).
- The host: a loopback HTTP server the test starts on the host, and the host's other addresses,
  are out of reach; the agent's network has only `lo`.
- Displays: no X display number reaches another desktop's display (the agent's xdotool works on
  its own). From the host, each display admits only its own cookie.
- Files: /etc/shadow is unreadable (the desktop runs as the host's nobody, not as root), /root,
  /home, another desktop's HOME and the project's tasks/ (the evaluators) are not there.
- The trainer still drives every desktop (screenshot, act, setup, evaluate, a restart), each with
  a token of its own that opens no other.
Each attack test fails on the code before the sandbox had a network namespace of its own
(there the agent read the tokens, wrote into another desktop's HOME, found the other display,
fetched the host's page and printed /etc/shadow).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, SERVER, ServedDesktop, proc_comm as comm, proc_descendants, wait_for
from conftest import mouse, x_env

sys.path.insert(0, ROOT)
from vm.desktop import desktop_icons  # noqa: E402
from env import VMClient, VMError, VMPool  # noqa: E402

READY = re.compile(r"vm_server: serving (\S+) display (\S+) screen \S+ home (\S+)")


class Desk:
    """One desktop as the test sees it: its client (with its token), HOME and display (for the
    host's checks), and the process it started as."""

    def __init__(self, name: str, url: str, token: str, ready: str, proc: subprocess.Popen):
        m = READY.search(ready)
        assert m and m[1] == url, ready
        self.name, self.url, self.token, self.display, self.home, self.proc = name, url, token, m[2], m[3], proc
        self.client = VMClient(url, token, timeout=60)
        self.served = ServedDesktop(url, token, self.home, self.display, proc)  # for conftest's x_env / mouse

    def agent(self, name: str, script: str, run: str = "sh", timeout: float = 60) -> str:
        """The agent opens the Terminal (double-click) and types `<run> name.x > name.out 2>&1`.
        Returns what the commands printed, read from HOME on the host."""
        self.client.reset()
        x, y = desktop_icons()["Terminal"]
        self.client.act({"type": "double_click", "x": x, "y": y})
        wait_for(lambda: "xterm" in [w["title"] for w in self.client.windows()], f"the Terminal on {self.name}")
        wait_for(self.shell_up, f"the Terminal's shell on {self.name}")
        path = os.path.join(self.home, f"{name}.x")
        with open(path, "w") as f:
            f.write(script)
        os.chmod(path, 0o644)
        line = f"{run} {name}.x > {name}.out 2>&1; echo $? > {name}.rc\n"
        assert self.client.act({"type": "type", "text": line})["ok"] is True
        rc = os.path.join(self.home, f"{name}.rc")
        wait_for(lambda: os.path.exists(rc) and open(rc).read().endswith("\n"), f"{name} to finish on {self.name}", timeout)
        return open(os.path.join(self.home, f"{name}.out"), errors="replace").read()

    def shell_up(self) -> bool:
        """A shell runs under the Terminal (seen from the host): keys typed now reach it."""
        procs = proc_descendants(self.proc.pid)
        parents = {p: open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] for p in procs if comm(p)}
        return any(comm(p) in ("sh", "bash", "dash") and comm(int(pp)) == "xterm" for p, pp in parents.items())


@pytest.fixture(scope="module")
def desks():
    pool = VMPool(2, timeout=60)  # as train_*.py --vms 2 starts them
    secret = uuid.uuid4().hex
    err = tempfile.TemporaryFile("w+")
    env = {**os.environ, "VM_TOKEN": secret}  # the README's way: `VM_TOKEN=... python vm_server.py --xvfb`
    readme = subprocess.Popen([sys.executable, SERVER, "--xvfb", "--port", "0"], env=env, stdout=subprocess.PIPE,
                              stderr=err, text=True, start_new_session=True)
    try:
        line = readme.stdout.readline()
        err.seek(0)
        assert line.startswith("vm_server: serving"), err.read()
        logs = [open(vm.log).read() for vm in pool.local]
        tokens = [c.session.headers["Authorization"].split()[1] for c in pool.clients]
        a, b = (Desk(n, vm.url, t, log, vm.proc) for n, vm, t, log in zip("AB", pool.local, tokens, logs))
        c = Desk("C", line.split()[2], secret, line, readme)
        yield a, b, c
    finally:
        os.killpg(readme.pid, signal.SIGTERM)
        readme.wait(30)
        pool.close()


def sections(out: str) -> dict[str, str]:
    """`== name` lines split the output into named parts."""
    parts = re.split(r"^== (\S+)$", out, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


# ------------------------------------------------------------------------------------------------
# The attacks


TOKEN_HUNT = """import os
dump = open("found.bin", "wb")  # everything read, for the test to search
for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
    for what in ("environ", "cmdline"):
        try:
            dump.write(open(f"/proc/{pid}/{what}", "rb").read() + b"\\n")
            print(pid, what, "read")
        except OSError as e:
            print(pid, what, "denied:", e.strerror)
    if b"vm_server.py" not in open(f"/proc/{pid}/cmdline", "rb").read():
        continue
    try:  # the server: its writable memory (heap, stacks), where a token it holds would be
        regions = [line.split() for line in open(f"/proc/{pid}/maps")]
        with open(f"/proc/{pid}/mem", "rb") as mem:
            for r in (r for r in regions if r[1].startswith("rw")):
                lo, hi = (int(x, 16) for x in r[0].split("-"))
                mem.seek(lo)
                dump.write(mem.read(min(hi - lo, 1 << 26)))
        print(pid, "server memory read")
    except OSError as e:
        print(pid, "server memory denied:", e.strerror)
"""


def test_the_agent_finds_no_token_in_any_process(desks):
    a, b, c = desks
    for desk in (a, c):  # a trainer's desktop, and one started as the README says
        out = desk.agent("tokens", TOKEN_HUNT, run="python3")
        found = open(os.path.join(desk.home, "found.bin"), "rb").read()
        os.unlink(os.path.join(desk.home, "found.bin"))
        assert b"HOME=" in found and b"xterm" in found, out[-2000:]  # it read the processes it may read
        for other in (a, b, c):
            assert other.token.encode() not in found, f"the agent on {desk.name} read {other.name}'s token"
        assert "server memory denied" in out, out[-2000:]  # it found its server, and could not read it


def test_the_agent_cannot_reach_any_desktops_server(desks):
    a, b, c = desks
    targets = [(d.name, d.url, d.token) for d in (b, a, c)]  # the others', and its own
    script = f"""import json, urllib.request
body = json.dumps({{"steps": [{{"type": "write_file", "path": "pwned.txt", "content": "x"}}]}}).encode()
for name, url, token in {targets!r}:
    req = urllib.request.Request(url + "/setup", data=body, headers={{"Authorization": "Bearer " + token,
                                                                      "Content-Type": "application/json"}})
    try:
        print(name, "reached", urllib.request.urlopen(req, timeout=5).status)
    except Exception as e:
        print(name, "refused", repr(e))
"""
    out = a.agent("servers", script, run="python3")
    assert all(f"{d.name} refused" in out for d in (a, b, c)) and "reached" not in out, out
    for d in (a, b, c):
        assert not os.path.exists(os.path.join(d.home, "pwned.txt")), f"the agent on A wrote into {d.name}'s HOME"


class Page(BaseHTTPRequestHandler):
    marker = uuid.uuid4().hex

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.marker.encode())

    def log_message(self, *args):
        pass


def host_addresses() -> list[str]:
    """127.0.0.1 and this machine's other IPv4 addresses (the kernel's local routes)."""
    trie = open("/proc/net/fib_trie").read()
    return sorted({"127.0.0.1", *re.findall(r"\|-- (\d+\.\d+\.\d+\.\d+)\n\s+/32 host LOCAL", trie)})


def test_the_agent_cannot_reach_the_hosts_services_or_the_network(desks):
    a, _, _ = desks
    page = ThreadingHTTPServer(("0.0.0.0", 0), Page)  # a service of the host's, on every address
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        urls = [f"http://{ip}:{page.server_address[1]}/" for ip in host_addresses()]
        script = f"""import urllib.request
for url in {urls!r}:
    try:
        print(url, "reached", urllib.request.urlopen(url, timeout=5).read().decode())
    except Exception as e:
        print(url, "refused", repr(e))
print("interfaces", sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))
"""
        out = a.agent("host", script, run="python3")
    finally:
        page.shutdown()
    assert Page.marker not in out, out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("http")] == ["refused"] * len(urls), out
    assert "interfaces ['lo']" in out, out  # no route out of its namespace at all


def test_the_agent_cannot_open_another_desktops_display(desks):
    a, b, _ = desks
    title = f"desktop-b-{uuid.uuid4().hex[:8]}"
    b.client.reset()
    b.client.setup([{"type": "launch", "argv": ["xterm", "-T", title]}])
    wait_for(lambda: title in [w["title"] for w in b.client.windows()], "B's window")
    script = ("(: > \"$XAUTHORITY\") 2>/dev/null; echo \"cookie emptied $?\"\n"  # the server's X clients read it too
              "xdotool search --name xterm > /dev/null 2>&1; echo \"own $?\"\n"  # its own display works
              f"for d in $(seq 0 63); do DISPLAY=:$d timeout 5 xdotool search --name {title} > /dev/null 2>&1; "
              f"echo \"display :$d $?\"; done\n")
    out = a.agent("displays", script)
    assert "own 0" in out and "cookie emptied 0" not in out, out
    found = [line for line in out.splitlines() if line.startswith("display") and line.endswith(" 0")]
    assert len(out.splitlines()) == 66 and found == [], f"the agent on A found B's window through {found}"


def test_each_display_admits_only_its_own_cookie(desks):
    """From the host, in a desktop's network namespace: its own cookie opens its display; another
    desktop's, or none, does not."""
    a, b, _ = desks
    prefix, env = x_env(a.served)
    cookie_b = x_env(b.served)[1]["XAUTHORITY"]

    def probe(xauthority: str) -> int:
        return subprocess.run([*prefix, "xdotool", "getmouselocation"], env={**env, "XAUTHORITY": xauthority},
                              capture_output=True, timeout=10).returncode
    assert probe(env["XAUTHORITY"]) == 0
    assert probe(cookie_b) != 0 and probe(os.devnull) != 0


def test_the_agent_reads_no_secret_of_the_host(desks):
    a, b, _ = desks
    script = (f"echo '== shadow'; cat /etc/shadow\n"
              f"echo '== root'; ls -A /root\necho '== home'; ls -A /home\n"
              f"echo '== other'; ls -A {b.home}\n"
              f"echo '== project'; ls -A {ROOT}; ls -A {ROOT}/tasks\n"
              f"echo '== own'; ls -A ~\n")
    out = sections(a.agent("files", script))
    assert out["own"].split().count("notes.txt") == 1, out  # it reads its own HOME
    assert not re.search(r"^root:", out["shadow"], re.M) and "Permission denied" in out["shadow"], out["shadow"]
    assert "notes.txt" not in out["other"] and "Documents" not in out["other"], out["other"]
    assert not re.search(r"\.json$|^README|^tasks$|^runs$|^tests$", out["project"], re.M), out["project"]
    assert out["home"].strip() == "" or "No such file" in out["home"], out["home"]
    # /root: nothing, or only the folder Python runs from when it lives there (as with pyenv)
    assert "No such file" in out["root"] or set(out["root"].split()) <= {".pyenv"}, out["root"]


# ------------------------------------------------------------------------------------------------
# Tokens of remote VMs, and the trainer still driving every desktop


def test_each_vm_token_is_derived_from_the_secret_and_its_url():
    """HMAC-SHA256(secret, URL), as `printf 'http://10.0.0.5:8000' | openssl dgst -sha256 -hmac s3cret`
    prints it; the URL as written up to case and a trailing slash; `--token-for` prints the same."""
    from vm.rules import vm_token
    vm5 = "8fe4ed9101d664f1ec4f9ff2d2ac7a291ea99883d75d399f38a753a8b79aff04"
    assert vm_token("s3cret", "http://10.0.0.5:8000") == vm5
    assert vm_token("s3cret", " HTTP://10.0.0.5:8000/") == vm5
    assert vm_token("s3cret", "http://10.0.0.6:8000") == "2d6ef706795678b6b6f988c8bd19cd50d20c2fc5a2da293a2d17d9b1c4b4fff4"
    assert vm_token("other", "http://10.0.0.5:8000") != vm5
    r = subprocess.run([sys.executable, SERVER, "--token-for", "http://10.0.0.5:8000"], capture_output=True, text=True,
                       env={**os.environ, "VM_TOKEN": "s3cret"}, timeout=30)
    assert r.stdout == vm5 + "\n" and r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, SERVER, "--token-for", "http://10.0.0.5:8000"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "VM_TOKEN"}, timeout=30)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "VM_TOKEN" in r.stderr


def test_the_trainer_drives_every_desktop_each_with_its_own_token():
    with VMPool(3, timeout=60) as pool:
        tokens = [vm.token for vm in pool.local]
        assert len(set(tokens)) == 3 and all(tokens)
        with pytest.raises(VMError) as e:  # one desktop's token opens no other
            VMClient(pool.urls[1], tokens[0], timeout=10).health()
        assert e.value.status == 401
        assert all(r.ok and r.value.size == (1280, 720) for r in pool.screenshots())
        assert all(r.ok for r in pool.act([{"type": "move", "x": 10 + i, "y": 20 + i} for i in range(3)]))
        served = [ServedDesktop(vm.url, vm.token, READY.search(open(vm.log).read())[3],
                                READY.search(open(vm.log).read())[2], vm.proc) for vm in pool.local]
        assert [mouse(s) for s in served] == [(10, 20), (11, 21), (12, 22)]  # the host still sees each display
        res = pool.setup([[{"type": "write_file", "path": "mine.txt", "content": f"desktop {i}"}] for i in range(3)])
        assert all(r.ok for r in res), res
        res = pool.evaluate([{"checks": [{"type": "file_contains", "path": "mine.txt", "text": f"desktop {i}"}]}
                             for i in range(3)])
        assert [r.value["score"] for r in res] == [1.0, 1.0, 1.0]
        # A desktop that dies is restarted by reset() with a fresh token of its own.
        os.killpg(pool.local[1].proc.pid, signal.SIGKILL)
        pool.local[1].proc.wait(10)
        assert all(r.ok for r in pool.reset())
        assert pool.local[1].token not in tokens and len({vm.token for vm in pool.local}) == 3
        res = pool.evaluate([{"checks": [{"type": "file_exists", "path": "notes.txt"}]}] * 3)
        assert [r.value["score"] for r in res] == [1.0, 1.0, 1.0]
