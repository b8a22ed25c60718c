"""Loading: import exactly the entries of a :class:`~rtpcore.plugins.resolution.Plan` and run their hooks.

One pluggy ``PluginManager("rtpcore")`` per plan; the built-in models are registered first,
as the plugin ``rtpcore.models``, through the same path as every external plugin. Each
plugin is registered under its entry-point name, checked with ``check_pending()`` and its
hooks run against a recording view, so it lands in the registry completely or not at all.

:func:`load_plugins` runs once per process and plan (thread-safe) and raises the first
failure; :func:`load_report` loads as much as it can and reports every outcome.
No discovery scan happens here: a worker process given a parent's plan reads one metadata
folder per entry to check that the version is still the one resolved. Before an entry is
imported, the file its module would come from must be its distribution's
(:mod:`rtpcore.plugins.provenance`); a same-named module elsewhere on the path makes it
``shadowed``, and that file is never executed.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import threading
from typing import Any

import pluggy
from attrs import evolve, field, frozen

from rtpcore.errors import (
    PluginConflictError,
    PluginError,
    PluginIncompatibleError,
    PluginLoadError,
    PluginNotFoundError,
    PluginPatchError,
    PluginVersionError,
)
from rtpcore.plugins import hooks, patches, provenance
from rtpcore.plugins import metadata as lookup
from rtpcore.plugins.registration import Provider, builtin_version, first_line
from rtpcore.plugins.registry import ModelRegistry, import_model_class
from rtpcore.plugins.resolution import Plan, PlanEntry
from rtpcore.plugins.seams import SEAMS

__all__ = [
    "BUILTIN_PLUGIN",
    "OK_STATES",
    "LoadOutcome",
    "LoadReport",
    "builtin_version",
    "load_plugins",
    "load_report",
]

log = logging.getLogger(__name__)

#: The plugin name (and module) of rtpcore's built-in models.
BUILTIN_PLUGIN = "rtpcore.models"

#: The outcomes that are not failures: ``loaded`` (every class it registered is imported and
#: validated) and ``registered`` (its hooks ran and their registrations were accepted, but
#: some classes were registered lazily and are imported, and validated, only when first used;
#: ``load_report(plan, import_models=True)`` -- ``rtpcore plugins check`` -- imports them all).
OK_STATES = ("loaded", "registered")

_lock = threading.Lock()
_loaded: dict[Plan, ModelRegistry | PluginError] = {}


@frozen
class LoadOutcome:
    """The outcome of one requested item: ``state`` is one of :data:`OK_STATES` or a failure
    state of docs/design.md §3; ``models``, ``architectures``, ``layouts`` and ``tool_parsers``
    are what it registered, ``unimported`` the ``module:Class`` targets of its lazy registrations not
    imported yet (state ``registered``)."""

    request: str
    state: str
    entry: PlanEntry | None = None
    error: PluginError | None = field(default=None, eq=False)
    models: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()
    tool_parsers: tuple[str, ...] = ()
    unimported: tuple[str, ...] = ()
    #: What it registered on each seam, ``(seam, names)`` pairs in ``registry.seams_of`` order
    #: (``models``, ``kv_layouts``, ``tool_parsers``, then docs/design.md §18's).
    seams: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: The changes to rtpcore ``--allow-plugin-patches`` accepted: (module or class, attribute, what).
    patches: tuple[tuple[str, str, str], ...] = ()


@frozen
class LoadReport:
    """A registry built from a plan, with the outcome of the built-in plugin first and then
    every request in order."""

    registry: ModelRegistry = field(eq=False)
    builtin: LoadOutcome
    outcomes: tuple[LoadOutcome, ...]

    @property
    def ok(self) -> bool:
        return all(o.state in OK_STATES for o in self.outcomes)


def load_plugins(plan: Plan | None = None) -> ModelRegistry:
    """Import the plan's plugins, run their hooks and return the ModelRegistry.

    Once per process and plan: later calls (from any thread) return the same registry,
    or raise the same error. The first failure raises its error (PluginNotFoundError,
    PluginVersionError, PluginConflictError, PluginLoadError); nothing after it is imported.
    """
    plan = Plan() if plan is None else plan
    if not isinstance(plan, Plan):
        raise TypeError(
            f"load_plugins takes a Plan (Allowlist.resolve()), got {type(plan).__name__}"
        )
    with _lock:
        done = _loaded.get(plan)
        if done is None:
            try:
                done = _load(plan, fail_fast=True).registry
            except PluginError as exc:
                done = exc
            _loaded[plan] = done
    if isinstance(done, PluginError):
        raise done
    return done


def load_report(plan: Plan, *, import_models: bool = False) -> LoadReport:
    """Load every entry of ``plan`` that can be loaded and report each request's outcome;
    raises nothing for plugin failures (the ``rtpcore plugins`` commands use this).

    With ``import_models`` every class a plugin of the plan registers lazily is imported and
    validated before its registrations are applied, so that an import error, a wrong
    ``module:Class`` or a class the engine would refuse makes the plugin ``import-failed`` or
    ``invalid`` (what ``rtpcore plugins check`` runs); without it such a plugin is
    ``registered``, and the engine imports each class only when a checkpoint needs it.
    """
    with _lock:
        return _load(plan, fail_fast=False, import_models=import_models)


def _load(plan: Plan, *, fail_fast: bool, import_models: bool = False) -> LoadReport:
    if fail_fast:
        plan.raise_for_failures()  # resolution failures come before any import
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    registry = ModelRegistry()
    builtin = Provider(
        plugin=BUILTIN_PLUGIN,
        module=BUILTIN_PLUGIN,
        distribution="rtpcore",
        builtin=True,  # its version, rtpcore's, is read only when a message shows it
    )
    _install(pm, registry, importlib.import_module(BUILTIN_PLUGIN), BUILTIN_PLUGIN, builtin)
    outcomes = [
        LoadOutcome(request=f.request, state=f.state, error=f.error()) for f in plan.failures
    ]
    for entry in plan.entries:
        provider = Provider(
            plugin=entry.name,
            module=entry.value,
            distribution=entry.distribution,
            version=entry.version,
        )
        try:
            with patches.watch() as watch:
                try:
                    _verify_version(entry)
                    _check_requires_rtpcore(entry)
                    provenance.check_origin(entry)
                    allowed = _patches_allowed(plan, entry)
                    _install(
                        pm, registry, _import_entry(entry), entry.name, provider,
                        import_models=import_models, watch=None if allowed else watch,
                    )
                except BaseException:
                    watch.undo(watch.changes())  # a failed plugin leaves rtpcore as it found it
                    raise
        except PluginError as exc:
            if fail_fast:
                raise
            log.debug("%s: %s", entry.describe(), exc)
            outcomes.append(
                LoadOutcome(request=entry.request, state=exc.state, entry=entry, error=exc)
            )
            continue
        outcome = _loaded_outcome(registry, entry.request, entry.name, entry)
        if allowed and (changes := tuple(watch.changes())):
            log.warning("%s changed rtpcore, accepted by --allow-plugin-patches: %s", provider,
                        "; ".join(f"{owner}.{attr} {kind}" for owner, attr, kind in changes))
            outcome = evolve(outcome, patches=changes)
        outcomes.append(outcome)
    by_request = {o.request: o for o in outcomes}
    for request, earlier in plan.duplicates:
        if earlier in by_request:
            outcomes.append(evolve(by_request[earlier], request=request))
    order = {request: i for i, request in enumerate(plan.requests)}
    outcomes.sort(key=lambda o: order.get(o.request, len(order)))
    log.debug("loaded %d plugin(s); model types %s", len(plan.entries), registry.model_types())
    return LoadReport(
        registry=registry,
        builtin=_loaded_outcome(registry, BUILTIN_PLUGIN, BUILTIN_PLUGIN, None),
        outcomes=tuple(outcomes),
    )


def _loaded_outcome(
    registry: ModelRegistry, request: str, plugin: str, entry: PlanEntry | None
) -> LoadOutcome:
    models, archs, layouts = registry.by_provider(plugin)
    unimported = tuple(registry.unimported(plugin))
    return LoadOutcome(
        request=request,
        state="registered" if unimported else "loaded",
        entry=entry,
        models=tuple(models),
        architectures=tuple(archs),
        layouts=tuple(layouts),
        tool_parsers=tuple(registry.tool_parsers_of(plugin)),
        unimported=unimported,
        seams=tuple((seam, tuple(names)) for seam, names in registry.seams_of(plugin).items()),
    )


def _verify_version(entry: PlanEntry) -> None:
    """Check the installed version is still the resolved one, reading one metadata folder."""
    if entry.distribution is None:
        return
    key = lookup.canonical_name(entry.distribution)
    dist = lookup.at(entry.metadata_path) if entry.metadata_path else None
    if dist is None or lookup.canonical_name(dist.name) != key:
        found = lookup.find(entry.distribution)  # moved: the same direct lookup, never a scan
        if not found:
            raise PluginNotFoundError(
                f"{entry.describe()} was resolved, but this process finds no distribution "
                f"{entry.distribution!r} on its path",
                state="not-installed",
                **entry.error_fields(),
            )
        dist = found[0]
    if dist.version != entry.version:
        raise PluginVersionError(
            f"{entry.describe()} was resolved, but this process finds version {dist.version} "
            f"(at {dist.path}); every process must load the same version",
            state="version-mismatch",
            **entry.error_fields(),
        )


def _check_requires_rtpcore(entry: PlanEntry) -> None:
    """The distribution's ``Requires-Dist: rtpcore ...`` must admit the running rtpcore,
    checked from its METADATA before any of its code runs (docs/design.md §18)."""
    if entry.metadata_path is None:
        return
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    running = _running_version()
    for line in lookup.requires_dist(entry.metadata_path):
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # not ours to judge: pip installed it
        if lookup.canonical_name(req.name) not in ("rtpcore",) or (
            req.marker is not None and not req.marker.evaluate({"extra": ""})
        ):
            continue
        try:
            ok = req.specifier.contains(Version(running), prereleases=True)
        except InvalidVersion:  # a source tree that is not installed: nothing to compare
            ok = True
        if not ok:
            raise PluginIncompatibleError(
                f"{entry.describe()} requires {line!r}, and this is rtpcore {running}: install a "
                f"release of {entry.distribution} written for rtpcore {running}, or an rtpcore that "
                "it admits; none of its code was run",
                state="incompatible",
                **entry.error_fields(),
            )


def _running_version() -> str:
    """rtpcore's version without a metadata search (a worker loading a plan reads one metadata
    folder per entry and nothing else): the native extension is built with it (.ci/run checks
    that the two agree)."""
    import rtpcore_native

    return str(rtpcore_native.__version__)


def _import_entry(entry: PlanEntry) -> Any:
    target = entry.value.split("[", 1)[0]  # "module:object [extra]": extras select nothing here
    module_name, _, attr = (part.strip() for part in target.partition(":"))
    try:
        obj: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
    except Exception as exc:
        detail = f"{type(exc).__name__}: {first_line(exc)}"
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and not module_name.startswith(missing) and missing != module_name:
            detail += f" (the plugin needs {missing!r}, which is not installed)"
        raise PluginLoadError(
            f"{entry.describe()} failed to import: {detail}",
            state="import-failed",
            **entry.error_fields(),
        ) from exc
    return obj


def _install(
    pm: pluggy.PluginManager,
    registry: ModelRegistry,
    obj: Any,
    name: str,
    provider: Provider,
    *,
    import_models: bool = False,
    watch: patches.Watch | None = None,
) -> None:
    """Register ``obj`` under ``name``, validate its hooks, run them, commit atomically
    (with ``import_models``, after importing and validating every lazily registered class;
    with ``watch``, after checking that nothing the plugin ran changed rtpcore)."""
    if pm.is_registered(obj):
        log.debug("%s is the same module as plugin %r: already loaded", provider, pm.get_name(obj))
        return
    if pm.get_plugin(name) is not None:
        raise PluginConflictError(
            f"two plugins are named {name!r}: {provider} and another already loaded; allow only one",
            providers=(name, str(provider)),
            state="conflict",
            **provider.error_fields(),
        )
    try:
        pm.register(obj, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginLoadError(
            f"{provider}: invalid hook implementation: {exc}", state="invalid", **provider.error_fields()
        ) from exc
    try:
        _check_hooks(pm, obj, provider)
        view = registry.recording(provider)
        others = [p for p in pm.get_plugins() if p is not obj]
        _call(pm, "rtpcore_register_models", others, provider, registry=view)
        for result in _call(pm, "rtpcore_kv_cache_layouts", others, provider):
            view.add_layouts(result)
        _call(pm, "rtpcore_register_tool_parsers", others, provider, registry=view)
        for seam in SEAMS.values():
            _call(pm, seam.hook, others, provider, registry=view)
        if import_models:
            view.models[:] = [
                r if r.cls is not None else evolve(r, cls=import_model_class(r)) for r in view.models
            ]
        if watch is not None:
            _refuse_patches(watch, provider)
        registry.commit(view)
    except BaseException:
        pm.unregister(obj)
        raise


def _patches_allowed(plan: Plan, entry: PlanEntry) -> bool:
    """Whether ``--allow-plugin-patches`` names the entry's plugin or distribution."""
    names = {lookup.canonical_name(n) for n in plan.allow_patches}
    return lookup.canonical_name(entry.name) in names or (
        entry.distribution is not None and lookup.canonical_name(entry.distribution) in names
    )


def _refuse_patches(watch: patches.Watch, provider: Provider) -> None:
    """A PluginPatchError naming every attribute of rtpcore the plugin changed (undone by the caller)."""
    changes = watch.changes()
    if changes:
        listed = "; ".join(f"{owner}.{attr} {kind}" for owner, attr, kind in changes[:8])
        more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
        raise PluginPatchError(
            f"{provider} changed rtpcore while it loaded: {listed}{more}. Plugins plug in through "
            "hooks and seams, never by patching (docs/design.md §18); the change was undone and "
            f"none of its registrations applied (an operator may accept it: --allow-plugin-patches {provider.plugin})",
            patches=changes,
            state="patches",
            **provider.error_fields(),
        )


def _check_hooks(pm: pluggy.PluginManager, obj: Any, provider: Provider) -> None:
    if (problem := _hook_name_problem(pm, obj)) is not None:
        raise PluginLoadError(f"{provider}: {problem}", state="invalid", **provider.error_fields())
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(f"{provider}: {exc}", state="invalid", **provider.error_fields()) from exc
    if not pm.get_hookcallers(obj):
        undecorated = sorted(
            n for n in dir(obj) if n.startswith("rtpcore_") and callable(getattr(obj, n, None))
        )
        hint = (
            f"; {', '.join(undecorated)} must be decorated with @rtpcore.hookimpl"
            if undecorated
            else " (does the entry point name the module holding the hooks?)"
        )
        raise PluginLoadError(
            f"{provider} defines no rtpcore hook implementations{hint}", state="invalid", **provider.error_fields()
        )


def _call(
    pm: pluggy.PluginManager, hook: str, others: list[Any], provider: Provider, **kwargs: Any
) -> list[Any]:
    try:
        result: list[Any] = pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)
    except PluginError:
        raise
    except ImportError as exc:
        raise PluginLoadError(
            f"{provider}: hook {hook} failed to import: {type(exc).__name__}: {first_line(exc)}",
            state="import-failed",
            **provider.error_fields(),
        ) from exc
    except Exception as exc:
        raise PluginLoadError(
            f"{provider}: hook {hook} raised {type(exc).__name__}: {first_line(exc)}",
            state="invalid",
            **provider.error_fields(),
        ) from exc
    return result


def _hook_name_problem(pm: pluggy.PluginManager, obj: Any) -> str | None:
    """A hook implementation of ``obj`` whose name is no rtpcore hook (with the closest hook's
    name), or a function named like a hook that is not marked as one; None when neither."""
    hooks_list = ", ".join(hooks.HOOK_NAMES)
    for caller in pm.get_hookcallers(obj) or ():
        if caller.has_spec():
            continue
        impls = [i for i in caller.get_hookimpls() if i.plugin is obj]
        if impls and all(i.optionalhook for i in impls):
            continue
        return f"unknown hook {caller.name!r}{_did_you_mean(caller.name)} (rtpcore's hooks: {hooks_list})"
    marked = {caller.name for caller in pm.get_hookcallers(obj) or ()}
    for attr in sorted(dir(obj)):
        if not attr.startswith("rtpcore_") or attr in marked or not callable(getattr(obj, attr, None)):
            continue
        if attr in hooks.HOOK_NAMES:
            if marked:  # with none marked at all, _check_hooks says so, listing every such name
                return f"{attr} must be decorated with @rtpcore.hookimpl to be called"
        elif suggestion := _did_you_mean(attr):
            return (
                f"{attr!r} is not an rtpcore hook{suggestion} (and decorate it with "
                f"@rtpcore.hookimpl; rtpcore's hooks: {hooks_list})"
            )
    return None


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, hooks.HOOK_NAMES, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
