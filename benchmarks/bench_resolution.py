"""Benchmark allowlist resolution against a full entry-point scan, in cold processes.

For 100, 500 and 2000 fake installed distributions (real ``*.dist-info`` folders with
METADATA and entry_points.txt in one temporary site folder, first on ``sys.path``), each
measurement runs in a fresh interpreter:

- ``resolve``: ``Allowlist.from_cli(plugins=["bench-target"]).resolve()`` (the distribution
  sits in the middle of the folder listing);
- ``scan``: ``importlib.metadata.entry_points()``, the baseline every "allowlist" that
  filters discovered plugins pays.

Two figures per measurement, the best of ``--repeat`` runs: ``call``, the first call in
the fresh process (its modules imported before the clock starts, no cache warmed), and
``+imports``, the same call including the imports it needs (``rtpcore.plugins.allowlist`` and
``rtpcore.plugins.resolution`` with importlib-metadata, packaging and attrs; or
``importlib.metadata``). The targets apply to ``call``: resolve at 2000 within 1.5x of resolve
at 100, and under a quarter of the scan at 2000.

    python benchmarks/bench_resolution.py [--repeat 7] [--sizes 100,500,2000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = "bench-target"

RESOLVE = """
import sys, time
sys.path.insert(0, {site!r})
t0 = time.perf_counter()
from rtpcore.plugins.allowlist import Allowlist
import rtpcore.plugins.resolution
t1 = time.perf_counter()
plan = Allowlist.from_cli(plugins=[{target!r}]).resolve()
t2 = time.perf_counter()
assert [e.name for e in plan.entries] == ["target"], plan
print(t2 - t1, t2 - t0)
"""

SCAN = """
import sys, time
sys.path.insert(0, {site!r})
t0 = time.perf_counter()
import importlib.metadata
t1 = time.perf_counter()
eps = importlib.metadata.entry_points()
t2 = time.perf_counter()
assert any(ep.name == "target" for ep in eps.select(group="rtpcore.plugins"))
print(t2 - t1, t2 - t0)
"""


def make_site(root: Path, count: int) -> Path:
    """A folder with ``count`` distributions; ``bench-target`` is one of them, mid-listing."""
    site = root / f"site{count}"
    site.mkdir()
    names = [f"fake-dist-{i:05d}" for i in range(count - 1)]
    names.insert(len(names) // 2, TARGET)
    for name in names:
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nSummary: fake\n"
        )
        group = "rtpcore.plugins" if name == TARGET else "console_scripts"
        value = (
            "target = bench_target.hooks"
            if name == TARGET
            else f"{name} = {name.replace('-', '_')}:main"
        )
        (info / "entry_points.txt").write_text(f"[{group}]\n{value}\n")
        (info / "RECORD").write_text("")
    return site


def measure(code: str, repeat: int) -> tuple[float, float]:
    """Best (call, cold) seconds over ``repeat`` fresh interpreters (the least disturbed run,
    as ``timeit`` reports; a loaded machine only ever adds time)."""
    calls, colds = [], []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        call, cold = map(float, out.stdout.split())
        calls.append(call)
        colds.append(cold)
    return min(calls), min(colds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=7, help="fresh interpreters per figure (best kept)"
    )
    parser.add_argument(
        "--sizes", default="100,500,2000", help="comma-separated distribution counts"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for count in sizes:
            site = make_site(Path(tmp), count)
            resolve = measure(RESOLVE.format(site=str(site), target=TARGET), args.repeat)
            scan = measure(SCAN.format(site=str(site)), args.repeat)
            results[count] = (resolve, scan)
    base = results[sizes[0]][0]
    print(
        f"{'dists':>6} | {'resolve':>10} | {'scan':>10} | {'resolve/scan':>12} | {'vs ' + str(sizes[0]):>8} | "
        f"{'resolve+imports':>15} | {'scan+imports':>12} | {'ratio':>6}"
    )
    print("-" * 101)
    for count, ((r_call, r_cold), (s_call, s_cold)) in results.items():
        print(
            f"{count:>6} | {r_call * 1e3:>7.2f} ms | {s_call * 1e3:>7.1f} ms | {r_call / s_call:>12.3f} | "
            f"{r_call / base[0]:>7.2f}x | {r_cold * 1e3:>12.1f} ms | {s_cold * 1e3:>9.1f} ms | {r_cold / s_cold:>6.2f}"
        )
    last = sizes[-1]
    (r_call, r_cold), (s_call, s_cold) = results[last]
    verdicts = []
    for label, r, r0, sc in (
        ("call", r_call, base[0], s_call),
        ("+imports", r_cold, base[1], s_cold),
    ):
        growth, share = r / r0, r / sc
        verdicts += [growth <= 1.5, share < 0.25]
        print(
            f"\n{label:>8}: resolve at {last} is {growth:.2f}x resolve at {sizes[0]} (target <= 1.5x: "
            f"{'PASS' if growth <= 1.5 else 'FAIL'}); {share:.3f} of the scan (target < 0.25: "
            f"{'PASS' if share < 0.25 else 'FAIL'})"
        )
    return 0 if all(verdicts[:2]) else 1


if __name__ == "__main__":
    sys.exit(main())
