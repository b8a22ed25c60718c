"""Benchmark resolving one distribution name against a full entry-point scan, in cold processes.

For 100, 500 and 2000 fake installed distributions (real ``*.dist-info`` folders with
METADATA, entry_points.txt and RECORD in one temporary site folder, first on ``sys.path``),
each measurement runs in a fresh interpreter, so every in-process cache (importlib-metadata's
folder listings, the import system's) starts cold; the OS page cache is warm:

- ``resolve``: ``Allowlist.from_cli(plugins=["bench-target"]).resolve()``, rtpcore's lookup
  (the distribution sits in the middle of the folder listing);
- ``lookup``: importlib-metadata's own name lookup, ``distributions(name="bench-target")``
  plus the match's ``entry_points``, for reference;
- ``scan``: ``importlib_metadata.entry_points()``, the baseline every "allowlist" that
  filters discovered plugins pays.

Two figures per measurement, the best of ``--repeat`` runs (the least disturbed, as
``timeit`` reports; a loaded machine only ever adds time): ``call``, the first call in the
fresh process (its modules imported before the clock starts), and ``+imports``, the same
call including those imports (``rtpcore.plugins.allowlist`` and ``rtpcore.plugins.resolution``
with importlib-metadata and attrs; or ``importlib_metadata`` alone). The target applies to
``call`` at the largest size: resolve under 15% of the scan. Exit status 1 when it is missed.

Then the patch check (docs/design.md §18, ``rtpcore.plugins.patches``): what loading one
plugin costs for the snapshot of every rtpcore module and public class and the comparison
after its hooks, with the whole engine and server imported (the most there is to compare),
against loading the same plugin in the same process, best of ``--repeat``. Target: under 5 ms.

    python benchmarks/bench_resolution.py [--repeat 9] [--sizes 100,500,2000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = "bench-target"
#: resolve / scan, first call in a fresh process, at the largest size.
SHARE = 0.15

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

LOOKUP = """
import sys, time
sys.path.insert(0, {site!r})
t0 = time.perf_counter()
import importlib_metadata
t1 = time.perf_counter()
(dist,) = importlib_metadata.distributions(name={target!r})
eps = dist.entry_points.select(group="rtpcore.plugins")
t2 = time.perf_counter()
assert [ep.name for ep in eps] == ["target"], eps
print(t2 - t1, t2 - t0)
"""

SCAN = """
import sys, time
sys.path.insert(0, {site!r})
t0 = time.perf_counter()
import importlib_metadata
t1 = time.perf_counter()
eps = importlib_metadata.entry_points()
t2 = time.perf_counter()
assert any(ep.name == "target" for ep in eps.select(group="rtpcore.plugins"))
print(t2 - t1, t2 - t0)
"""

KINDS = {"resolve": RESOLVE, "lookup": LOOKUP, "scan": SCAN}


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


def run_once(code: str) -> tuple[float, float]:
    """(call, call + imports) seconds of ``code`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    call, cold = map(float, out.stdout.split())
    return call, cold


def measure(site: Path, repeat: int) -> dict[str, tuple[float, float]]:
    """Best (call, call + imports) per kind over ``repeat`` rounds; the kinds take turns
    within a round, so a burst of load on the machine hits them alike."""
    runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for _ in range(repeat):
        for kind, code in KINDS.items():
            runs[kind].append(run_once(code.format(site=str(site), target=TARGET)))
    return {kind: (min(c for c, _ in r), min(w for _, w in r)) for kind, r in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=9, help="fresh interpreters per figure (best kept)"
    )
    parser.add_argument(
        "--sizes", default="100,500,2000", help="comma-separated distribution counts"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, dict[str, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for count in sizes:
            results[count] = measure(make_site(Path(tmp), count), args.repeat)
    print(f"first call in a fresh process, best of {args.repeat} (ms); ratios against scan")
    print(
        f"{'dists':>6} | {'resolve':>8} | {'lookup':>8} | {'scan':>8} | {'resolve/scan':>12} | "
        f"{'lookup/scan':>11} || {'+imports: resolve':>17} | {'scan':>8} | {'ratio':>6}"
    )
    print("-" * 110)
    for count, r in results.items():
        (rc, rw), (lc, _), (sc, sw) = r["resolve"], r["lookup"], r["scan"]
        print(
            f"{count:>6} | {rc * 1e3:>8.2f} | {lc * 1e3:>8.2f} | {sc * 1e3:>8.1f} | {rc / sc:>12.3f} | "
            f"{lc / sc:>11.3f} || {rw * 1e3:>17.1f} | {sw * 1e3:>8.1f} | {rw / sw:>6.2f}"
        )
    last = sizes[-1]
    share = results[last]["resolve"][0] / results[last]["scan"][0]
    ok = share < SHARE
    print(
        f"\nresolving one name at {last} distributions, first call: {share:.3f} of a full "
        f"importlib_metadata.entry_points() scan (target < {SHARE}: {'PASS' if ok else 'FAIL'})"
    )
    check, modules, classes = patch_check_cost(args.repeat)
    patch_ok = check < PATCH_CHECK_S
    print(f"patch check per plugin ({modules} rtpcore modules, {classes} public classes imported): "
          f"{check * 1e3:.2f} ms (target < {PATCH_CHECK_S * 1e3:.0f} ms: {'PASS' if patch_ok else 'FAIL'})")
    return 0 if ok and patch_ok else 1


#: The patch check's cost per plugin (docs/design.md §18).
PATCH_CHECK_S = 0.005


def patch_check_cost(repeat: int) -> tuple[float, int, int]:
    """Best-of-``repeat`` seconds of one plugin's snapshot and comparison, everything imported."""
    import importlib
    import time

    from rtpcore.plugins import patches

    for module in ("rtpcore.engine.engine", "rtpcore.serving.app"):  # every module there is to snapshot
        importlib.import_module(module)

    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        with patches.watch() as watch:
            changes = watch.changes()
        best = min(best, time.perf_counter() - started)
        assert not changes
    return best, len(watch.modules), len(watch.classes)


if __name__ == "__main__":
    sys.exit(main())
