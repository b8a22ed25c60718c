"""The ModelRegistry: model types, architectures and KV layouts, each with its provenance.

Plugins register through a :class:`~rtpcore.plugins.registration.RecordingView` handed to their hooks;
:meth:`ModelRegistry.commit` then applies all of one plugin's registrations or none.
Rules: the identical class again is a no-op; built-ins only fill empty slots; an external
plugin takes a built-in architecture or model type only through ``replaces``; two external providers of
one ``model_type``, architecture or layout name is a :class:`PluginConflictError` naming both.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from rtpcore.errors import (
    PluginConflictError,
    PluginLoadError,
    UnknownArchitectureError,
    UnknownModelTypeError,
)
from rtpcore.plugins.model_plugin import ModelPlugin, model_plugin_problems
from rtpcore.plugins.registration import (
    BUILTIN_LAYOUTS,
    ModelRecord,
    Provider,
    RecordingView,
    first_line,
)

__all__ = ["BUILTIN_LAYOUTS", "ModelRecord", "ModelRegistry", "Provider", "import_model_class"]

log = logging.getLogger(__name__)


class ModelRegistry:
    """Registered models by ``model_type`` and architecture, and plugin KV layouts by name."""

    def __init__(self) -> None:
        self._models: dict[str, ModelRecord] = {}
        self._arch: dict[str, str] = {}
        self._classes: dict[str, type[ModelPlugin]] = {}
        self._layouts: dict[str, tuple[Any, Provider]] = {}
        self._tool_parsers: dict[str, tuple[type[Any], Provider]] = {}
        # seam name -> registered name -> (class, provider) (rtpcore.plugins.seams.SEAMS)
        self._seams: dict[str, dict[str, tuple[type[Any], Provider]]] = {}
        self._lock = threading.RLock()

    # -- registration -------------------------------------------------------------------

    def recording(self, provider: Provider) -> RecordingView:
        """A view that records ``provider``'s registrations until :meth:`commit`."""
        return RecordingView(provider)

    def register(self, target: type[ModelPlugin] | str, **kwargs: Any) -> None:
        """Register one model directly (outside any plugin), with the same rules."""
        view = self.recording(
            Provider(plugin="<direct>", module=getattr(target, "__module__", str(target)))
        )
        view.register(target, **kwargs)
        self.commit(view)

    def commit(self, view: RecordingView) -> None:
        """Apply every registration of ``view``, or raise and apply none."""
        with self._lock:
            models = dict(self._models)
            arch = dict(self._arch)
            for record in view.models:
                self._plan_model(record, models, arch)
            layouts = dict(self._layouts)
            for policy in view.layouts:
                name = policy.name
                if name in layouts:
                    other = layouts[name][1]
                    raise _conflict(f"KV layout {name!r}", name, other, view.provider)
                layouts[name] = (policy, view.provider)
            parsers = dict(self._tool_parsers)
            for cls in view.tool_parsers:
                if cls.name in parsers:
                    raise _conflict(
                        f"tool-call parser {cls.name!r}", cls.name, parsers[cls.name][1], view.provider
                    )
                parsers[cls.name] = (cls, view.provider)
            seams = {name: dict(found) for name, found in self._seams.items()}
            for seam_name, classes in view.seams.items():
                _plan_seam(seam_name, classes, seams.setdefault(seam_name, {}), view.provider)
            for model_type, record in models.items():
                previous = self._models.get(model_type)
                if previous is None or previous.target != record.target:
                    self._classes.pop(model_type, None)
                if record.cls is not None:
                    self._classes[model_type] = record.cls
            self._models, self._arch, self._layouts = models, arch, layouts
            self._tool_parsers = parsers
            self._seams = seams

    def _plan_model(
        self, record: ModelRecord, models: dict[str, ModelRecord], arch: dict[str, str]
    ) -> None:
        current = models.get(record.model_type)
        if current is not None:
            if current.target == record.target:
                log.debug("%s registered %s again: no-op", record.provider, record.target)
                return
            if record.provider.builtin:
                log.debug(
                    "built-in model_type %r already provided by %s",
                    record.model_type,
                    current.provider,
                )
                return
            takes_over = record.model_type in record.replaces or set(current.architectures) <= set(
                record.replaces
            )
            if not (current.provider.builtin and takes_over):
                raise _conflict(
                    f"model_type {record.model_type!r}",
                    record.model_type,
                    current.provider,
                    record.provider,
                    current,
                    record,
                )
        claimed: list[str] = []
        for name in record.architectures:
            owner_type = arch.get(name)
            owner = models.get(owner_type) if owner_type is not None else None
            if owner is None or owner.target == record.target or owner_type == record.model_type:
                claimed.append(name)
            elif record.provider.builtin:
                log.debug(
                    "built-in %s leaves architecture %r to %s", record.target, name, owner.provider
                )
            elif owner.provider.builtin and name in record.replaces:
                log.info(
                    "%s replaces the built-in model %r for architecture %r",
                    record.provider,
                    owner_type,
                    name,
                )
                claimed.append(name)
            else:
                hint = " without listing it in `replaces`" if owner.provider.builtin else ""
                raise _conflict(
                    f"architecture {name!r}", name, owner.provider, record.provider, owner, record, hint
                )
        if current is not None and current.target != record.target:
            dropped = [a for a in current.architectures if a not in record.architectures]
            log.info(
                "%s replaces the built-in model_type %r%s",
                record.provider,
                record.model_type,
                f"; no model serves {', '.join(dropped)} now" if dropped else "",
            )
            for name in current.architectures:
                arch.pop(name, None)
        for name in claimed:
            previous = arch.get(name)
            if previous is not None and previous != record.model_type:
                prev = models[previous]
                models[previous] = prev.without(name)
            arch[name] = record.model_type
        models[record.model_type] = record.with_architectures(tuple(claimed))

    # -- lookup -------------------------------------------------------------------------

    def get(self, model_type: str) -> type[ModelPlugin]:
        """The ModelPlugin subclass of ``model_type``, imported now if registered lazily."""
        with self._lock:
            cls = self._classes.get(model_type)
            if cls is not None:
                return cls
            record = self._models.get(model_type)
            if record is None:
                known = sorted(self._models)
                raise UnknownModelTypeError(
                    f"unknown model_type {model_type!r}; registered: {', '.join(map(repr, known)) or 'none'}",
                    known=known,
                )
            cls = import_model_class(record)
            self._classes[model_type] = cls
            return cls

    def unimported(self, plugin: str) -> list[str]:
        """The ``module:Class`` targets the plugin named ``plugin`` registered lazily whose
        class has not been imported (and validated) yet, sorted."""
        with self._lock:
            return sorted(
                r.target
                for t, r in self._models.items()
                if r.provider.plugin == plugin and t not in self._classes
            )

    def infer_model_type(self, hf_config: Mapping[str, Any]) -> str:
        """The model_type serving a parsed ``config.json``: the first of its "architectures"
        that is registered (or its "model_type" when it lists none)."""
        if not isinstance(hf_config, Mapping):
            raise TypeError(
                f"hf_config must be the parsed config.json dict, got {type(hf_config).__name__}"
            )
        archs = hf_config.get("architectures")
        with self._lock:
            if not archs:
                model_type = hf_config.get("model_type")
                if isinstance(model_type, str) and model_type in self._models:
                    return model_type
                archs = []
            if not isinstance(archs, list | tuple) or not all(isinstance(a, str) for a in archs):
                raise UnknownArchitectureError(
                    f'config.json "architectures" must be a list of strings, got {archs!r}'
                )
            for name in archs:
                if name in self._arch:
                    return self._arch[name]
            known = sorted(self._arch)
        from rtpcore.plugins.discovery import architecture_hints

        hints = architecture_hints(archs)
        message = (
            f"no registered model serves the architectures {list(archs)!r}; known: {', '.join(known) or 'none'}"
            if archs
            else 'config.json lists no "architectures"; pass model_type explicitly'
        )
        for name, lines in hints.items():
            message += f"; {name} is served by the installed {' or '.join(lines)}"
        raise UnknownArchitectureError(message, architectures=archs, known=known, hints=hints)

    def gguf_model_type(self, architecture: str, *, path: object = None) -> str:
        """The model_type serving GGUF files whose ``general.architecture`` is ``architecture``:
        the registered plugin whose ``gguf_architectures`` lists it, an external plugin's before
        a built-in's (lazily registered classes are imported to read it). None serving it is an
        :class:`UnknownArchitectureError` naming the GGUF file (``path``), the key and the GGUF
        architectures served; two external plugins, a :class:`PluginConflictError`."""
        found: list[tuple[str, ModelRecord]] = []
        served: set[str] = set()
        for record in self.records():
            cls = self.get(record.model_type)
            declared = tuple(getattr(cls, "gguf_architectures", ()) or ())
            served.update(declared)
            if architecture in declared:
                found.append((record.model_type, record))
        external = [f for f in found if not f[1].provider.builtin]
        if len(external) > 1:
            (_, ra), (_, rb) = external[:2]
            raise _conflict(f"GGUF architecture {architecture!r}", architecture, ra.provider, rb.provider, ra, rb)
        if external or found:
            return (external or found)[0][0]
        where = f"GGUF file {str(path)!r}: " if path is not None else ""
        raise UnknownArchitectureError(
            f"{where}no registered model serves general.architecture {architecture!r}; GGUF architectures served: "
            f"{', '.join(sorted(served)) or 'none'} (a plugin declares more with ModelPlugin.gguf_architectures)",
            architectures=[architecture], known=sorted(served),
        )

    def record(self, model_type: str) -> ModelRecord:
        """The registration of ``model_type``, with its provenance (``.provider``)."""
        with self._lock:
            if model_type not in self._models:
                raise UnknownModelTypeError(
                    f"unknown model_type {model_type!r}", known=sorted(self._models)
                )
            return self._models[model_type]

    def records(self) -> tuple[ModelRecord, ...]:
        """Every registration, sorted by model_type."""
        with self._lock:
            return tuple(self._models[k] for k in sorted(self._models))

    def model_types(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def architectures(self) -> dict[str, str]:
        """Architecture -> model_type, sorted by architecture."""
        with self._lock:
            return dict(sorted(self._arch.items()))

    def get_layout(self, name: str) -> Any | None:
        """The plugin layout policy named ``name``; None for a built-in layout
        (:data:`BUILTIN_LAYOUTS`, served by ``rtpcore_native``) or an unknown name."""
        with self._lock:
            found = self._layouts.get(name)
            return None if found is None else found[0]

    def layout_provider(self, name: str) -> Provider | None:
        with self._lock:
            found = self._layouts.get(name)
            return None if found is None else found[1]

    def layout_names(self) -> list[str]:
        """Every selectable layout name, sorted: the built-in ones and those plugins registered."""
        with self._lock:
            return sorted(set(BUILTIN_LAYOUTS) | set(self._layouts))

    def get_tool_parser(self, name: str) -> type[Any] | None:
        """The tool-call parser class a plugin registered as ``name`` (None: unknown here; the
        built-in ones live in ``rtpcore.serving.tool_parsers``)."""
        with self._lock:
            found = self._tool_parsers.get(name)
            return None if found is None else found[0]

    def tool_parser_names(self) -> list[str]:
        """The names of the tool-call parsers plugins registered, sorted."""
        with self._lock:
            return sorted(self._tool_parsers)

    def tool_parsers_of(self, plugin: str) -> list[str]:
        """The names of the tool-call parsers the plugin named ``plugin`` registered, sorted."""
        with self._lock:
            return sorted(n for n, (_, p) in self._tool_parsers.items() if p.plugin == plugin)

    # -- seams (docs/design.md §18) ---------------------------------------------------------

    def seam_class(self, seam: str, name: str) -> type[Any] | None:
        """The class registered as ``name`` on ``seam`` (``"reasoning_parsers"``, ...); None:
        no such registration."""
        with self._lock:
            found = self._seams.get(seam, {}).get(name)
            return None if found is None else found[0]

    def seam_provider(self, seam: str, name: str) -> Provider | None:
        """Who registered ``name`` on ``seam``."""
        with self._lock:
            found = self._seams.get(seam, {}).get(name)
            return None if found is None else found[1]

    def seam_classes(self, seam: str) -> dict[str, type[Any]]:
        """Every registration on ``seam``: name -> class, sorted by name (rtpcore's own included)."""
        with self._lock:
            return {n: found[0] for n, found in sorted(self._seams.get(seam, {}).items())}

    def seam_names(self, seam: str) -> list[str]:
        """The names registered on ``seam``, sorted (rtpcore's own included)."""
        with self._lock:
            return sorted(self._seams.get(seam, {}))

    def seams_of(self, plugin: str) -> dict[str, list[str]]:
        """What the plugin named ``plugin`` registered, per seam: ``models``, ``kv_layouts``,
        ``tool_parsers`` and every seam of ``rtpcore.plugins.seams.SEAMS`` (each sorted; empty
        when none)."""
        from rtpcore.plugins.seams import SEAMS

        models, _, layouts = self.by_provider(plugin)
        out = {"models": models, "kv_layouts": layouts, "tool_parsers": self.tool_parsers_of(plugin)}
        with self._lock:
            for name in SEAMS:
                out[name] = sorted(n for n, (_, p) in self._seams.get(name, {}).items() if p.plugin == plugin)
        return out

    def by_provider(self, plugin: str) -> tuple[list[str], list[str], list[str]]:
        """(model types, architectures, layout names) registered by the plugin named ``plugin``."""
        with self._lock:
            records = [r for r in self._models.values() if r.provider.plugin == plugin]
            layouts = sorted(n for n, (_, p) in self._layouts.items() if p.plugin == plugin)
        return (
            sorted(r.model_type for r in records),
            sorted(a for r in records for a in r.architectures),
            layouts,
        )


def _plan_seam(seam_name: str, classes: list[type[Any]], taken: dict[str, tuple[type[Any], Provider]],
               provider: Provider) -> None:
    """Add ``provider``'s ``classes`` to ``taken`` (the seam's registrations so far), or raise:
    a name another plugin registered, or a built-in's not listed in the class's ``replaces``, is
    a conflict; ``replaces`` naming what is not a built-in registration is invalid. A class
    that replaces a built-in answers to the built-in's name too."""
    from rtpcore.plugins.seams import SEAMS

    what = SEAMS[seam_name].what
    for cls in classes:
        for name in cls.replaces:
            other = taken.get(name)
            if other is None or not other[1].builtin:
                raise PluginLoadError(
                    f"{provider}: {what} {cls.name!r} replaces {name!r}, which is not one of rtpcore's built-in "
                    f"{what}s ({', '.join(sorted(n for n, (_, p) in taken.items() if p.builtin)) or 'none'})",
                    state="invalid", **provider.error_fields(),
                )
        other = taken.get(cls.name)
        if other is not None and not (other[1].builtin and cls.name in cls.replaces):
            hint = (f"; to take over the built-in one, set replaces = ({cls.name!r},) on "
                    f"{cls.__module__}.{cls.__qualname__}" if other[1].builtin else "; allow only one of them")
            raise PluginConflictError(
                f"{what} {cls.name!r} is registered by both {other[1]} and {provider}{hint}",
                providers=(str(other[1]), str(provider)), state="conflict", **provider.error_fields(),
            )
        for name in (*cls.replaces, cls.name):  # a replaced built-in's name now selects the plugin's class
            taken[name] = (cls, provider)


def _conflict(
    what: str,
    name: str,
    first: Provider,
    second: Provider,
    first_record: ModelRecord | None = None,
    second_record: ModelRecord | None = None,
    hint: str = "",
) -> PluginConflictError:
    a = f"{first} as {first_record.target}" if first_record else str(first)
    b = f"{second} as {second_record.target}" if second_record else str(second)
    if first.builtin:
        fix = (
            f"list {name!r} in the plugin's `replaces` (the ModelPlugin class attribute, or "
            f"register(..., replaces=...) for a lazy registration) to take it over"
        )
    else:
        fix = "allow only one of them"
    return PluginConflictError(
        f"{what} is claimed by both {a} and {b}{hint}: {fix}",
        providers=(str(first), str(second)),
        state="conflict",
        **second.error_fields(),
    )


def import_model_class(record: ModelRecord) -> type[ModelPlugin]:
    """Import a lazy registration's class and run every registration rule on it (those of
    :func:`~rtpcore.plugins.model_plugin.model_plugin_problems`, and agreement with what was
    registered): ``PluginLoadError`` (``import-failed`` or ``invalid``) naming the plugin,
    its distribution and the ``module:Class``."""
    module_name, _, qualname = record.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise PluginLoadError(
            f"model {record.model_type!r} of {record.provider} could not import {record.target!r}: {type(exc).__name__}: {first_line(exc)}",
            state="import-failed",
            **record.provider.error_fields(),
        ) from exc
    problems = model_plugin_problems(obj)
    if not problems and obj.model_type != record.model_type:
        problems.append(
            f"its model_type is {obj.model_type!r}, registered as {record.model_type!r}"
        )
    if not problems:
        missing = [a for a in record.architectures if a not in obj.architectures]
        if missing:
            problems.append(f"its architectures lack {missing[0]!r}, registered for it")
    if problems:
        raise PluginLoadError(
            f"model {record.model_type!r} of {record.provider}: {record.target} is invalid: "
            f"{'; '.join(problems)}",
            state="invalid",
            **record.provider.error_fields(),
        )
    cls: type[ModelPlugin] = obj
    return cls
