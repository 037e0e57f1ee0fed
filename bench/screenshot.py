"""Benchmark: what does serving a screenshot over HTTP cost, compared with taking it in-process?

    python bench/screenshot.py [--reps 30]

For 1280x720 and 1920x1080 (each on its own `vm_server.py --xvfb` desktop) and for PNG and JPEG,
it times (median and min of --reps):
  in-process : ImageGrab.grab() + encode (the server's exact settings) + decode, in this process
  http       : GET /screenshot on a kept-alive connection + decode
and prints a table with the ratio http / in-process, plus in-process rows with Pillow's own PNG
encoder (compress_level 1, and 6, its default) for comparison with the server's unfiltered PNG.
Targets: HTTP adds at most 50% over in-process, and a 1920x1080 PNG round trip is under 60 ms.
Headline (last line): the worst HTTP overhead, best case against best case,
`screenshot_http_overhead: <fraction>` (0.25 = HTTP takes 25% longer than in-process).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import time

import requests
from PIL import Image, ImageGrab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vm_server import encode_png  # noqa: E402  the server's own PNG encoder


def start(screen: str) -> tuple[subprocess.Popen, str, str, str]:
    """A desktop -> (process, URL, display, its Xauthority). --no-sandbox: this process grabs the
    same screen, which a sandboxed display (in a network namespace of its own) keeps out; the
    sandbox does not touch the screenshot path (bench/isolation.py measures what it costs)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "vm_server.py"), "--xvfb", "--no-sandbox", "--port", "0",
                             "--screen", screen], stdout=subprocess.PIPE, text=True)
    m = re.match(r"vm_server: serving (\S+) display (\S+) .* home (\S+)", proc.stdout.readline())
    if not m:
        proc.kill()
        sys.exit("bench: vm_server.py did not start; run `bash setup.sh` first.")
    return proc, m[1], m[2], os.path.join(os.path.dirname(m[3]), "Xauthority")


def median_ms(fns, reps: int) -> list[tuple[float, float]]:
    """(median ms, min ms) of each function, timed in alternation so that both see the same
    machine load (other jobs on this 2-core machine come and go). The min is the cost of the code
    itself; the median adds whatever the neighbours took."""
    times = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            if rep:  # rep 0 warms up (connection, caches)
                ts.append(time.perf_counter() - t)
    return [(1000 * statistics.median(ts), 1000 * min(ts)) for ts in times]


def in_process(fmt: str) -> int:
    """Capture + encode exactly as the server does (or with Pillow's PNG encoder) + decode."""
    img, buf = ImageGrab.grab(), io.BytesIO()
    if fmt == "png":
        buf.write(encode_png(img))
    elif fmt.startswith("pillow"):  # "pillow1" / "pillow6": Pillow's PNG at that compress_level
        img.save(buf, "PNG", compress_level=int(fmt[-1]))
    else:
        img.save(buf, "JPEG", quality=80)
    Image.open(io.BytesIO(buf.getvalue())).load()
    return len(buf.getvalue())


def over_http(session: requests.Session, url: str, fmt: str) -> int:
    r = session.get(f"{url}/screenshot?format={fmt}", timeout=30)
    r.raise_for_status()
    Image.open(io.BytesIO(r.content)).load()
    return len(r.content)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per cell (median reported)")
    args = p.parse_args()
    rows, overheads = [], []
    for screen in ("1280x720", "1920x1080"):
        proc, url, display, auth = start(screen)
        try:
            os.environ.update(DISPLAY=display, XAUTHORITY=auth)  # ImageGrab in this process grabs the same screen
            session = requests.Session()
            for fmt in ("png", "jpeg"):
                local, remote = median_ms([lambda: in_process(fmt), lambda: over_http(session, url, fmt)], args.reps)
                size = over_http(session, url, fmt)
                rows.append((screen, fmt, local, remote, size))
                overheads.append(remote[1] / local[1] - 1)
            for fmt in ("pillow1", "pillow6"):  # what the server does not use, for comparison
                local = median_ms([lambda: in_process(fmt)], max(5, args.reps // 2))[0]
                rows.append((screen, fmt, local, None, in_process(fmt)))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{'screen':>10} {'format':>8} | {'in-process ms':>13} {'(min)':>6} | {'http ms':>8} {'(min)':>6} | "
          f"{'ratio':>5} {'(min)':>5} | {'bytes':>8}")
    for screen, fmt, local, remote, size in rows:
        http = f"{remote[0]:8.1f} {remote[1]:6.1f} | {remote[0] / local[0]:5.2f} {remote[1] / local[1]:5.2f}" \
            if remote else f"{'-':>8} {'-':>6} | {'-':>5} {'-':>5}"
        print(f"{screen:>10} {fmt:>8} | {local[0]:13.1f} {local[1]:6.1f} | {http} | {size:8d}")
    png1080 = next(r[3] for r in rows if r[:2] == ("1920x1080", "png"))
    print(f"1920x1080 PNG round trip: median {png1080[0]:.1f} ms, min {png1080[1]:.1f} ms (target < 60 ms); "
          f"worst HTTP overhead (min vs min) {max(overheads):+.0%} (target <= +50%)")
    print(f"screenshot_http_overhead: {max(overheads):.2f}")


if __name__ == "__main__":
    main()
