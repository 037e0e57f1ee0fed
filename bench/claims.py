"""The papers' claims, each one command with a verdict: the claim runner shared by both methods.

    python bench/claims.py --list                         # the claims, with the paper's statement
    python bench/claims.py NAME                           # one claim on its default (verdict) seeds
    python bench/claims.py NAME --seeds 2 --first-seed 10 # development seeds (tune here, never on 0..)
    python bench/claims.py NAME --smoke                   # plumbing only: a tiny budget, no verdict

A claim compares ARMS (the same method with one thing changed: curiosity on/off, replay on/off,
...) or a policy before and after training. The runner's rules, the same for every claim:
- Arms run one after the other on the same seeds, each seed from the same warm start (built once
  per seed, shared by every arm), for a FIXED number of iterations: a slower arm gets as many
  updates as a faster one (a minutes budget would hand it fewer).
- The verdict comes from one-sided tests, each with an effect size (a difference of means, in the
  metric's own units) and its 90% interval (a seeded percentile bootstrap). Two kinds:
  * per seed, over evaluation episodes (`permutation_p`, `bootstrap_diff`): every seed must pass.
    Used where seeds are few (2) and episodes many (24+): each seed is a replication of its own.
  * paired over seeds (`sign_flip_p`, `bootstrap_mean`): the arms' per-seed differences. An exact
    sign-flip test needs 5 or more pairs for p < 0.05 (with n pairs the smallest p is 1 / 2^n).
  Each claim's docstring says which it uses and why.
- Fisher's exact test (`fisher_one_sided`) where the metric is a success count.
- Tune on development seeds (--first-seed 10 and up); the default seeds (0, 1, ...) give the verdicts,
  and a verdict counts when it holds on two consecutive runs of the same code (docs/log.md).

The last line is always `claim NAME: <numbers> : pass` (or `: FAIL`; `: smoke` with --smoke), after
the claim's own tables and its wall time. Everything it measured goes to <out>/<NAME>.json.
The claims live in bench/claims_explore.py (ScreenExplorer) and bench/claims_arpo.py (ARPO); a
new one is a function there and a line in its CLAIMS table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE):  # the project first (bench/ has files named like the project's), then bench/
    if p not in sys.path:
        sys.path.insert(0 if p == ROOT else len(sys.path), p)


# ------------------------------------------------------------------------------------------------
# Statistics: pure functions, each checked by hand in tests/test_claims.py


def sign_flip_p(diffs: list[float]) -> float:
    """Exact one-sided paired test of mean(diffs) > 0: under the null each pair's difference is as
    likely to have either sign, so p = the share of the 2^n sign assignments whose sum is at least
    the observed one. n pairs give p >= 1 / 2^n: 5 pairs are the fewest that can reach p < 0.05."""
    d = [float(x) for x in diffs]
    n, observed = len(d), sum(d)
    if n == 0:
        return 1.0
    hits = 0
    for mask in range(1 << n):  # bit k set: pair k's sign flipped
        s = sum(-x if mask >> k & 1 else x for k, x in enumerate(d))
        hits += s >= observed - 1e-12
    return hits / (1 << n)


def permutation_p(after: list[float], before: list[float], n: int = 20000, seed: int = 0) -> float:
    """One-sided permutation test of mean(after) > mean(before) on two independent samples: exact
    (every relabelling) when there are at most `n` of them, else `n` seeded random relabellings
    with the observed one counted once ((hits + 1) / (n + 1), so p is never 0)."""
    x = np.asarray(list(after) + list(before), dtype=float)
    k, m = len(after), len(x)
    if k == 0 or k == m:
        return 1.0
    observed = x[:k].mean() - x[k:].mean()
    total = x.sum()
    if math.comb(m, k) <= n:  # exact: every way to choose which k values are "after"
        from itertools import combinations
        hits = count = 0
        for idx in combinations(range(m), k):
            s = x[list(idx)].sum()
            hits += s / k - (total - s) / (m - k) >= observed - 1e-12
            count += 1
        return hits / count
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(n):
        p = rng.permutation(x)
        hits += p[:k].mean() - p[k:].mean() >= observed - 1e-12
    return (hits + 1) / (n + 1)


def fisher_one_sided(k_before: int, n_before: int, k_after: int, n_after: int) -> float:
    """P(after >= k_after successes) if before and after had the same success rate: the upper tail
    of the hypergeometric distribution given all k_before + k_after successes (Fisher's exact test)."""
    k, n = k_before + k_after, n_before + n_after
    if n_after == 0 or k == 0:
        return 1.0
    tail = sum(math.comb(n_after, j) * math.comb(n_before, k - j) for j in range(k_after, min(k, n_after) + 1))
    return tail / math.comb(n, k)


def bootstrap_mean(x: list[float], level: float = 0.90, n: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The `level` percentile-bootstrap interval of mean(x): x resampled with replacement n times
    (seeded, so a rerun prints the same interval)."""
    a = np.asarray(x, dtype=float)
    if len(a) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, len(a), size=(n, len(a)))].mean(axis=1)  # (n,)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_diff(after: list[float], before: list[float], level: float = 0.90, n: int = 10000,
                   seed: int = 0) -> tuple[float, float]:
    """The `level` percentile-bootstrap interval of mean(after) - mean(before), each sample
    resampled on its own (independent samples)."""
    a, b = np.asarray(after, dtype=float), np.asarray(before, dtype=float)
    if len(a) == 0 or len(b) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    d = a[rng.integers(0, len(a), size=(n, len(a)))].mean(1) - b[rng.integers(0, len(b), size=(n, len(b)))].mean(1)
    lo, hi = np.quantile(d, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass
class Test:
    """One one-sided comparison, as the tables print it: `name: after vs before, diff [lo, hi], p`."""
    name: str
    after: float       # the mean of the arm claimed to be higher
    before: float      # ... of the arm it is compared with
    diff: float        # the effect size: after - before, in the metric's units
    lo: float          # its 90% interval
    hi: float
    p: float
    alpha: float = 0.05

    @property
    def ok(self) -> bool:
        return self.p < self.alpha and self.diff > 0

    def line(self) -> str:
        return (f"{self.name}: {self.after:.3f} vs {self.before:.3f}, diff {self.diff:+.3f} "
                f"[{self.lo:+.3f}, {self.hi:+.3f}], p {self.p:.4f} {'ok' if self.ok else 'no'}")


def episodes_test(name: str, after: list[float], before: list[float], seed: int = 0, alpha: float = 0.05) -> Test:
    """Per seed, over evaluation episodes: permutation test and bootstrap interval of the difference."""
    lo, hi = bootstrap_diff(after, before, seed=seed)
    return Test(name, float(np.mean(after)), float(np.mean(before)), float(np.mean(after) - np.mean(before)),
                lo, hi, permutation_p(after, before, seed=seed), alpha)


def paired_test(name: str, after: list[float], before: list[float], alpha: float = 0.05) -> Test:
    """Paired over seeds (after[k], before[k] from seed k): exact sign-flip test, bootstrap interval."""
    d = [a - b for a, b in zip(after, before)]
    lo, hi = bootstrap_mean(d)
    return Test(name, float(np.mean(after)), float(np.mean(before)), float(np.mean(d)), lo, hi, sign_flip_p(d), alpha)


def rate_test(name: str, k_after: int, n_after: int, k_before: int, n_before: int, alpha: float = 0.05) -> Test:
    """Success counts: Fisher's exact test; the effect size is the difference of the rates, its
    interval a bootstrap of the two samples of 0/1 outcomes. A rate over no episode is nan (the
    line then reads `nan`, and the test fails), not 0: no episode is not no success."""
    a, b = [1.0] * k_after + [0.0] * (n_after - k_after), [1.0] * k_before + [0.0] * (n_before - k_before)
    lo, hi = bootstrap_diff(a, b)
    ra, rb = (k / n if n else float("nan") for k, n in ((k_after, n_after), (k_before, n_before)))
    return Test(name, ra, rb, ra - rb, lo, hi, fisher_one_sided(k_before, n_before, k_after, n_after), alpha)


def quarters(xs: list[float]) -> tuple[float, float]:
    """The means of the first and the last quarter of a series (a training curve); (nan, nan) if empty."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    q = max(1, len(xs) // 4)
    return float(np.mean(xs[:q])), float(np.mean(xs[-q:]))


# ------------------------------------------------------------------------------------------------
# The runner


@dataclass
class Claim:
    """One claim: run(args) -> a result dict with "numbers" (the last line's text) and "pass" (bool),
    having printed its own tables."""
    run: Callable[[argparse.Namespace], dict]
    paper: str           # what the paper claims, in a sentence (its number where it gives one)
    test: str            # which statistics decide, and why those
    seeds: int = 2       # the default number of verdict seeds


def all_claims() -> dict[str, Claim]:
    """Every claim of both methods, by name (each file's CLAIMS table)."""
    import claims_arpo
    import claims_explore
    return {**claims_explore.CLAIMS, **claims_arpo.CLAIMS}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", nargs="?", help="the claim to run (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the claims and exit")
    p.add_argument("--seeds", type=int, default=None, help="seeds to run (default: the claim's own)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds --first-seed .. (develop on 10 and up)")
    p.add_argument("--out", default="", help="where the runs go (default: runs/claims/<NAME>)")
    p.add_argument("--smoke", action="store_true", help="a tiny budget to check the plumbing; no verdict")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one of the claim's settings (its docstring lists them), e.g. --set iterations=30")
    return p.parse_args(argv)


def settings(defaults: dict, a: argparse.Namespace, smoke: dict | None = None) -> dict:
    """A claim's settings: its defaults, then --smoke's tiny budget, then --set KEY=VALUE (typed as
    the default is). An unknown key is one clear sentence."""
    out = dict(defaults)
    if a.smoke and smoke:
        out.update(smoke)
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in out:
            sys.exit(f"claims.py: --set {k}: this claim's settings are {', '.join(sorted(out))}.")
        d = out[k]
        out[k] = (v.lower() in ("1", "true", "yes", "on")) if isinstance(d, bool) else type(d)(v) if d is not None else v
    return out


def seeds_of(a: argparse.Namespace, claim: Claim) -> list[int]:
    n = a.seeds if a.seeds is not None else (1 if a.smoke else claim.seeds)
    return list(range(a.first_seed, a.first_seed + n))


def main(argv=None) -> int:
    a = parse_args(argv)
    claims = all_claims()
    if a.list or not a.name:
        width = max(map(len, claims))
        for name, c in claims.items():
            print(f"{name:{width}s}  {c.paper}")
            print(f"{'':{width}s}  test: {c.test}")
        return 0
    if a.name not in claims:
        print(f"claims.py: no claim named {a.name!r}; `python bench/claims.py --list` lists them.")
        return 2
    claim = claims[a.name]
    a.out = a.out or os.path.join(ROOT, "runs", "claims", a.name + ("-smoke" if a.smoke else ""))
    os.makedirs(a.out, exist_ok=True)
    a.seed_list = seeds_of(a, claim)
    t0 = time.perf_counter()
    print(f"claim {a.name}: {claim.paper}\nseeds {a.seed_list}; test: {claim.test}", flush=True)
    try:
        result = claim.run(a)
    except SystemExit as e:  # a failed run is a FAIL line, not a traceback
        result = {"numbers": f"stopped: {e}", "pass": False}
    minutes = (time.perf_counter() - t0) / 60
    result.update(claim=a.name, seeds=a.seed_list, minutes=minutes, smoke=a.smoke, load=os.getloadavg())
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(f"wall time {minutes:.1f} min (load {os.getloadavg()[0]:.1f}); everything in {a.out}/{a.name}.json")
    verdict = "smoke" if a.smoke else ("pass" if result["pass"] else "FAIL")
    print(f"claim {a.name}: {result['numbers']} : {verdict}", flush=True)
    return 0 if (a.smoke or result["pass"]) else 1


if __name__ == "__main__":
    sys.exit(main())
