"""Every error rtpcore raises, in one place.

Each error carries the fields a caller needs to act on it (``.plugin``,
``.distribution``, ``.missing`` ...) besides a message that names the input and
the rule it broke. All derive from :class:`RtpcoreError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AllowlistError",
    "AttentionBackendError",
    "ChatTemplateError",
    "CheckpointError",
    "CollectiveError",
    "ConfigFieldError",
    "DeviceError",
    "EngineBuildError",
    "EngineClosedError",
    "InvalidRequestError",
    "KVBlockError",
    "KVCacheCapacityError",
    "KVCacheSpecError",
    "LogitsProcessorError",
    "MissingTensorsError",
    "PluginConflictError",
    "PluginError",
    "PluginIncompatibleError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PluginPatchError",
    "PluginVersionError",
    "QueueFullError",
    "RequestFailedError",
    "RtpcoreError",
    "ShardingError",
    "UnknownArchitectureError",
    "UnknownModelTypeError",
    "WorkerError",
]


class RtpcoreError(Exception):
    """Base class of every error rtpcore raises on purpose."""


class AllowlistError(RtpcoreError, ValueError):
    """An item of ``--plugins`` / ``--external-model-packages`` breaks a parse rule.

    ``.item`` is the offending text, ``.rule`` the rule it broke.
    """

    def __init__(self, message: str, *, item: str | None = None, rule: str | None = None):
        super().__init__(message)
        self.item = item
        self.rule = rule


class PluginError(RtpcoreError):
    """Base class of the errors tied to one requested plugin.

    ``.plugin`` is the requested item (or entry-point name), ``.distribution``
    and ``.version`` the distribution that provides it when known,
    ``.entry_point`` its ``module[:object]`` value when known, and ``.state``
    the outcome string shown by ``rtpcore plugins list``.
    """

    state: str = "error"

    def __init__(
        self,
        message: str,
        *,
        plugin: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
        state: str | None = None,
    ):
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.entry_point = entry_point
        if state is not None:
            self.state = state


class PluginNotFoundError(PluginError):
    """The requested distribution or entry point is not installed."""

    state = "not-installed"


class PluginVersionError(PluginError):
    """The installed version does not satisfy the requested specifier,
    or differs from the version a parent process resolved."""

    state = "version-mismatch"


class PluginIncompatibleError(PluginVersionError):
    """The plugin was written for another rtpcore: its distribution's ``Requires-Dist: rtpcore
    ...`` excludes the running rtpcore (checked before any of its code runs; state
    ``incompatible``, docs/design.md §18)."""

    state = "incompatible"


class PluginConflictError(PluginError):
    """Two providers claim the same thing (a distribution name on the path, a
    ``model_type``, an architecture or a KV layout name).

    ``.providers`` describes both sides, each a human-readable string naming
    distribution, version and module.
    """

    state = "conflict"

    def __init__(self, message: str, *, providers: Sequence[str] = (), **kwargs: object):
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.providers = tuple(providers)


class PluginLoadError(PluginError):
    """The plugin could not be imported (``import-failed``, cause chained) or
    its hooks or ModelPlugin classes failed validation (``invalid``)."""

    state = "import-failed"


class PluginPatchError(PluginLoadError):
    """A plugin replaced, added or deleted an attribute of an rtpcore module or public class
    while it was imported or its hooks ran (state ``patches``, docs/design.md §18). The change
    was undone and none of the plugin's registrations were applied. ``.patches`` lists each
    as ``(module or class, attribute, what happened)``."""

    state = "patches"

    def __init__(self, message: str, *, patches: Sequence[tuple[str, str, str]] = (), **fields: Any):
        super().__init__(message, **fields)
        self.patches = tuple(patches)


class UnknownArchitectureError(RtpcoreError, LookupError):
    """No registered model serves the checkpoint's architectures.

    ``.architectures`` are the ones asked for, ``.known`` the registered ones,
    ``.hints`` maps an architecture to installed-but-not-allowed plugins that
    declare it (``rtpcore.architectures`` entry points).
    """

    def __init__(
        self,
        message: str,
        *,
        architectures: Sequence[str] = (),
        known: Sequence[str] = (),
        hints: dict[str, list[str]] | None = None,
    ):
        super().__init__(message)
        self.architectures = tuple(architectures)
        self.known = tuple(known)
        self.hints = dict(hints or {})


class UnknownModelTypeError(UnknownArchitectureError):
    """No registered model has the requested ``model_type``. ``.known`` lists the registered ones."""


class CheckpointError(RtpcoreError):
    """A checkpoint file or directory is unusable. ``.path`` names the file; ``.key`` the
    metadata key or tensor at fault when there is one (a GGUF file's ``llama.block_count``,
    ``blk.0.attn_q.weight``), else None."""

    def __init__(self, message: str, *, path: object = None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key


class ChatTemplateError(RtpcoreError, ValueError):
    """A checkpoint's chat template failed on the given messages: the template raised
    (``raise_exception("Conversation roles must alternate ...")``) or broke on their
    shape. A client's mistake (an HTTP server answers 400). ``.checkpoint`` names the
    checkpoint folder when known."""

    def __init__(self, message: str, *, checkpoint: object = None):
        super().__init__(message)
        self.checkpoint = checkpoint


class ConfigFieldError(CheckpointError, ValueError):
    """A field of ``config.json`` (or ``generation_config.json``) is null, of the wrong
    type, out of range, or breaks a rule the model relies on.

    ``.file`` names the file, ``.field`` the field (``"rope_scaling.factor"`` for a
    nested one) and ``.value`` the value found (None when the field is missing).
    ``rtpcore.config_fields`` raises it.
    """

    def __init__(self, message: str, *, file: str = "config.json", field: str = "", value: object = None):
        super().__init__(message, path=file)
        self.file = file
        self.field = field
        self.value = value


class MissingTensorsError(CheckpointError):
    """Tensors the model requires are in no checkpoint file. ``.missing`` lists all of them."""

    def __init__(self, message: str, *, missing: Sequence[str] = (), path: object = None):
        super().__init__(message, path=path)
        self.missing = tuple(missing)


class AttentionBackendError(RtpcoreError, ValueError):
    """No attention backend can serve a layer, or the one asked for is unknown or cannot
    (``rtpcore.attention``). ``.backend`` names the backend (None: the automatic choice),
    ``.layer`` the layer's index, ``.reason`` the backend's own answer."""

    def __init__(self, message: str, *, backend: str | None = None, layer: int | None = None, reason: str = ""):
        super().__init__(message)
        self.backend = backend
        self.layer = layer
        self.reason = reason


class LogitsProcessorError(RtpcoreError):
    """A logits processor (``rtpcore.logits``) cannot be used or failed: an unknown name in
    ``logits_processors`` (``.known`` lists the registered ones), or an exception from its code
    in a step (the exception as ``__cause__``). ``.processor`` is its name, ``.provider`` who
    registered it (distribution, version and module) when known."""

    def __init__(self, message: str, *, processor: str, provider: str | None = None, known: Sequence[str] = ()):
        super().__init__(message)
        self.processor = processor
        self.provider = provider
        self.known = tuple(known)


class KVCacheSpecError(RtpcoreError, ValueError):
    """A KV-cache descriptor or layout is invalid. ``.tag`` names the layer."""

    def __init__(self, message: str, *, tag: str | None = None):
        super().__init__(message)
        self.tag = tag


class KVCacheCapacityError(RtpcoreError):
    """A request cannot fit in the engine's KV cache even when it is empty.

    ``.prompt_index`` names the request, ``.tokens_needed`` and ``.blocks_needed``
    what it would occupy, ``.blocks_available`` the cache's size in blocks.
    """

    def __init__(
        self,
        message: str,
        *,
        prompt_index: int | None = None,
        tokens_needed: int = 0,
        blocks_needed: int = 0,
        blocks_available: int = 0,
    ):
        super().__init__(message)
        self.prompt_index = prompt_index
        self.tokens_needed = tokens_needed
        self.blocks_needed = blocks_needed
        self.blocks_available = blocks_available


class ShardingError(RtpcoreError, ValueError):
    """A size cannot be split evenly across tensor-parallel ranks.

    ``.name`` names what was split (``"num_attention_heads"``, a tensor name),
    ``.size`` its size and ``.world_size`` the number of ranks.
    """

    def __init__(self, message: str, *, name: str, size: int, world_size: int):
        super().__init__(message)
        self.name = name
        self.size = size
        self.world_size = world_size


class CollectiveError(RtpcoreError):
    """A collective operation of a tensor-parallel group failed or timed out on this
    rank: a peer died, raised, or stopped answering. ``.rank`` is this rank, ``.op``
    the operation (``"all_reduce"``, ...). The worker group turns it into a
    :class:`WorkerError` naming the failing peer when it can tell.
    """

    def __init__(self, message: str, *, rank: int, op: str):
        super().__init__(message)
        self.rank = rank
        self.op = op


class WorkerError(RtpcoreError):
    """A tensor-parallel worker failed: it raised, died or stopped answering.

    ``.rank`` is the failing rank (None when it cannot be told), ``.exitcode``
    the process exit status when known (negative: killed by that signal) and
    ``.cause_type`` the name of the exception class the worker raised, if any.
    The worker's own exception, when it could be sent back, is ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exitcode: int | None = None,
        cause_type: str | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.cause_type = cause_type


class DeviceError(RtpcoreError):
    """A device an engine was asked to run on is unusable (``rtpcore.engine.worker.devices``).

    ``.device`` is the value given. ``.malformed`` is True when it is of none of the forms
    ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (a usage error: exit status 2 on the
    command line), False when it is well formed but this process's torch cannot see it
    or the tensor-parallel ranks cannot each take a device of their own (exit status 1);
    ``.available`` then lists the devices torch sees (``"cpu"``, ``"cuda:0"``, ...).
    """

    def __init__(
        self, message: str, *, device: object, malformed: bool = False, available: Sequence[str] = ()
    ):
        super().__init__(message)
        self.device = device
        self.malformed = malformed
        self.available = tuple(available)


class EngineBuildError(RtpcoreError):
    """Building an engine failed for a reason that is not already an RtpcoreError
    (a plugin's or model's own exception, in ``config_from_hf``, ``build_model`` or the
    warm-up forward the engine runs before it takes requests). Every worker process it
    started is stopped first. ``.checkpoint`` names the checkpoint; ``.plugin``,
    ``.distribution`` and ``.stage`` (``"config_from_hf"``, ``"build_model"``,
    ``"warm-up"``) name whose code failed where, when it was a plugin's (None
    otherwise); ``__cause__`` is the original exception."""

    def __init__(
        self,
        message: str,
        *,
        checkpoint: str,
        plugin: str | None = None,
        distribution: str | None = None,
        stage: str | None = None,
    ):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.plugin = plugin
        self.distribution = distribution
        self.stage = stage

    def __reduce__(self) -> tuple[object, ...]:  # it crosses from a tensor-parallel rank to rank 0
        fields = {"checkpoint": self.checkpoint, "plugin": self.plugin,
                  "distribution": self.distribution, "stage": self.stage}
        return (_rebuild_keywords, (type(self), str(self), fields))


def _rebuild_keywords(cls: type[RtpcoreError], message: str, fields: dict[str, object]) -> RtpcoreError:
    """Unpickle an error whose constructor takes keywords (``__reduce__``)."""
    return cls(message, **fields)


class EngineClosedError(RtpcoreError):
    """The engine was closed: its model and KV cache are released."""


class KVBlockError(RtpcoreError):
    """A KV block allocator invariant was broken: a block freed twice or never
    handed out, or more blocks taken than are free. ``.blocks`` lists the blocks
    concerned (empty for a count)."""

    def __init__(self, message: str, *, blocks: Sequence[int] = ()):
        super().__init__(message)
        self.blocks = tuple(blocks)


class InvalidRequestError(RtpcoreError, ValueError):
    """A request to an engine breaks a rule: an empty prompt, a token id outside the
    vocabulary, a bad sampling value, a prompt plus ``max_tokens`` beyond the model's
    context. ``.field`` names the offending field (``"temperature"``, ``"prompt"``,
    ...), ``.value`` is what was given. Nothing ran and no KV block was taken."""

    def __init__(self, message: str, *, field: str, value: object = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.value = value
        self.code = code  # OpenAI's error code where one applies ("context_length_exceeded")


class RequestFailedError(RtpcoreError):
    """One request's own step failed and ended it, while every other request went on:
    the model's forward raised on it alone (``.reason == "model_fault"``, the exception as
    ``__cause__``), its next-token distribution was not finite (``"non_finite"``: NaN or
    infinite logits, or every token masked), the grammar engine gave up on its grammar
    (``"grammar"``: a schema too large or recursive for it, found while decoding), or the
    engine's own bookkeeping of it raised (``"internal"``: a bug, logged with its traceback;
    docs/design.md §22), or a logits processor raised on it (``"logits_processor"``, the
    :class:`LogitsProcessorError` naming it as ``__cause__``). ``.request_id`` names it."""

    def __init__(self, message: str, *, request_id: str, reason: str):
        super().__init__(message)
        self.request_id = request_id
        self.reason = reason


class QueueFullError(RtpcoreError):
    """A request was refused because ``.max_waiting`` requests already wait for
    admission (an HTTP server answers 429). Nothing ran; retrying later may succeed."""

    def __init__(self, message: str, *, max_waiting: int):
        super().__init__(message)
        self.max_waiting = max_waiting
