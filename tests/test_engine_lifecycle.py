"""Engine lifetime: close() releases memory on every rank; a failed build leaves no worker behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from rtpcore import Engine
from rtpcore.errors import EngineClosedError, RtpcoreError
from test_llama import make_checkpoint

MiB = 1 << 20
POOL = 256 * MiB


def rss() -> int:
    """Resident bytes of this process, from /proc/self/statm."""
    resident = int(Path("/proc/self/statm").read_text().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE")


def worker_pids() -> set[int]:
    """Live child processes of this one that are multiprocessing workers (not the resource tracker)."""
    pids = set()
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in map(int, children.read_text().split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue  # already gone
            if b"spawn_main" in cmdline and state != "Z":
                pids.add(pid)
    return pids


RSS_PROBE = """
import gc, json, os, sys
from pathlib import Path
from rtpcore import Engine


def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


engine = Engine.from_pretrained(sys.argv[1], kv_cache_memory=int(sys.argv[2]))
engine.generate([[1, 2, 3]], max_new_tokens=2)
# every slot written, as in a server that has run a while (a CPU pool is resident only where written)
for cache in engine.kv_caches:
    for name in ("k", "v", "rows"):
        if getattr(cache, name, None) is not None:
            getattr(cache, name).fill_(0)
del cache
gc.collect()
held = rss()
engine.close()
gc.collect()
print(json.dumps({"held": held, "after": rss()}))
"""


def test_close_releases_the_kv_pool_memory(ckpt: Path) -> None:
    """Resident memory falls by about the KV pool's size when the engine closes, once every slot
    has been written. Measured in a fresh process: after hundreds of tests, this one's heap would
    blur the figure."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(ckpt), str(POOL)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] - got["after"] >= 0.9 * POOL, got


def test_every_call_after_close_raises_engine_closed_error(ckpt: Path) -> None:
    """generate and num_free_kv_blocks raise EngineClosedError (an RtpcoreError) once closed; close is idempotent."""
    with Engine.from_pretrained(ckpt) as engine:
        pass
    assert engine.model is None and engine.kv_caches == []
    with pytest.raises(EngineClosedError, match="this Engine is closed"):
        engine.generate([[1]])
    with pytest.raises(RtpcoreError, match="closed"):
        _ = engine.num_free_kv_blocks
    engine.close()


def build_fails(path: Path, **kwargs: object) -> RtpcoreError:
    """Build a two-rank engine that must fail; return its error after checking no worker survives."""
    before = worker_pids()
    start = time.monotonic()
    with pytest.raises(RtpcoreError) as excinfo:
        Engine.from_pretrained(path, tokens_per_block=4, tensor_parallel_size=2, **kwargs)
    # Two ranks importing torch and transformers take tens of seconds on a slow, busy machine;
    # a failure that waited for a timeout instead would take at least the 5-minute step timeout.
    assert time.monotonic() - start < 240
    assert worker_pids() - before == set()
    return excinfo.value


@pytest.mark.slow
def test_a_bad_generation_config_fails_the_build_and_stops_the_workers(tmp_path: Path) -> None:
    """An eos_token_id of [null] after the ranks started is one RtpcoreError naming it, and no worker is left."""
    make_checkpoint(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [None]}))
    err = build_fails(tmp_path)
    assert "eos_token_id" in str(err) or "NoneType" in str(err)


@pytest.mark.slow
def test_a_bad_kv_option_fails_the_build_and_stops_the_workers(tmp_path: Path) -> None:
    """An unknown fp8 KV layout is an RtpcoreError naming it, and no worker is left."""
    make_checkpoint(tmp_path)
    err = build_fails(tmp_path, kv_cache_dtype="fp8", kv_layout="no-such-layout")
    assert "no-such-layout" in str(err)


@pytest.mark.slow
def test_a_checkpoint_error_on_the_ranks_fails_the_build_and_stops_the_workers(tmp_path: Path) -> None:
    """A truncated weights file is an RtpcoreError naming it, and no worker is left."""
    make_checkpoint(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = build_fails(tmp_path)
    assert weights.name in str(err)


@pytest.mark.slow
def test_close_stops_every_rank(tmp_path: Path) -> None:
    """close() on a two-rank engine leaves no worker process."""
    make_checkpoint(tmp_path)
    before = worker_pids()
    engine = Engine.from_pretrained(tmp_path, tokens_per_block=4, tensor_parallel_size=2)
    assert worker_pids() - before == set(engine._group.pids.values())
    engine.close()
    assert worker_pids() - before == set() and engine._group is None
