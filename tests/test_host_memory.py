"""rtpcore.engine.worker.memory: the default KV cap honours cgroup memory limits (real files in a temp folder)."""

from __future__ import annotations

from pathlib import Path

from rtpcore.engine.worker.memory import cgroup_memory_limit, memory_limit, physical_memory

MiB = 1 << 20


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_cgroup_v2_memory_max_is_the_limit_and_max_means_none(tmp_path: Path) -> None:
    """A v2 memory.max of bytes is the limit; "max" means no limit."""
    write(tmp_path / "proc", "0::/app\n")
    write(tmp_path / "cg" / "app" / "memory.max", f"{512 * MiB}\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "proc") == 512 * MiB
    write(tmp_path / "cg" / "app" / "memory.max", "max\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_cgroup_v2_takes_the_tightest_limit_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    """A parent's smaller memory.max bounds its child."""
    write(tmp_path / "proc", "0::/pod/app\n")
    write(tmp_path / "cg" / "pod" / "memory.max", f"{300 * MiB}\n")
    write(tmp_path / "cg" / "pod" / "app" / "memory.max", "max\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "proc") == 300 * MiB


def test_cgroup_v1_limit_in_bytes_is_the_limit_and_huge_values_mean_none(tmp_path: Path) -> None:
    """A v1 memory.limit_in_bytes is the limit; the kernel's "unlimited" value is none."""
    write(tmp_path / "proc", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    limit = tmp_path / "cg" / "memory" / "docker" / "abc" / "memory.limit_in_bytes"
    write(limit, f"{256 * MiB}\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "proc") == 256 * MiB
    write(limit, "9223372036854771712\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_memory_limit_is_the_smaller_of_ram_and_the_cgroup_limit(tmp_path: Path) -> None:
    """A limit below RAM wins; a limit above RAM leaves RAM; no cgroup files leaves RAM."""
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg" / "memory.max", f"{64 * MiB}\n")
    assert memory_limit(tmp_path / "cg", tmp_path / "proc") == 64 * MiB
    write(tmp_path / "cg" / "memory.max", f"{physical_memory() * 4}\n")
    assert memory_limit(tmp_path / "cg", tmp_path / "proc") == physical_memory()
    assert memory_limit(tmp_path / "none", tmp_path / "no-proc") == physical_memory()


def test_without_proc_cgroup_the_roots_own_files_count(tmp_path: Path) -> None:
    """With no /proc/self/cgroup to read, the root's memory.max (a container's view) is used."""
    write(tmp_path / "cg" / "memory.max", f"{128 * MiB}\n")
    assert cgroup_memory_limit(tmp_path / "cg", tmp_path / "missing") == 128 * MiB


# -- a GPU's KV share (docs/design.md §13: utilization x device memory - weights - a step's peak) ----

GiB = 1 << 30


def test_gpu_kv_bytes_are_the_utilized_share_less_what_is_in_use_and_the_step_peak() -> None:
    """80 GiB at 0.9 with 16 GiB in use (weights) and a 2 GiB step peak leaves 72 - 16 - 2 GiB;
    nothing left is 0, never negative."""
    from rtpcore.engine.worker.memory import gpu_kv_cache_bytes

    got = gpu_kv_cache_bytes(total=80 * GiB, free=64 * GiB, peak_step=2 * GiB, utilization=0.9)
    assert got == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB
    assert gpu_kv_cache_bytes(total=80 * GiB, free=8 * GiB, peak_step=2 * GiB, utilization=0.9) == 0
    # memory other processes hold on the device counts as in use too
    assert gpu_kv_cache_bytes(total=80 * GiB, free=40 * GiB, peak_step=0, utilization=1.0) == 40 * GiB


class _Ranks:
    """A worker group whose ranks report stubbed device readings for ``profile_memory``."""

    def __init__(self, readings: list[tuple[int, int, int]]):
        self.readings = readings
        self.calls: list[tuple[str, object]] = []

    def run(self, method: str, payload: object = None, *, gather: bool = False, sync: bool = True) -> object:
        self.calls.append((method, payload))
        assert method == "profile_memory" and gather
        return self.readings


def test_a_gpu_engine_sizes_its_pool_from_every_ranks_measured_step_and_refuses_less_than_one_context(
    ckpt: Path,
) -> None:
    """On a GPU the pool is the tightest rank's share (each measures a max_num_batched_tokens step);
    a share below one max_model_len sequence is a KVCacheCapacityError naming the flags."""
    import attrs
    import pytest

    from rtpcore import Engine
    from rtpcore.engine.worker.memory import kv_cache_blocks
    from rtpcore.errors import KVCacheCapacityError
    from rtpcore.kv.specs import plan_blocks

    with Engine.from_pretrained(ckpt, tokens_per_block=4) as e:
        specs, config = e.kv_cache_specs, e.config
    block = sum(s.block_bytes for s in specs)
    gpu = attrs.evolve(config, device="cuda:0", gpu_memory_utilization=0.5, max_num_batched_tokens=512)
    ranks = _Ranks([(10 * block, 1000 * block, 1000 * block), (20 * block, 900 * block, 1000 * block)])
    blocks = kv_cache_blocks(specs, gpu, 256, ranks)
    # rank 1 is tighter: 500 - 100 in use - 20 peak = 380 blocks' worth
    assert blocks == plan_blocks(specs, 380 * block) == 380
    assert ranks.calls == [("profile_memory", 512)]
    with pytest.raises(KVCacheCapacityError, match="--max-model-len") as excinfo:
        kv_cache_blocks(specs, gpu, 256, _Ranks([(0, 520 * block, 1000 * block)]))
    assert excinfo.value.blocks_needed == 64 and excinfo.value.blocks_available == 20
