"""``rtpcore plugins list``, ``rtpcore plugins check``, ``rtpcore plugins test`` (``_plugins_test``) and
``rtpcore plugins init`` (``_scaffold``).

``list`` shows every installed ``rtpcore.plugins`` entry point (read from metadata, never
imported unless requested), the built-in models, and each requested item with its outcome:
a plugin whose hooks registered classes lazily (``"module:Class"``) is ``registered``, not
``loaded``, until those classes are imported. ``check`` loads the given items in a fresh
interpreter, so a plugin that crashes or mutates global state cannot affect the caller,
imports every class they register lazily and runs every registration rule on it (what the
engine would run when a checkpoint needs it), and reports the outcomes: ``ok`` only for
``loaded``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from rtpcore.cli._args import add_log_level_argument
from rtpcore.cli._plugins_test import add_test_parser
from rtpcore.cli._scaffold import add_init_parser
from rtpcore.plugins.allowlist import (
    IGNORED_ENV_VARS,
    Allowlist,
    add_allow_patches_argument,
    add_allowlist_arguments,
    external_model_packages_arg,
    plugins_arg,
)
from rtpcore.plugins.seams import SEAMS

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list, check, test and write rtpcore plugins",
        description="List installed rtpcore plugins without importing them, load some in a fresh "
        "process and report how that went, run the conformance kit on one, or write a new plugin package.",
    )
    actions = parser.add_subparsers(dest="plugins_command", metavar="ACTION", required=True)

    lister = actions.add_parser(
        "list",
        help="list installed plugins and the outcome of requested ones",
        description="List every installed rtpcore plugin without importing it, the built-in "
        "models, and the outcome of each requested item (exit status 1 if any failed). A plugin "
        "that registered classes lazily is 'registered' until they are imported: `rtpcore plugins "
        "check` (or --import-models) imports and validates them.",
    )
    add_allowlist_arguments(lister)
    lister.add_argument("--json", action="store_true", help="print a JSON array of objects")
    lister.add_argument(
        "--import-models",
        action="store_true",
        help="also import and validate every class the requested plugins register lazily "
        "(what `plugins check` does; may import torch)",
    )
    lister.add_argument(
        "--requested-only", action="store_true", help="show only the requested items"
    )
    add_log_level_argument(lister)
    lister.set_defaults(func=_list)

    checker = actions.add_parser(
        "check",
        help="load plugins in a fresh subprocess, import their models and report",
        description="Load each ITEM (a --plugins item) in a fresh Python process, import and "
        "validate every model class it registers (lazily registered ones too), and report its "
        "outcome: ok, or FAIL naming the plugin and what the engine would refuse.",
    )
    checker.add_argument(
        "items",
        nargs="+",
        type=plugins_arg,
        metavar="ITEM",
        help="a plugin to load, as --plugins names it: DIST[:ENTRY_POINT][SPECIFIER]",
    )
    checker.add_argument(
        "--external-model-packages",
        action="extend",
        type=external_model_packages_arg,
        default=[],
        metavar="MOD[,MOD...]",
        help="also load these unpackaged modules holding rtpcore hook implementations (repeatable)",
    )
    add_allow_patches_argument(checker)
    checker.add_argument("--json", action="store_true", help="print a JSON array of objects")
    add_log_level_argument(checker)
    checker.set_defaults(func=_check)
    add_test_parser(actions)
    add_init_parser(actions)


def _allowlist(plugins: list[str], modules: list[str], allow_patches: Sequence[str] = ()) -> Allowlist:
    return Allowlist.from_cli(plugins=plugins, external_model_packages=modules, allow_plugin_patches=allow_patches)


def _list(args: argparse.Namespace) -> int:
    allowlist = _allowlist(args.plugins, args.external_model_packages, args.allow_plugin_patches)
    rows = report_rows(
        allowlist, requested_only=args.requested_only, import_models=args.import_models
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows)
    from rtpcore.plugins.loading import OK_STATES

    return 1 if any(r["requested"] and r["state"] not in OK_STATES for r in rows) else 0


def report_rows(
    allowlist: Allowlist, *, requested_only: bool = False, import_models: bool = False
) -> list[dict[str, Any]]:
    """The rows of ``plugins list``: the built-in plugin, each request's outcome, then every
    other installed plugin (state ``not-requested``, or ``shadowed``), never imported.
    ``import_models``: import every class the requested plugins register lazily (``check``)."""
    from rtpcore.plugins.discovery import installed_plugins
    from rtpcore.plugins.loading import BUILTIN_PLUGIN, builtin_version, load_report

    report = load_report(allowlist.resolve(strict=False), import_models=import_models)
    installed = installed_plugins()
    declared = {(os.path.realpath(p.metadata_path), p.name): p for p in installed}
    own_version = builtin_version()
    rows: list[dict[str, Any]] = []
    if not requested_only:
        rows.append(
            _row(
                report.builtin,
                name=BUILTIN_PLUGIN,
                distribution="rtpcore",
                version=own_version,
                value=BUILTIN_PLUGIN,
                builtin=True,
            )
        )
    taken = set()
    for outcome in report.outcomes:
        entry, error = outcome.entry, outcome.error
        if entry is not None:
            key = (os.path.realpath(entry.metadata_path or ""), entry.name)
            taken.add(key)
            hint = declared.get(key)
            rows.append(
                _row(
                    outcome,
                    name=entry.name,
                    distribution=entry.distribution,
                    version=entry.version,
                    value=entry.value,
                    requested=True,
                    declared=hint.declared_architectures if hint else (),
                    registry=report.registry,
                )
            )
        else:
            rows.append(
                _row(
                    outcome,
                    name=outcome.request,
                    distribution=getattr(error, "distribution", None),
                    version=getattr(error, "version", None),
                    value=getattr(error, "entry_point", None),
                    requested=True,
                )
            )
    if not requested_only:
        for plugin in installed:
            if (os.path.realpath(plugin.metadata_path), plugin.name) in taken:
                continue
            rows.append(
                {
                    "name": plugin.name,
                    "distribution": plugin.distribution,
                    "version": plugin.version,
                    "value": plugin.value,
                    "state": "shadowed" if plugin.shadowed else "not-requested",
                    "requested": False,
                    "request": None,
                    "builtin": False,
                    "models": [],
                    "architectures": [],
                    "layouts": [],
                    "unimported": [],
                    "patches": [],
                    "seams": {seam: [] for seam in ("models", "kv_layouts", "tool_parsers", *SEAMS)},
                    "declared_architectures": list(plugin.declared_architectures),
                    "platforms": {},
                    "error": None,
                }
            )
    return rows


def _row(
    outcome: Any,
    *,
    name: str,
    distribution: str | None,
    version: str | None,
    value: str | None,
    requested: bool = False,
    builtin: bool = False,
    declared: tuple[str, ...] = (),
    registry: Any = None,
) -> dict[str, Any]:
    seams = dict(outcome.seams)
    return {
        "name": name,
        "distribution": distribution,
        "version": version,
        "value": value,
        "state": outcome.state,
        "requested": requested,
        "request": outcome.request if requested else None,
        "builtin": builtin,
        "models": list(outcome.models),
        "architectures": list(outcome.architectures),
        "layouts": list(outcome.layouts),
        "unimported": list(outcome.unimported),
        "patches": [f"{owner}.{attr} {kind}" for owner, attr, kind in outcome.patches],
        # What it registered, per seam (docs/design.md §18).
        "seams": {**{seam: [] for seam in ("models", "kv_layouts", "tool_parsers", *SEAMS)},
                  **{seam: list(names) for seam, names in outcome.seams},
                  "models": list(outcome.models), "kv_layouts": list(outcome.layouts),
                  "tool_parsers": list(outcome.tool_parsers)},
        "declared_architectures": list(declared),
        # Each of its platforms' availability (rtpcore.platforms.availability); the built-in ones are
        # not asked here (cuda's answer would import torch).
        "platforms": {} if builtin or registry is None else _platforms(registry, seams.get("platforms", ())),
        "error": str(outcome.error) if outcome.error is not None else None,
    }


def _platforms(registry: Any, names: Any) -> dict[str, str]:
    """``"available"`` or ``"unavailable: WHY"`` per platform name (an exception quoted, never swallowed)."""
    from rtpcore.platforms import availability

    out = {}
    for name in names:
        cls = registry.seam_class("platforms", name)
        if cls is not None:
            available, why = availability(cls)
            out[name] = "available" if available else f"unavailable: {why}"
    return out


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = ("STATE", "PLUGIN", "DISTRIBUTION", "VALUE", "MODELS")
    table = [header]
    for row in rows:
        dist = " ".join(x for x in (row["distribution"], row["version"]) if x) or "-"
        models = ", ".join(row["models"])
        if row["architectures"]:
            models += f" ({', '.join(row['architectures'])})"
        elif row["declared_architectures"]:
            models = f"declares {', '.join(row['declared_architectures'])}"
        for seam in ("kv_layouts", "tool_parsers", *SEAMS):  # the other seams' registrations, after the models
            if row["seams"][seam]:
                models += f"; {seam}: {', '.join(row['seams'][seam])}"
        name = row["name"] + (" (built-in)" if row["builtin"] else "")
        table.append((row["state"], name, dist, row["value"] or "-", models or "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    errors = {id(table[i + 1]): row.get("error") for i, row in enumerate(rows)}
    unimported = {  # the built-in's classes are rtpcore's own: check imports only plugins
        id(table[i + 1]): [] if row["builtin"] else row.get("unimported") or []
        for i, row in enumerate(rows)
    }
    patched = {id(table[i + 1]): row.get("patches") or [] for i, row in enumerate(rows)}
    platforms = {id(table[i + 1]): row.get("platforms") or {} for i, row in enumerate(rows)}
    for line in table:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False))
            + "  "
            + line[-1]
        )
        if errors.get(id(line)):
            print(f"    error: {errors[id(line)]}")
        if unimported.get(id(line)):
            print(
                f"    not imported yet: {', '.join(unimported[id(line)])} "
                "(`rtpcore plugins check` imports and validates them)"
            )
        if patched.get(id(line)):
            print(f"    patches accepted by --allow-plugin-patches: {', '.join(patched[id(line)])}")
        for name, state in platforms.get(id(line), {}).items():
            print(f"    platform {name}: {state}")


def _check(args: argparse.Namespace) -> int:
    items = [item for group in args.items for item in group]
    _allowlist(items, args.external_model_packages)  # parse-time validation, exit 2 on a bad item
    # -P (safe path): the child never puts the current directory on sys.path, so a
    # ./rtpcore/ folder or a same-named plugin module there cannot run instead (PYTHONPATH
    # still applies, which is how the operator points at plugins; -I would drop it and
    # the user site, changing what "installed" means between list and check).
    command = [sys.executable, "-P", "-m", "rtpcore", "plugins", "list", "--json"]
    command += ["--requested-only", "--import-models", "--log-level", args.log_level]
    for item in items:
        command += ["--plugins", item]
    for module in args.external_model_packages:
        command += ["--external-model-packages", module]
    for name in args.allow_plugin_patches:
        command += ["--allow-plugin-patches", name]
    # The child's log records are relayed to stderr; the variables this process has already
    # warned about (rtpcore ignores them, the child too) are left out, so it warns only once.
    env = {k: v for k, v in os.environ.items() if k not in IGNORED_ENV_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    log = proc.stderr.strip().splitlines()
    try:
        rows = json.loads(proc.stdout)
    except ValueError:
        *log, tail = log or ["no output"]
        _relay(log)
        print(
            f"rtpcore: error: the check process exited with status {proc.returncode}: {tail}",
            file=sys.stderr,
        )
        return 1
    _relay(log)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            where = f"{row['distribution']} {row['version']}, " if row["distribution"] else ""
            if row["state"] == "loaded":
                models = ", ".join(row["models"]) or "no models"
                archs = f" ({', '.join(row['architectures'])})" if row["architectures"] else ""
                print(
                    f"ok    {row['request']}: {row['name']} ({where}{row['value']}): {models}{archs}"
                )
            else:
                print(f"FAIL  {row['request']}: {row['state']}: {row['error']}")
    # Green only where the engine would serve every model: each row loaded (classes imported).
    return 0 if proc.returncode == 0 and all(r["state"] == "loaded" for r in rows) else 1


def _relay(lines: list[str]) -> None:
    """The check process's stderr (its log records), on this process's stderr."""
    for line in lines:
        print(line, file=sys.stderr)
