"""What one plugin registers, recorded and validated before the registry applies any of it.

A :class:`RecordingView` is the ``registry`` argument plugin hooks receive. Each call is
validated at once (a bad call raises ``PluginLoadError`` with state ``invalid``), and
nothing reaches the :class:`~rtpcore.plugins.registry.ModelRegistry` until the whole plugin's hooks
have returned: a plugin whose hook fails leaves no registration behind.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from attrs import evolve, field, frozen

from rtpcore.errors import PluginLoadError
from rtpcore.plugins.model_plugin import ModelPlugin, model_plugin_problems, replaces_problem
from rtpcore_native import BUILTIN_LAYOUTS

BUILTIN_TOOL_PARSERS = ("hermes", "llama3_json")  # rtpcore.serving.tool_parsers; names plugins cannot take

__all__ = ["BUILTIN_LAYOUTS", "ModelRecord", "Provider", "RecordingView", "builtin_version", "first_line"]

# BUILTIN_LAYOUTS: the fp8 MLA layouts built into rtpcore_native; no plugin may register these names.

_TARGET_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_LAYOUT_RE = re.compile(r"[A-Za-z0-9_.-]+")


@frozen
class Provider:
    """Who registered something: the plugin (entry-point name), its distribution, version
    and module; ``builtin`` for rtpcore's own models."""

    plugin: str
    module: str
    distribution: str | None = None
    version: str | None = None
    builtin: bool = False

    @property
    def shown_version(self) -> str | None:
        """The version messages show: the built-in plugin's is rtpcore's own (read from its
        metadata only here, so that a worker loading a plan reads no other metadata)."""
        if self.builtin and self.version is None:
            return builtin_version()
        return self.version

    def __str__(self) -> str:
        kind = "built-in plugin" if self.builtin else "plugin"
        dist = f"{self.distribution} {self.shown_version}, " if self.distribution else ""
        return f"{kind} {self.plugin!r} ({dist}module {self.module})"

    def error_fields(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.shown_version,
            "entry_point": self.module,
        }


@frozen
class ModelRecord:
    """One registration: ``target`` is ``"module:Qualname"``; ``cls`` is set when a class was
    registered (None until first use for lazy registrations)."""

    model_type: str
    architectures: tuple[str, ...]
    target: str
    provider: Provider
    replaces: tuple[str, ...] = ()
    cls: type[ModelPlugin] | None = field(default=None, eq=False, repr=False)

    def with_architectures(self, architectures: tuple[str, ...]) -> ModelRecord:
        return (
            self
            if architectures == self.architectures
            else evolve(self, architectures=architectures)
        )

    def without(self, architecture: str) -> ModelRecord:
        return self.with_architectures(tuple(a for a in self.architectures if a != architecture))


class RecordingView:
    """The ``registry`` a plugin's hooks see: records registrations for one provider."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.models: list[ModelRecord] = []
        self.layouts: list[Any] = []
        self.tool_parsers: list[type[Any]] = []
        self.seams: dict[str, list[type[Any]]] = {}  # seam name -> classes (rtpcore.plugins.seams.SEAMS)

    def _invalid(self, message: str) -> PluginLoadError:
        return PluginLoadError(
            f"{self.provider}: {message}", state="invalid", **self.provider.error_fields()
        )

    def register(
        self,
        target: type[ModelPlugin] | str,
        *,
        model_type: str | None = None,
        architectures: Iterable[str] | None = None,
        replaces: Iterable[str] | None = None,
    ) -> None:
        """Register a ModelPlugin subclass, or lazily a ``"module:Class"`` string with its
        ``model_type`` and ``architectures`` (imported on first ``registry.get``, or by
        ``rtpcore plugins check``). ``replaces`` names built-in architectures or the built-in
        model type this registration takes over."""
        if isinstance(target, str):
            record = self._lazy_record(target, model_type, architectures, replaces)
        elif isinstance(target, type):
            problems = model_plugin_problems(target)
            if problems:
                raise self._invalid(
                    f"{target.__module__}.{target.__qualname__} is not a valid ModelPlugin: {'; '.join(problems)}"
                )
            given = {"model_type": model_type, "architectures": architectures, "replaces": replaces}
            passed = [k for k, v in given.items() if v is not None]
            if passed:
                raise self._invalid(
                    f"register({target.__qualname__}) takes {', '.join(passed)} from the class; do not pass them"
                )
            record = ModelRecord(
                model_type=target.model_type,
                architectures=tuple(target.architectures),
                target=f"{target.__module__}:{target.__qualname__}",
                provider=self.provider,
                replaces=tuple(target.replaces),
                cls=target,
            )
        else:
            raise self._invalid(
                f"register() takes a ModelPlugin subclass or a 'module:Class' string, got {target!r}"
            )
        self._add(record)

    def _lazy_record(
        self,
        target: str,
        model_type: str | None,
        architectures: Iterable[str] | None,
        replaces: Iterable[str] | None,
    ) -> ModelRecord:
        if not _TARGET_RE.fullmatch(target):
            raise self._invalid(f"lazy registration {target!r} must be 'package.module:Class'")
        if (
            not isinstance(model_type, str)
            or not model_type
            or any(c.isspace() for c in model_type)
        ):
            raise self._invalid(
                f"lazy registration {target!r} needs model_type=, a non-empty string without whitespace; got {model_type!r}"
            )
        archs = _names(architectures)
        if not archs:
            raise self._invalid(
                f"lazy registration {target!r} needs architectures=, a non-empty tuple of strings; got {architectures!r}"
            )
        repl = _names(replaces) if replaces is not None else ()
        if repl is None:
            raise self._invalid(
                f"lazy registration {target!r}: replaces must be a tuple of strings; got {replaces!r}"
            )
        if (problem := replaces_problem(repl, archs, model_type)) is not None:
            raise self._invalid(f"lazy registration {target!r}: {problem}")
        return ModelRecord(
            model_type=model_type,
            architectures=archs,
            target=target,
            provider=self.provider,
            replaces=repl,
        )

    def _add(self, record: ModelRecord) -> None:
        for other in self.models:
            if other.target == record.target and other.model_type == record.model_type:
                return  # the identical registration again
            if other.model_type == record.model_type:
                raise self._invalid(
                    f"model_type {record.model_type!r} registered twice, by {other.target} and {record.target}"
                )
            shared = sorted(set(other.architectures) & set(record.architectures))
            if shared:
                raise self._invalid(
                    f"architecture {shared[0]!r} registered twice, by {other.target} and {record.target}"
                )
        self.models.append(record)

    def register_tool_parser(self, cls: type[Any]) -> None:
        """Record a tool-call parser class (``rtpcore.ToolCallParser`` subclass)."""
        from rtpcore.plugins.tool_parser import tool_parser_problems

        problems = tool_parser_problems(cls)
        if problems:
            raise self._invalid(f"tool-call parser {getattr(cls, '__name__', cls)!r}: " + "; ".join(problems))
        if cls.name in BUILTIN_TOOL_PARSERS:
            from rtpcore.errors import PluginConflictError

            raise PluginConflictError(
                f"tool-call parser name {cls.name!r} is built into rtpcore (reserved: {', '.join(BUILTIN_TOOL_PARSERS)}); "
                f"{self.provider} must choose another name",
                providers=("rtpcore built-in tool-call parsers", str(self.provider)),
                state="conflict",
                **self.provider.error_fields(),
            )
        if any(p.name == cls.name for p in self.tool_parsers):
            raise self._invalid(f"tool-call parser {cls.name!r} registered twice")
        self.tool_parsers.append(cls)

    def register_reasoning_parser(self, cls: type[Any]) -> None:
        """Record a reasoning parser class (``rtpcore.reasoning.ReasoningParser`` subclass)."""
        self._register_on("reasoning_parsers", cls)

    def register_attention_backend(self, cls: type[Any]) -> None:
        """Record an attention backend class (``rtpcore.attention.AttentionBackend`` subclass)."""
        self._register_on("attention_backends", cls)

    def register_platform(self, cls: type[Any]) -> None:
        """Record a platform class (``rtpcore.platforms.Platform`` subclass)."""
        self._register_on("platforms", cls)

    def register_quantization_method(self, cls: type[Any]) -> None:
        """Record a quantization method class (``rtpcore.quantization.QuantizationMethod`` subclass)."""
        self._register_on("quantization_methods", cls)

    def register_logits_processor(self, cls: type[Any]) -> None:
        """Record a logits processor class (``rtpcore.logits.LogitsProcessor`` subclass)."""
        self._register_on("logits_processors", cls)

    def _register_on(self, seam_name: str, cls: object) -> None:
        """Record ``cls`` on the seam named ``seam_name``: invalid (a class the seam refuses, a
        name registered twice by this plugin) or incompatible (its ``api_version``) at once."""
        from rtpcore.errors import PluginIncompatibleError
        from rtpcore.plugins.seams import SEAMS, seam_class_problems, version_problem

        seam = SEAMS[seam_name]
        label = getattr(cls, "__qualname__", repr(cls))
        problems = seam_class_problems(seam, cls)
        if problems:
            raise self._invalid(f"{seam.what} {label}: " + "; ".join(problems))
        assert isinstance(cls, type)
        name = str(getattr(cls, "name", ""))  # checked by seam_class_problems
        problem = version_problem(seam_name, getattr(cls, "api_version", None))
        if problem is not None:
            raise PluginIncompatibleError(
                f"{self.provider}: {seam.what} {name!r} ({cls.__module__}.{cls.__qualname__}) cannot run here: "
                f"{problem}", state="incompatible", **self.provider.error_fields(),
            )
        recorded = self.seams.setdefault(seam_name, [])
        if any(getattr(other, "name", None) == name for other in recorded):
            raise self._invalid(f"{seam.what} {name!r} registered twice")
        recorded.append(cls)

    def add_layouts(self, policies: object) -> None:
        """Record what the plugin's ``rtpcore_kv_cache_layouts`` hook returned."""
        if policies is None:
            return
        if not isinstance(policies, list | tuple):
            raise self._invalid(
                f"rtpcore_kv_cache_layouts must return a list of layout policies, got {type(policies).__name__}"
            )
        for policy in policies:
            name = getattr(policy, "name", None)
            if not isinstance(name, str) or not _LAYOUT_RE.fullmatch(name):
                raise self._invalid(
                    f"KV layout {policy!r} needs a name of letters, digits, '_', '-' or '.'; got {name!r}"
                )
            if not callable(getattr(policy, "regions", None)):
                raise self._invalid(
                    f"KV layout {name!r} has no regions(kv_lora_rank, rope_head_dim) method"
                )
            if name in BUILTIN_LAYOUTS:
                from rtpcore.errors import PluginConflictError

                raise PluginConflictError(
                    f"KV layout name {name!r} is built into rtpcore (reserved: {', '.join(BUILTIN_LAYOUTS)}); "
                    f"{self.provider} must choose another name",
                    providers=("rtpcore built-in layouts", str(self.provider)),
                    state="conflict",
                    **self.provider.error_fields(),
                )
            if any(p.name == name for p in self.layouts):
                raise self._invalid(f"KV layout {name!r} returned twice")
            self.layouts.append(policy)


def builtin_version() -> str:
    """rtpcore's own version, the built-in plugin's (``unknown`` when running from a source
    tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rtpcore")
    except PackageNotFoundError:
        return "unknown"


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)``, at most 300 characters: errors stay one line."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= 300 else line[:297] + "..."


def _names(values: Iterable[str] | None) -> tuple[str, ...] | None:
    if values is None or isinstance(values, str):
        return None
    try:
        out = tuple(values)
    except TypeError:
        return None
    if not all(isinstance(v, str) and v and not any(c.isspace() for c in v) for v in out):
        return None
    if len(set(out)) != len(out):
        return None
    return out
