"""A fake Hugging Face Hub for the tests: the file API of model repositories, served on
127.0.0.1 from folders a test writes, recording every request.

``huggingface_hub`` downloads a file with ``HEAD /{repo}/resolve/{revision}/{file}`` (it
reads the commit from ``X-Repo-Commit``, the blob's name from ``ETag`` and the size from
``Content-Length``), then a ``GET`` of the same address. A 404 carries ``X-Error-Code``:
``RepoNotFound``, ``RevisionNotFound`` or ``EntryNotFound`` (the last with the commit, so
that the library can remember the file's absence), which the library turns into its
exception classes; a private repository answers 401 to a request without its token.
``list_repo_files`` asks ``GET /api/models/{repo}/tree/{revision}?recursive=True``: the
answer is one page, a JSON list of ``{"type": "file", "path", "size", "oid"}``.

    with FakeHub() as hub:
        commit = hub.add("org/tiny", folder)              # revision "main"
        hub.add("org/tiny", other_folder, revision="v2")
        with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)):
            ...                                           # huggingface_hub talks to it
        hub.downloads("org/tiny")                          # files fetched with GET, in order
        hub.listings("org/tiny")                           # revisions whose file list was asked

:func:`hub_environment` sets environment variables and re-reads ``huggingface_hub.constants``,
which the library computes from the environment once, at import.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from attrs import frozen


@frozen
class Request:
    method: str
    repo_id: str | None  # None: not a file address of the API served here
    revision: str | None
    filename: str | None
    path: str
    authorization: str | None


@frozen
class _Revision:
    name: str
    commit: str
    folder: Path


class FakeHub:
    """Repositories -> revisions -> folders, served over HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, _Revision]] = {}
        self.tokens: dict[str, str] = {}  # private repository -> the token it accepts
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- content ---------------------------------------------------------------------------

    def add(self, repo_id: str, folder: Path, *, revision: str = "main", token: str | None = None) -> str:
        """Serve ``folder`` as ``revision`` of ``repo_id`` (private when ``token`` is given);
        return the revision's commit hash (40 hex digits, from the repository, the revision
        and the files)."""
        digest = hashlib.sha1(f"{repo_id}@{revision}".encode())
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(file.relative_to(folder).as_posix().encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
        commit = digest.hexdigest()
        self.repos.setdefault(repo_id, {})[revision] = _Revision(revision, commit, folder)
        if token is not None:
            self.tokens[repo_id] = token
        return commit

    # -- what was asked ----------------------------------------------------------------------

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """The files fetched with GET (of ``repo_id``, when given), in order."""
        with self._lock:
            return [
                r.filename for r in self.requests
                if r.method == "GET" and r.filename is not None and repo_id in (None, r.repo_id)
            ]

    def listings(self, repo_id: str | None = None) -> list[str | None]:
        """The revisions whose file list was asked (of ``repo_id``, when given), in order."""
        with self._lock:
            return [
                r.revision for r in self.requests
                if r.filename is None and r.path.startswith("/api/models/") and repo_id in (None, r.repo_id)
            ]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- the server ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "FakeHub is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answers ---------------------------------------------------------------------------

    def answer(self, method: str, raw_path: str, headers: Any) -> tuple[int, dict[str, str], Path | bytes | None]:
        """(status, headers, file or bytes to send) for one request, recorded."""
        path = urlsplit(raw_path).path
        parts = path.lstrip("/").split("/")
        auth = headers.get("Authorization")
        if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            repo_id, revision = f"{parts[2]}/{parts[3]}", unquote(parts[5])
            self._record(Request(method, repo_id, revision, None, path, auth))
            found = self._revision(repo_id, revision, auth)
            if not isinstance(found, _Revision):
                return *found, None
            return 200, {"Content-Type": "application/json"}, json.dumps(_tree(found.folder)).encode()
        if len(parts) < 5 or parts[2] != "resolve":
            self._record(Request(method, None, None, None, path, auth))
            return 404, {"X-Error-Message": "not served by FakeHub"}, None
        repo_id, revision = f"{parts[0]}/{parts[1]}", unquote(parts[3])
        filename = unquote("/".join(parts[4:]))
        self._record(Request(method, repo_id, revision, filename, path, auth))
        found = self._revision(repo_id, revision, auth)
        if not isinstance(found, _Revision):
            return *found, None
        rev = found
        file = rev.folder / filename
        if not file.is_file():
            return 404, {
                "X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found", "X-Repo-Commit": rev.commit,
            }, None
        data = file.read_bytes()
        return 200, {
            "X-Repo-Commit": rev.commit,
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "Content-Length": str(len(data)),
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }, file

    def _revision(self, repo_id: str, revision: str, auth: str | None) -> _Revision | tuple[int, dict[str, str]]:
        """The revision asked for, or the Hub's error answer (status, headers)."""
        revisions = self.repos.get(repo_id)
        token = self.tokens.get(repo_id)
        if revisions is None or (token is not None and auth != f"Bearer {token}"):
            status = 404 if revisions is None else 401  # the Hub hides a private repository as well
            return status, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
        rev = revisions.get(revision) or next((r for r in revisions.values() if r.commit == revision), None)
        if rev is None:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": f"Invalid rev id: {revision}"}
        return rev

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self._respond(body=False)

        def do_GET(self) -> None:
            self._respond(body=True)

        def _respond(self, *, body: bool) -> None:
            status, headers, file = hub.answer(self.command, self.path, self.headers)
            if isinstance(file, bytes):  # a listing
                headers = {**headers, "Content-Length": str(len(file))}
                data, file = (file if body else b""), None
            else:
                data = file.read_bytes() if file is not None and body else b""
            start = _range_start(self.headers.get("Range")) if body and file is not None else None
            if start is not None:  # a resumed download: the rest of the file
                status, data = 206, data[start:]
                size = int(headers["Content-Length"])
                headers = {**headers, "Content-Range": f"bytes {start}-{size - 1}/{size}"}
                headers["Content-Length"] = str(len(data))
            elif file is None and "Content-Length" not in headers:
                headers = {**headers, "Content-Length": "0"}
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if body and data:
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads hub.requests
            pass

    return Handler


def _tree(folder: Path) -> list[dict[str, Any]]:
    """The Hub's tree listing of ``folder``, recursive: its files."""
    return [
        {"type": "file", "path": f.relative_to(folder).as_posix(), "size": f.stat().st_size,
         "oid": hashlib.sha1(f.read_bytes()).hexdigest()}
        for f in sorted(p for p in folder.rglob("*") if p.is_file())
    ]


def _range_start(value: str | None) -> int | None:
    if not value or not value.startswith("bytes=") or not value.endswith("-"):
        return None
    start = value[len("bytes="):-1]
    return int(start) if start.isdigit() and int(start) > 0 else None


HF_VARIABLES = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")


@contextmanager
def hub_environment(**env: str) -> Iterator[None]:
    """Run with ``env`` as the Hub variables (the others of HF_VARIABLES unset) and
    ``huggingface_hub.constants`` re-read from it; afterwards both as they were."""
    saved = {name: os.environ.get(name) for name in HF_VARIABLES}
    try:
        for name in HF_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(env)
        _reread()
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _reread()


def _reread() -> None:
    import huggingface_hub.constants
    import huggingface_hub.utils

    importlib.reload(huggingface_hub.constants)
    reset = getattr(huggingface_hub.utils, "reset_sessions", None)  # < 1.0 fixes offline mode in its sessions
    if reset is not None:
        reset()
