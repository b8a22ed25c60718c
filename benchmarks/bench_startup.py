"""What the warm-up forward costs at start-up (rtpcore.engine.worker.rank.EngineShard.warm_up).

For each model: the whole ``Engine.from_pretrained`` (plugins, config, weights, KV pools,
warm-up) and the warm-up alone (``engine.warm_up_seconds``), best of ``--repeats`` builds, and
the warm-up's share of the build. Models: the demo Llama, atom-plugin's demo DeepSeek-V3 (when
atom-plugin is installed), and SmolLM2-135M's shape with seeded random weights (30 layers,
float32; the model benchmarks/bench_decode.py runs)::

    python benchmarks/bench_startup.py [--repeats 3] [--models llama,deepseek_v3,smollm2]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import cpu_line, make_smollm2


def checkpoint(name: str, tmp: Path) -> tuple[str, list[str]] | None:
    """The checkpoint folder of ``name`` and the plugins it needs; None when unavailable here."""
    from rtpcore.testing import demo_checkpoint

    if name == "llama":
        return str(demo_checkpoint("llama")), []
    if name == "deepseek_v3":
        if importlib.util.find_spec("atom_plugin") is None:
            return None
        return str(demo_checkpoint("deepseek_v3", plugins=["atom-plugin"])), ["atom-plugin"]
    path = tmp / "smollm2"
    make_smollm2(path)
    return str(path), []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="llama,deepseek_v3,smollm2")
    args = parser.parse_args(argv)
    from rtpcore import Engine

    print(cpu_line())
    print(f"{'model':<14} {'build s':>8} {'warm-up ms':>11} {'share':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            found = checkpoint(name, Path(tmp))
            if found is None:
                print(f"{name:<14} skipped: its plugin is not installed")
                continue
            path, plugins = found
            best_build = best_warm = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                with Engine.from_pretrained(path, plugins=plugins) as engine:
                    build = time.perf_counter() - started
                    best_build, best_warm = min(best_build, build), min(best_warm, engine.warm_up_seconds)
            print(f"{name:<14} {best_build:8.2f} {1000 * best_warm:11.1f} {best_warm / best_build:7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
