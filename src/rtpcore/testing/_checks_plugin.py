"""The kit's checks on the plugin as a whole: ``registration``, ``import_cost``, ``no_patches``.

``import_cost`` and ``no_patches`` run in a fresh interpreter each (``python -P -m
rtpcore.testing._checks_plugin PROBE ARGS``), so what the kit's own process has imported
already cannot hide a plugin's import of torch, its import time or its patches.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import subprocess
import sys
import time
from typing import Any

from rtpcore.testing.kit import KitContext, fail

__all__: list[str] = []


def registration(ctx: KitContext, subject: None) -> str | None:
    outcome = ctx.outcome
    if outcome.state not in ("loaded", "registered"):
        raise fail("registration", f"{ctx.item}: state {outcome.state}: {outcome.error}")
    for model_type in ctx.subjects("models"):  # what the built-in plugin registers lazily, imported
        try:
            ctx.model_class(model_type)
        except Exception as exc:
            raise fail("registration", f"model type {model_type!r} of {ctx.item}: {exc}") from None
    registered = {seam: names for seam, names in outcome.seams if names}
    if not registered:
        raise fail("registration", f"{ctx.item} ({ctx.name}) registered nothing on any seam")
    if ctx.version is not None:
        from packaging.version import InvalidVersion, Version

        try:
            Version(ctx.version)
        except InvalidVersion:
            raise fail("registration", f"distribution {ctx.distribution!r} has version {ctx.version!r}, "
                                       "which is not a PEP 440 version") from None
    return "; ".join(f"{seam}: {', '.join(names)}" for seam, names in registered.items())


def import_cost(ctx: KitContext, subject: None) -> str | None:
    probe = _run_probe("import", {"plugins": list(ctx.plugins), "allow": list(ctx.allow_patches)})
    if probe.get("error"):
        raise fail("import_cost", f"loading {ctx.item} in a fresh process failed: {probe['error']}")
    if probe["torch"]:
        where = probe.get("torch_importer") or "an unknown module"
        raise fail("import_cost", f"importing {ctx.item} and running its hooks imported torch (from {where}); "
                                  "import torch inside the functions the engine calls (build_model, apply, ...)")
    seconds = probe["seconds"]
    if seconds > ctx.import_budget:
        raise fail("import_cost", f"importing {ctx.item} and running its hooks took {seconds:.2f} s, over the "
                                  f"budget of {ctx.import_budget:.2f} s (slowest module: {probe.get('slowest')})")
    return f"{seconds * 1000:.0f} ms, torch not imported"


def no_patches(ctx: KitContext, subject: None) -> str | None:
    probe = _run_probe("patches", {"plugins": list(ctx.plugins), "allow": list(ctx.allow_patches),
                                   "models": ctx.subjects("models"), "device": ctx.device,
                                   "cache_dir": None if ctx.cache_dir is None else str(ctx.cache_dir)})
    if probe.get("error"):
        raise fail("no_patches", f"loading {ctx.item} in a fresh process failed: {probe['error']}")
    found = [f"{where}: {owner}.{attr} {kind}" for where, owner, attr, kind in probe["changes"]]
    if found:
        raise fail("no_patches", f"{ctx.item} changed rtpcore:\n" + "\n".join(f"  {line}" for line in found)
                   + "\nuse a seam (docs/plugins.md) instead of replacing rtpcore's attributes")
    if probe.get("skipped"):
        return f"import and hooks checked; models not built: {'; '.join(probe['skipped'])}"
    return None


def _run_probe(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a probe in a fresh interpreter; one that dies (a crash in the plugin's import) fails its check."""
    command = [sys.executable, "-P", "-m", "rtpcore.testing._checks_plugin", kind, json.dumps(args)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        check = {"import": "import_cost", "patches": "no_patches"}[kind]
        raise fail(check, f"the process that loads the plugin exited with status {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- the probes, run as ``python -P -m rtpcore.testing._checks_plugin KIND ARGS`` --------------


class _TorchWatch:
    """A meta-path finder that records which module first imports torch (never finds anything)."""

    def __init__(self) -> None:
        self.importer: str | None = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torch" and self.importer is None:
            frame = sys._getframe(1)
            while frame is not None:
                name = frame.f_globals.get("__name__", "")
                if not name.startswith(("importlib", "rtpcore.testing", "_frozen_importlib")) and name != __name__:
                    self.importer = f"{name} ({frame.f_code.co_filename}:{frame.f_lineno})"
                    break
                frame = frame.f_back  # type: ignore[assignment]
        return None


class _ImportTimer(importlib.abc.MetaPathFinder):
    """Times each module imported while it is on ``sys.meta_path``: ``own[name]`` is the seconds
    its code ran, less the modules it imported meanwhile (so a slow import is named where it is)."""

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self._stack: list[float] = []  # seconds of nested imports, per module executing
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in self._finding:  # another finder asking the path again (rtpcore's patch watch)
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _TimedLoader(spec.loader, self)
                    return spec
            return None
        finally:
            self._finding.discard(fullname)


class _TimedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, timer: _ImportTimer) -> None:
        self.loader = loader
        self.timer = timer

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        stack = self.timer._stack
        stack.append(0.0)
        start = time.perf_counter()
        try:
            self.loader.exec_module(module)
        finally:
            total = time.perf_counter() - start
            nested = stack.pop()
            self.timer.own[module.__name__] = total - nested
            if stack:
                stack[-1] += total

    def __getattr__(self, name: str) -> Any:  # is_package, get_resource_reader, ...
        return getattr(self.loader, name)


def _probe_import(args: dict[str, Any]) -> dict[str, Any]:
    """Load the plugin as ``plugins list`` does (hooks run, lazy classes not imported), timed."""
    from rtpcore.plugins.allowlist import Allowlist
    from rtpcore.plugins.loading import load_report

    builtin = not args["plugins"]
    plan = Allowlist.from_cli(plugins=args["plugins"], allow_plugin_patches=args["allow"]).resolve(strict=False)
    if not builtin:  # rtpcore and its built-in plugin first, not timed
        load_report(Allowlist.from_cli().resolve(strict=False))
    if "torch" in sys.modules:
        return {"error": "torch was imported before the plugin was (an rtpcore bug)"}
    watch = _TorchWatch()
    timer = _ImportTimer()
    sys.meta_path.insert(0, timer)
    sys.meta_path.insert(0, watch)
    start = time.perf_counter()
    try:
        report = load_report(plan)  # for the built-in plugin: its own import, in a fresh process
    finally:
        seconds = time.perf_counter() - start
        sys.meta_path.remove(watch)
        sys.meta_path.remove(timer)
    if report.outcomes and report.outcomes[0].error is not None:
        return {"error": str(report.outcomes[0].error)}
    own, name = max(((t, n) for n, t in timer.own.items()), default=(0.0, "-"))
    return {"seconds": seconds, "torch": "torch" in sys.modules, "torch_importer": watch.importer,
            "slowest": f"{name}, {own:.2f} s in its own code"}


def _probe_patches(args: dict[str, Any]) -> dict[str, Any]:
    """Load the plugin (its patches accepted and listed), then build and run each demo model
    under a watch: every attribute of rtpcore replaced, added or deleted, and where."""
    from pathlib import Path

    from rtpcore.plugins import patches
    from rtpcore.plugins.allowlist import Allowlist
    from rtpcore.plugins.loading import load_report
    from rtpcore.plugins.model_plugin import call_optional
    from rtpcore.testing.demo import ensure_demo_checkpoint

    plan = Allowlist.from_cli(plugins=args["plugins"], allow_plugin_patches=args["allow"]).resolve(strict=False)
    report = load_report(plan, import_models=True)
    outcome = report.outcomes[0] if report.outcomes else report.builtin
    if outcome.error is not None:
        return {"error": str(outcome.error)}
    changes = [["import and hooks", *change] for change in outcome.patches]
    skipped = []
    cache_dir = None if args["cache_dir"] is None else Path(args["cache_dir"])
    from rtpcore.engine import Engine

    # rtpcore's own first-use work (caches filled on first build) is done before the watch starts.
    warm = ensure_demo_checkpoint(report.registry.get("llama"), cache_dir=cache_dir)
    Engine.from_pretrained(warm, device=args["device"]).close()
    for model_type in args["models"]:
        plugin = report.registry.get(model_type)
        if call_optional(plugin, "demo_config") is None:
            skipped.append(f"{model_type} has no demo_config()")
            continue
        path = ensure_demo_checkpoint(plugin, cache_dir=cache_dir)
        with patches.watch() as watch:
            try:
                engine = Engine.from_pretrained(path, plugins=args["plugins"], allow_plugin_patches=args["allow"],
                                                device=args["device"])
                try:
                    engine.generate([[1, 2, 3, 4]], max_new_tokens=2)
                finally:
                    engine.close()
            finally:
                found = watch.changes()
                watch.undo(found)
        changes += [[f"building and running {model_type}", *change] for change in found]
    return {"changes": changes, "skipped": skipped}


def _main(argv: list[str]) -> int:
    kind, raw = argv
    args = json.loads(raw)
    probe = {"import": _probe_import, "patches": _probe_patches}[kind]
    try:
        result = probe(args)
    except Exception as exc:  # reported by the check, with the plugin's frames
        from rtpcore.testing.kit import describe_exception

        result = {"error": describe_exception(exc)}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
