"""rtpcore.engine.memory: the default KV cap honours cgroup memory limits (real files in a temp folder)."""

from __future__ import annotations

from pathlib import Path

from rtpcore.engine.memory import cgroup_memory_limit, memory_limit, physical_memory

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
