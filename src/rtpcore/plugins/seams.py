"""The plugin seams beyond models (docs/design.md §18): what each one is, its API version, and
the rules a class registered on it must meet.

Every seam is a pluggy hook (``rtpcore.plugins.hooks``) whose ``registry`` argument has one
``register_...`` method per seam; a registration is recorded with the plugin's provenance and
committed with the plugin's other registrations, or not at all
(``rtpcore.plugins.registration``). A class registered on a seam subclasses the seam's base
class and states:

- ``name``: what users select it by (``--reasoning-parser NAME``, ...): letters, digits, ``_``,
  ``-`` or ``.``;
- ``api_version``: the seam's ``"MAJOR.MINOR"`` it was written for (inherited from the base
  class when the class does not say). Another major, or a newer minor than
  :data:`SEAM_API_VERSIONS` holds for the seam, is state ``incompatible``;
- ``replaces``: the names of rtpcore's built-in registrations on the seam it takes over (a
  tuple, empty by default): each of those names then selects the plugin's class. Taking a
  built-in's name without listing it, or a name another plugin took, is a
  ``PluginConflictError`` naming both providers.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from attrs import frozen

from rtpcore.plugins.model_plugin import FORWARD_CONTRACT

__all__ = ["SEAMS", "SEAM_API_VERSIONS", "Seam", "seam_class_problems", "version_problem"]

#: Each seam's API version, ``"MAJOR.MINOR"``: a class written for another major, or for a newer
#: minor than this, is refused (state ``incompatible``). ``models`` follows the forward
#: contract (``FORWARD_CONTRACT``). A seam is listed here once the engine calls what is
#: registered on it: every seam of docs/design.md §18 is.
SEAM_API_VERSIONS: dict[str, str] = {
    "models": f"{FORWARD_CONTRACT}.0",
    "kv_layouts": "1.0",
    "tool_parsers": "1.1",  # 1.1: feed/finish, the incremental parse
    "reasoning_parsers": "1.0",
    "attention_backends": "1.0",
    "platforms": "1.0",
    "quantization_methods": "1.0",
    "logits_processors": "1.0",
}

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_VERSION_RE = re.compile(r"(\d+)\.(\d+)")


@frozen
class Seam:
    """One class seam: ``name`` (the key of :data:`SEAM_API_VERSIONS` and of ``plugins list``'s
    ``seams``), ``what`` (for messages), the ``hook`` that receives the registry, the registry's
    ``method``, and the ``base`` class (``"module:Class"``, imported when a class is checked)."""

    name: str
    what: str
    hook: str
    method: str
    base: str

    def base_class(self) -> type[Any]:
        module, _, qualname = self.base.partition(":")
        cls: type[Any] = getattr(importlib.import_module(module), qualname)
        return cls


#: The class seams, by name, in the order ``plugins list`` shows them.
SEAMS: dict[str, Seam] = {
    s.name: s
    for s in (
        Seam("attention_backends", "attention backend", "rtpcore_register_attention_backends",
             "register_attention_backend", "rtpcore.attention:AttentionBackend"),
        Seam("quantization_methods", "quantization method", "rtpcore_register_quantization_methods",
             "register_quantization_method", "rtpcore.quantization:QuantizationMethod"),
        Seam("platforms", "platform", "rtpcore_register_platforms", "register_platform",
             "rtpcore.platforms:Platform"),
        Seam("reasoning_parsers", "reasoning parser", "rtpcore_register_reasoning_parsers",
             "register_reasoning_parser", "rtpcore.reasoning:ReasoningParser"),
        Seam("logits_processors", "logits processor", "rtpcore_register_logits_processors",
             "register_logits_processor", "rtpcore.logits:LogitsProcessor"),
    )
}


def version_problem(seam: str, stated: object) -> str | None:
    """Why a class stating ``api_version = stated`` cannot run on ``seam`` here (None: it can)."""
    running = SEAM_API_VERSIONS[seam]
    found = _VERSION_RE.fullmatch(stated) if isinstance(stated, str) else None
    if found is None:
        return f"api_version must be a 'MAJOR.MINOR' string, got {stated!r}"
    major, minor = int(found[1]), int(found[2])
    run_major, run_minor = (int(x) for x in running.split("."))
    if major != run_major:
        return (f"it was written for the {seam} API {stated}, and this rtpcore runs {running} (another "
                "major: install a release of the plugin written for it)")
    if minor > run_minor:
        return (f"it was written for the {seam} API {stated}, newer than this rtpcore's {running}: "
                "upgrade rtpcore")
    return None


def seam_class_problems(seam: Seam, cls: object) -> list[str]:
    """What makes ``cls`` unfit for ``seam``, every problem but the version (empty: fit).
    A base class may add its own rules as a classmethod ``seam_problems()``."""
    base = seam.base_class()
    if not isinstance(cls, type) or not issubclass(cls, base):
        return [f"a {seam.what} must be a subclass of {base.__module__}.{base.__qualname__}, got {cls!r}"]
    problems = []
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        problems.append(f"name must be letters, digits, '_', '-' or '.', starting with a letter or digit; "
                        f"got {name!r}")
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        problems.append(f"does not implement {', '.join(missing)}")
    replaces = getattr(cls, "replaces", ())
    if not isinstance(replaces, tuple) or not all(isinstance(r, str) and r for r in replaces):
        problems.append(f"replaces must be a tuple of built-in {seam.what} names, got {replaces!r}")
    extra = getattr(cls, "seam_problems", None)
    if callable(extra):
        problems += list(extra())
    return problems
