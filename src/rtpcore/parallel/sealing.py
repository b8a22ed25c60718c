"""The secret of one engine, and the messages its ranks seal with it.

Everything the ranks of an engine exchange as Python objects (rank 0's steps,
gathered results, failure reports in the rendezvous store) is pickled, and the
rendezvous store and the process-group sockets are TCP ports other processes can
reach. So every such message is *sealed*: an HMAC-SHA256 tag under the engine's
secret, over a label (what the message is, and its place in the sequence) and
the pickled bytes. The receiver checks the tag with :func:`hmac.compare_digest`
*before* unpickling; bytes with a bad tag are never unpickled. Tensors of the
collectives (``all_reduce``, ``all_gather``) are not pickled and are not sealed.

Where the secret comes from:

* Ranks spawned by the engine (one machine): rank 0 draws a fresh one with
  :func:`secrets.token_bytes` and hands it to each rank in its start arguments,
  over the multiprocessing spawn pipe.
* Ranks launched separately (``env://``, ``python -m rtpcore.parallel.leader``): every
  rank reads the file named by the environment variable ``RTPCORE_SECRET_FILE``
  (an environment variable because launchers such as ``torchrun`` pass the same
  environment to every rank; it names a secret, it is not plugin configuration).
  The file holds at least 16 bytes (e.g. ``openssl rand -hex 32``; a trailing
  newline is ignored), belongs to the user running the rank and is accessible to
  no one else (mode ``0600`` or ``0400``); otherwise it is refused.
  Without ``RTPCORE_SECRET_FILE``, ``MASTER_ADDR`` must be a loopback address
  (all ranks on this machine) and the ranks share a per-user secret file that
  the first rank creates, ``0600``, under ``$XDG_RUNTIME_DIR`` or
  ``~/.cache/rtpcore``: other users' processes cannot read it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import pickle
import secrets
import socket
import stat
from pathlib import Path
from typing import Any

from rtpcore.errors import RtpcoreError

__all__ = [
    "SECRET_FILE_VAR",
    "BadSeal",
    "env_secret",
    "is_loopback",
    "new_secret",
    "read_secret_file",
    "seal",
    "seal_object",
    "unseal",
    "unseal_object",
]

#: The environment variable naming the secret file of ``env://`` ranks.
SECRET_FILE_VAR = "RTPCORE_SECRET_FILE"

_TAG_BYTES = hashlib.sha256().digest_size
_MIN_SECRET_BYTES = 16
_DEFAULT_FILE = "tp-secret"


class BadSeal(Exception):
    """The tag of a message does not match: it was not sealed with this engine's secret.
    Callers turn it into the CollectiveError or WorkerError of the operation."""


def new_secret() -> bytes:
    """A fresh secret for one engine."""
    return secrets.token_bytes(32)


def _tag(secret: bytes, label: str, data: bytes) -> bytes:
    mac = hmac.new(secret, label.encode() + b"\0", hashlib.sha256)
    mac.update(data)
    return mac.digest()


def seal(secret: bytes, label: str, data: bytes) -> bytes:
    """``tag + data``, the tag covering ``label`` and ``data``."""
    return _tag(secret, label, data) + data


def unseal(secret: bytes, label: str, blob: bytes) -> bytes:
    """The data of a sealed ``blob``; raises BadSeal when its tag is not ours for ``label``."""
    tag, data = blob[:_TAG_BYTES], blob[_TAG_BYTES:]
    if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, label, data)):
        raise BadSeal(f"the {label} message is not sealed with this engine's secret")
    return data


def seal_object(secret: bytes, label: str, obj: Any) -> bytes:
    return seal(secret, label, pickle.dumps(obj))


def unseal_object(secret: bytes, label: str, blob: bytes) -> Any:
    """Check the tag, then unpickle; raises BadSeal (nothing unpickled) on a bad tag."""
    return pickle.loads(unseal(secret, label, blob))


# -- secrets of ranks launched separately (env://) ------------------------------------


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret held in ``path``; RtpcoreError when it is missing, too short, not
    a regular file of this user, or readable or writable by anyone else."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise RtpcoreError(f"cannot read the secret file {str(path)!r}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise RtpcoreError(f"the secret file {str(path)!r} is not a regular file")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise RtpcoreError(
                f"the secret file {str(path)!r} belongs to uid {info.st_uid}, not to this "
                f"user (uid {os.getuid()}); refused"
            )
        if info.st_mode & 0o077:
            raise RtpcoreError(
                f"the secret file {str(path)!r} has mode {stat.filemode(info.st_mode)}: other "
                f"users could read or change it; refused (run `chmod 600 {path}`)"
            )
        secret = f.read().rstrip(b"\r\n")
    if len(secret) < _MIN_SECRET_BYTES:
        raise RtpcoreError(
            f"the secret file {str(path)!r} holds {len(secret)} bytes; it needs at least "
            f"{_MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return secret


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (unresolvable: no)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses
    )


def env_secret(master_addr: str) -> bytes:
    """The secret of an ``env://`` rank: the file ``RTPCORE_SECRET_FILE`` names, or,
    when it is unset and ``master_addr`` is a loopback address, this user's default
    secret file (created on first use). RtpcoreError otherwise."""
    named = os.environ.get(SECRET_FILE_VAR)
    if named:
        return read_secret_file(named)
    if not is_loopback(master_addr):
        raise RtpcoreError(
            f"MASTER_ADDR={master_addr!r} is not a loopback address: ranks on several machines "
            f"need a shared secret, or anyone who reaches the rendezvous port could send them "
            f"commands. Name a secret file (mode 0600, the same content on every machine) "
            f"in the environment variable {SECRET_FILE_VAR}"
        )
    return read_secret_file(_default_secret_file())


def _default_secret_file() -> Path:
    """This user's secret file for ranks on one machine; created atomically, 0600."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "rtpcore" if runtime else Path.home() / ".cache" / "rtpcore"
    path = folder / _DEFAULT_FILE
    if path.exists():
        return path
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = folder / f".{_DEFAULT_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:
            os.link(temp, path)  # atomic: the first rank's secret wins, the others read it
        except FileExistsError:
            pass
        finally:
            temp.unlink()
    except OSError as exc:
        raise RtpcoreError(
            f"cannot create the default secret file {str(path)!r} ({exc.strerror}); name a "
            f"secret file (mode 0600) in the environment variable {SECRET_FILE_VAR}"
        ) from exc
    return path
