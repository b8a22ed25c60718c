"""Hugging Face Hub ids as checkpoints: ``org/name`` or ``org/name@revision``, downloaded pruned.

Wherever rtpcore takes a checkpoint path, a string that names no existing path and has the
form ``org/name[@revision]`` (:func:`hub_id`) is a model on the Hub. A local folder always
wins. :func:`resolve_checkpoint` fetches it through ``huggingface_hub`` into the Hub cache and
returns the snapshot folder, which the rest of rtpcore reads as any checkpoint folder::

    config.json                      first: it fixes the commit every later file comes from
    weights(hf_config)               the caller's WeightRequests (the engine asks the plugins)
    model.safetensors.index.json     then only the shards holding a requested tensor
                                     (checkpoint.request.shards_needed, the loader's own rule),
                                     or model.safetensors when the repository has no index
    tokenizer, generation files      those of EXTRA_FILES the repository has

A draft of one layer, or the MTP layer of a model whose other shards are cached, fetches the
shards it reads and no other. ``huggingface_hub`` applies its own environment: ``HF_ENDPOINT``,
``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` as it reads them when first imported,
``HF_TOKEN`` at every request. Offline, everything comes from the cache or fails by name.

A GGUF repository (docs/design.md §20) usually holds several quantizations and no config.json:
the file carries the config, the tokenizer and the chat template. ``gguf_file=NAME`` fetches
that file alone (every part of a split set, named by any part), and the checkpoint is its
path in the snapshot folder (the first part's). Without it, a repository that has no
config.json but exactly one GGUF model (a file or a split set) gets that model; several are an
error listing them. The repository's files are listed (``huggingface_hub``'s
``list_repo_files``; offline, those cached of the revision) only when config.json, the
safetensors or ``NAME`` are missing, to find or name the GGUF models it holds.

Every failure is a :class:`~rtpcore.errors.CheckpointError` naming the id, the file and the
Hub's answer (the library's exception chained, for ``--debug``); an id that is neither a
folder nor reachable names both readings.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from attrs import frozen

from rtpcore.checkpoint.gguf.reader import (
    check_gguf_name,
    describe_models,
    gguf_file_in,
    gguf_models,
    split_parts,
)
from rtpcore.checkpoint.index import INDEX_NAME, build_index
from rtpcore.checkpoint.loader import read_hf_config
from rtpcore.checkpoint.request import WeightRequest, shards_needed
from rtpcore.errors import CheckpointError

__all__ = ["EXTRA_FILES", "HubId", "hub_id", "resolve_checkpoint"]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
#: Fetched when the repository has them: what the tokenizer, the chat template and the
#: stop tokens are read from (rtpcore.serving, rtpcore.engine).
EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# A part starts with a letter, digit or underscore (so "./x" and "../x" stay paths); a
# revision is a branch, a tag, a commit or a ref such as "refs/pr/1".
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[A-Za-z0-9_.][A-Za-z0-9_./-]*))?")

#: What a caller needs of a checkpoint, given its config.json.
Weights = Callable[[dict[str, Any]], Iterable[WeightRequest]]


@frozen
class HubId:
    """A model repository on the Hub and the revision asked for (None: its default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def hub_id(ref: object) -> HubId | None:
    """The Hub id ``ref`` reads as, or None: a ``str`` (an ``os.PathLike`` is always a path)
    that names no existing path and has the form ``org/name`` or ``org/name@revision``."""
    if not isinstance(ref, str) or os.path.lexists(ref):
        return None
    match = HUB_ID.fullmatch(ref)
    if match is None:
        return None
    return HubId(match["repo"], match["revision"])


def resolve_checkpoint(
    ref: str | os.PathLike[str],
    *,
    weights: Weights | None = None,
    extras: Sequence[str] = EXTRA_FILES,
    gguf_file: str | None = None,
) -> str:
    """The local checkpoint folder of ``ref``: ``ref`` itself unless it is a Hub id
    (:func:`hub_id`), else the snapshot folder in the Hub cache, holding config.json, the
    shards that hold the tensors of ``weights(hf_config)`` (none when ``weights`` is None)
    and those of ``extras`` the repository has. A Hub repository without config.json whose
    only model is a GGUF file (or split set) gives that file's path instead.

    With ``gguf_file`` (a ``.gguf`` name within ``ref``), the path of that GGUF file: in the
    folder ``ref``, or fetched alone from the Hub id's repository (with the other parts of its
    split set), nothing else. ``gguf_file`` with a file as ``ref`` is a CheckpointError."""
    if gguf_file is not None:
        check_gguf_name(ref, gguf_file)
    hid = hub_id(ref)
    if hid is None:
        return os.fspath(ref) if gguf_file is None else str(gguf_file_in(ref, gguf_file))
    download = _Download(hid, str(ref))
    return str(download.run(weights, extras) if gguf_file is None else download.gguf(gguf_file))


class _Unavailable(Exception):
    """The first file could not be had; ``reason`` says why in a few words, the Hub's answer
    included; ``missing``: the repository answered that it has no such file."""

    def __init__(self, reason: str, cause: BaseException, *, missing: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.cause = cause
        self.missing = missing


class _Download:
    """The files of one Hub id, fetched one by one into the Hub cache."""

    def __init__(self, hid: HubId, ref: str):
        self.hid = hid
        self.ref = ref
        self.revision = hid.revision  # pinned to the commit once the first file is in
        self.pinned = False

    def run(self, weights: Weights | None, extras: Sequence[str]) -> Path:
        try:
            config = self.fetch(CONFIG_NAME)
        except _Unavailable as exc:
            files = self.listing() if exc.missing or _offline() else None
            models = gguf_models(files or ())
            if len(models) == 1:  # a GGUF repository of one model: the file is the config
                logger.info("%s: no %s; fetching its one GGUF model %r", self.hid, CONFIG_NAME, models[0])
                return self.gguf(models[0])
            if models:
                raise CheckpointError(
                    f"Hugging Face Hub model {self.hid}: it has no {CONFIG_NAME!r} but {len(models)} GGUF models "
                    f"({describe_models(models)}); pass one as --gguf-file NAME (gguf_file=NAME)",
                    path=self.ref,
                ) from exc.cause
            raise self.not_found(exc) from exc.cause
        assert config is not None
        snapshot = self.pin(config, CONFIG_NAME)
        if weights is not None:
            requests = list(weights(read_hf_config(snapshot)))  # a model no plugin serves fails here
            self.fetch_weights(snapshot, requests)
        for name in extras:
            self.fetch(name, optional=True)
        return snapshot

    def gguf(self, name: str) -> Path:
        """The snapshot path of the GGUF model ``name`` (the first part of a split set named by
        any part), fetched with the other parts of its set and nothing else."""
        parts = split_parts(name)
        try:
            first = self.fetch(name)
        except _Unavailable as exc:
            if not exc.missing:
                raise self.not_found(exc) from exc.cause
            files = self.listing()
            models = gguf_models(files or ())
            held = (
                "its files could not be listed" if files is None
                else f"its GGUF files: {describe_models(models)}" if models else "it has no .gguf file"
            )
            raise CheckpointError(
                f"Hugging Face Hub model {self.hid}: the repository has no file {name!r} at revision "
                f"{self.revision or 'main'!r} (gguf_file); {held}",
                path=self.ref,
            ) from exc.cause
        assert first is not None
        snapshot = self.pin(first, name)
        for part in parts:
            if part != name:
                self.fetch(part)
        logger.info("%s: fetched GGUF %r (%d part(s), commit %s)", self.hid, parts[0], len(parts), self.revision)
        return snapshot / parts[0]

    def pin(self, file: Path, name: str) -> Path:
        """The snapshot folder ``file`` (the repository's ``name``) lies in,
        ``<cache>/models--org--name/snapshots/<commit>/``; later files come from that commit."""
        snapshot = file.parents[len(PurePosixPath(name).parts) - 1]
        self.revision, self.pinned = snapshot.name, True
        return snapshot

    def listing(self) -> list[str] | None:
        """The repository's files at the revision: the Hub's list; offline, the files cached of
        the revision; None when neither can be had."""
        if _offline():
            return _cached_files(self.hid.repo_id, self.revision or "main")
        from huggingface_hub import HfApi

        try:
            return list(HfApi().list_repo_files(self.hid.repo_id, revision=self.revision))
        except Exception as exc:  # the listing only decorates an error, or finds a GGUF model
            logger.debug("%s: cannot list the repository's files: %s", self.hid, _reason(exc))
            return None

    def not_found(self, exc: _Unavailable) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.ref!r} is neither a local folder (no such path: {os.path.abspath(self.ref)!r}) "
            f"nor a model on the Hugging Face Hub ({_endpoint()}): {self.hid}: {exc.reason}",
            path=self.ref,
        )

    def fetch_weights(self, snapshot: Path, requests: list[WeightRequest]) -> None:
        index_file = self.fetch(INDEX_NAME, optional=True)
        if index_file is None:
            if self.fetch(SINGLE_FILE, optional=True) is None:
                models = gguf_models(self.listing() or ())
                hint = (
                    f"; its GGUF models: {describe_models(models)}: pass one as --gguf-file NAME (gguf_file=NAME)"
                    if models else " (only safetensors checkpoints are supported, or a GGUF file named by gguf_file)"
                )
                raise self.failure(f"it has neither {INDEX_NAME!r} nor {SINGLE_FILE!r}{hint}")
            return
        index = build_index(index_file)
        needed = shards_needed(index, requests)
        logger.info(
            "%s: fetching %d of %d shards (commit %s)", self.hid, len(needed), len(index.files), self.revision
        )
        for shard in needed:
            self.fetch(shard.relative_to(snapshot).as_posix())

    def fetch(self, filename: str, *, optional: bool = False) -> Path | None:
        """The cached file; None when ``optional`` and the repository (or, offline, the cache)
        has no such file. Raises :class:`_Unavailable` for the first file (before the commit is
        pinned), CheckpointError after."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        error: Exception
        missing = False
        try:
            return Path(hf_hub_download(self.hid.repo_id, filename, revision=self.revision))
        except LocalEntryNotFoundError as exc:  # neither fetched nor cached
            if optional and _offline():
                return None
            reason, error = _local_reason(exc, filename), exc
        except EntryNotFoundError as exc:  # the Hub's 404 for a file (a subclass: RemoteEntryNotFoundError)
            if optional:
                return None
            reason = f"the repository has no file {filename!r} at revision {self.revision or 'main'!r}"
            error, missing = exc, True
        except Exception as exc:  # the library's errors end here, as rtpcore's own
            reason, error = _reason(exc), exc
        if not self.pinned:
            raise _Unavailable(reason, error, missing=missing)
        raise self.failure(f"cannot fetch {filename!r}: {reason}") from error

    def failure(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"Hugging Face Hub model {self.hid} (commit {self.revision}): {problem}", path=self.ref
        )


def _cached_files(repo_id: str, revision: str) -> list[str] | None:
    """The files the Hub cache holds of ``revision`` (a branch or tag through its ref, or a
    commit) of the model ``repo_id``; None when it holds no snapshot of it."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    repo = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _local_reason(exc: BaseException, filename: str) -> str:
    """Why a file is neither fetched nor cached: offline mode, or the Hub out of reach."""
    from huggingface_hub import constants

    cache = str(constants.HF_HUB_CACHE)
    if _offline():
        return f"HF_HUB_OFFLINE is set and the cache {cache!r} holds no {filename!r} of this revision"
    cause = exc.__cause__ or exc.__context__
    detail = f" ({type(cause).__name__}: {_first_line(cause)})" if cause is not None else ""
    return f"cannot reach {_endpoint()} and the cache {cache!r} holds no {filename!r}{detail}"


def _reason(exc: Exception) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return f"the repository is gated: accept its terms on the Hub and set HF_TOKEN ({_answer(exc)})"
    if isinstance(exc, RepositoryNotFoundError):
        return f"no such model repository, or it is private and HF_TOKEN grants no access ({_answer(exc)})"
    if isinstance(exc, RevisionNotFoundError):
        return f"the repository has no such revision ({_answer(exc)})"
    if isinstance(exc, HFValidationError):
        return f"not a valid repository id or revision ({_first_line(exc)})"
    if isinstance(exc, HfHubHTTPError):
        return _answer(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _answer(exc: Any) -> str:
    """The Hub's answer: the status and the server's message when it sent one."""
    response = getattr(exc, "response", None)
    status = f"HTTP {response.status_code}" if response is not None else type(exc).__name__
    message = getattr(exc, "server_message", None)
    return f"{status}: {message}" if message else f"{status}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__
