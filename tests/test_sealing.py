"""Ranks of one engine accept objects only from each other: sealed messages, secret
files, and forged messages and failure reports that are refused without being
unpickled, with real processes, real stores and real files."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _tp_toys import (
    Booby,
    build_toy,
    mlp_reference,
    mlp_weights,
    refusing_follower,
    run_env_ranks,
    toy_inputs,
)
from rtpcore.errors import RtpcoreError, WorkerError
from rtpcore.parallel.context import Rendezvous, env_store, init_parallel, local_store
from rtpcore.parallel.leader import WorkerGroup
from rtpcore.parallel.sealing import (
    BadSeal,
    env_secret,
    new_secret,
    read_secret_file,
    seal_object,
    unseal_object,
)

TOYS = Path(__file__).with_name("_tp_toys.py")
ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "RTPCORE_SECRET_FILE")


def _secret_file(path: Path, content: bytes = b"0123456789abcdef" * 4 + b"\n") -> Path:
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def test_a_sealed_object_round_trips_under_its_label_and_secret():
    secret = new_secret()
    blob = seal_object(secret, "rtpcore/broadcast_object/1", {"a": [1, 2]})
    assert unseal_object(secret, "rtpcore/broadcast_object/1", blob) == {"a": [1, 2]}


@pytest.mark.parametrize(
    "change",
    ["other secret", "other label", "flipped tag bit", "flipped data bit", "truncated"],
)
def test_a_forged_or_altered_message_is_refused_before_unpickling(tmp_path, change):
    """A bad tag raises BadSeal and the pickle, whose unpickling would create a file,
    never runs."""
    marker = tmp_path / "unpickled"
    secret, label = new_secret(), "rtpcore/error/1"
    blob = bytearray(seal_object(secret, label, Booby(str(marker))))
    if change == "other secret":
        blob = bytearray(seal_object(new_secret(), label, Booby(str(marker))))
    elif change == "flipped tag bit":
        blob[0] ^= 1
    elif change == "flipped data bit":
        blob[-2] ^= 1
    elif change == "truncated":
        blob = blob[:20]
    with pytest.raises(BadSeal):
        unseal_object(secret, "rtpcore/error/2" if change == "other label" else label, bytes(blob))
    assert not marker.exists()


def test_a_secret_file_is_read_without_its_trailing_newline(tmp_path):
    path = _secret_file(tmp_path / "secret")
    assert read_secret_file(path) == b"0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("mode", "content", "message"),
    [
        (0o644, b"0123456789abcdef" * 4, r"mode -rw-r--r--: other users could read or change it"),
        (0o620, b"0123456789abcdef" * 4, r"mode -rw--w----: other users"),
        (0o600, b"short\n", r"holds 5 bytes; it needs at least 16"),
    ],
)
def test_a_secret_file_others_can_read_or_a_short_one_is_refused(tmp_path, mode, content, message):
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(RtpcoreError, match=message):
        read_secret_file(path)


def test_a_missing_secret_file_is_named(tmp_path):
    with pytest.raises(RtpcoreError, match=r"cannot read the secret file '.*nope'"):
        read_secret_file(tmp_path / "nope")


def test_ranks_beyond_loopback_without_a_secret_file_refuse_to_meet(monkeypatch):
    """MASTER_ADDR off this machine and no RTPCORE_SECRET_FILE: an error naming the
    variable, before anything listens or connects."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    env = {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        RtpcoreError, match=r"'10\.255\.255\.1' is not a loopback.*RTPCORE_SECRET_FILE"
    ):
        env_store()


def test_the_named_secret_file_wins_and_loopback_ranks_share_a_per_user_default(
    tmp_path, monkeypatch
):
    named = _secret_file(tmp_path / "named")
    monkeypatch.setenv("RTPCORE_SECRET_FILE", str(named))
    assert env_secret("10.0.0.1") == read_secret_file(named)
    monkeypatch.delenv("RTPCORE_SECRET_FILE")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    first = env_secret("127.0.0.1")
    assert env_secret("localhost") == first and len(first) >= 32
    default = tmp_path / "run" / "rtpcore" / "tp-secret"
    assert default.stat().st_mode & 0o777 == 0o600


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net shows them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_spawned_ranks_store_listens_on_loopback_only():
    store = local_store(2)
    assert _listening(store.port) == {"0100007F"}  # 127.0.0.1, not every interface


@pytest.mark.slow
def test_a_follower_refuses_a_broadcast_not_sealed_with_the_engine_secret(tmp_path):
    """Rank 0 seals with another secret a pickle whose unpickling would create a file:
    the follower raises CollectiveError and the file never appears."""
    store = local_store(2)
    out, marker = tmp_path / "seen", tmp_path / "unpickled"
    child = multiprocessing.get_context("spawn").Process(
        target=refusing_follower, args=(store.port, store.secret, str(out))
    )
    child.start()
    try:
        ctx = init_parallel(Rendezvous(store.store, new_secret()), 0, 2, device="cpu")
        ctx.broadcast_object(Booby(str(marker)))
        ctx.destroy()
    finally:
        child.join(300)  # only against a hang: it exits once it has seen the broadcast
    assert child.exitcode == 0
    assert out.read_text().startswith(
        "CollectiveError(op='broadcast_object', rank=1): broadcast_object on rank 1 of 2: "
        "the message from rank 0 failed authentication"
    )
    assert not marker.exists()


FORGE = """
import pickle, sys
from datetime import timedelta
import torch.distributed as dist

class Booby:
    def __reduce__(self):
        return (open, (sys.argv[2], "w"))

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                      timeout=timedelta(seconds=120))
record = (0, "RuntimeError", "forged", "forged", pickle.dumps(Booby()))
store.set("rtpcore/error/1", pickle.dumps(record))
"""


@pytest.mark.slow
def test_rank_0_refuses_a_failure_report_forged_into_its_store_from_outside(tmp_path):
    """Another process connects to the engine's store and writes a pickled failure report
    for rank 1 (unpickling it would create a file); rank 1 then dies. Rank 0's error says
    the report failed authentication, and the file never appears."""
    marker = tmp_path / "unpickled"
    group = WorkerGroup.spawn(build_toy, {"seed": 0}, 2)
    try:
        subprocess.run(
            [sys.executable, "-c", FORGE, str(group._store.port), str(marker)],
            check=True,
            timeout=300,  # a Python importing torch: generous, only against a hang
        )
        os.kill(group.pids[1], signal.SIGKILL)
        group._processes[1].join(120)  # rank 1 is dead before the step
        assert group._processes[1].exitcode == -signal.SIGKILL
        with pytest.raises(WorkerError) as excinfo:
            group.run("forward", toy_inputs())
    finally:
        group.close()
    assert excinfo.value.rank == 1
    assert "the failure report of tensor-parallel rank 1 in the rendezvous store" in str(
        excinfo.value
    )
    assert "failed authentication" in str(excinfo.value)
    assert not marker.exists()


def _two_nodes(tmp_path: Path, secrets: tuple[Path, Path]) -> list[tuple[int, str, str]]:
    """Rank 0 runs the toy script, rank 1 `python -m rtpcore.parallel.leader`, each with its
    secret file; (returncode, stdout, stderr) of each."""
    commands = ([sys.executable, str(TOYS)], [sys.executable, "-m", "rtpcore.parallel.leader"])
    secret_env = [{"RTPCORE_SECRET_FILE": str(secret)} for secret in secrets]
    return run_env_ranks(commands, extra_env=secret_env, pythonpath=[str(TOYS.parent)])


@pytest.mark.slow
def test_env_ranks_sharing_a_secret_file_meet(tmp_path):
    shared = _secret_file(tmp_path / "secret")
    (code0, out0, _), (code1, _, _) = _two_nodes(tmp_path, (shared, shared))
    assert (code0, code1) == (0, 0)
    expected = mlp_reference(toy_inputs(), mlp_weights(3))
    import torch

    assert torch.allclose(torch.tensor(json.loads(out0)["out"]), expected, atol=1e-5)


@pytest.mark.slow
def test_env_ranks_with_different_secret_files_refuse_each_other(tmp_path):
    """Rank 1 refuses rank 0's build message; rank 0 refuses rank 1's failure report:
    both fail, each saying what failed authentication."""
    a = _secret_file(tmp_path / "a")
    b = _secret_file(tmp_path / "b", b"fedcba9876543210" * 4)
    (code0, _, err0), (code1, _, err1) = _two_nodes(tmp_path, (a, b))
    assert code0 != 0 and code1 != 0
    assert "the message from rank 0 failed authentication" in err1
    assert "the failure report of tensor-parallel rank 1" in err0
    assert "failed authentication" in err0


def test_a_sealed_record_of_another_key_does_not_verify():
    """A genuine report copied to another rank's key is refused: the key is sealed in."""
    secret = new_secret()
    blob = seal_object(secret, "rtpcore/error/1", (1, "E", "m", "t", None))
    with pytest.raises(BadSeal):
        unseal_object(secret, "rtpcore/error/2", blob)
    assert pickle.loads(blob[32:]) == (1, "E", "m", "t", None)  # the tag is a 32-byte prefix
