"""The plugin author's API (docs/design.md §21) as text, and the snapshot it is held to.

``surface()`` renders every public module's ``__all__``: each function's signature, each class's
bases and its public methods, properties and declared attributes (those of rtpcore's own classes
in its MRO; torch's and the standard library's are theirs), each constant's value. One line per
entry, sorted, so a diff reads as the change a plugin author sees.

    python tests/api_surface.py            # print the live surface's diff against the snapshot
    python tests/api_surface.py --update   # rewrite tests/plugin_api.snapshot
    python tests/api_surface.py --update --compatible rtpcore.X.y   # a change that breaks no plugin

``--update`` refuses an incompatible change (a line of the snapshot removed or altered: a name
gone, a signature changed, a constant's value changed) unless ``FORWARD_CONTRACT`` was raised past
the snapshot's and CHANGELOG.md names every name so changed. Additions are compatible. The test in
test_public_api.py fails while the snapshot and the live surface differ: a surface change and its
snapshot land in the same commit.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "plugin_api.snapshot"
CHANGELOG = ROOT / "CHANGELOG.md"

#: The public modules of §21, in the order of its table.
PUBLIC_MODULES = (
    "rtpcore",
    "rtpcore.errors",
    "rtpcore.config_fields",
    "rtpcore.layers",
    "rtpcore.batch",
    "rtpcore.sharding",
    "rtpcore.kv",
    "rtpcore.checkpoint",
    "rtpcore.testing",
    "rtpcore.reasoning",
    "rtpcore.attention",
    "rtpcore.platforms",
    "rtpcore.quantization",
    "rtpcore.logits",
    "rtpcore_native",
)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _own(cls: type) -> bool:
    return (cls.__module__ or "").split(".")[0] in {"rtpcore", "rtpcore_native"}


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # a pybind11 function: its signature is its docstring's first line
        first = (getattr(obj, "__doc__", None) or "").strip().splitlines()[:1]
        text = _names_only(first[0][first[0].find("(") :]) if first and "(" in first[0] else "(...)"
    return _ADDRESS.sub("", text)


def _names_only(signature: str) -> str:
    """A pybind11 signature's parameters and defaults, without the annotations: pybind11 spells
    types differently from one release to the next (``int`` became ``typing.SupportsInt | ...``),
    and a plugin calls by name and position, not by the spelling."""
    head = signature.split(" -> ")[0]
    try:
        args = ast.parse(f"def f{head}: pass").body[0].args  # type: ignore[attr-defined]
    except SyntaxError:
        return head
    plain = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(plain) - len(args.defaults)) + list(args.defaults)
    parts = [a.arg + ("" if d is None else f"={ast.unparse(d)}") for a, d in zip(plain, defaults, strict=True)]
    if args.kwonlyargs:
        parts.append("*")
        parts += [a.arg + ("" if d is None else f"={ast.unparse(d)}") for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return f"({', '.join(parts)})"


def _member(name: str, value: Any, owner: type) -> str | None:
    """One line for a class member, or None for what is not the class's own public surface."""
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, property):
        return f"property {name}"
    if isinstance(raw, staticmethod):
        return f"staticmethod {name}{_signature(value)}"
    if isinstance(raw, classmethod):
        return f"classmethod {name}{_signature(value)}"
    if inspect.isfunction(raw) or inspect.isroutine(raw):
        return f"method {name}{_signature(raw)}"
    if type(raw).__name__ in {"member_descriptor", "getset_descriptor"}:  # __slots__, attrs, pybind11
        annotated = getattr(owner, "__annotations__", {}).get(name)
        return f"attribute {name}" + ("" if annotated is None else f": {annotated}")
    if inspect.isclass(raw):
        return f"class {name}"
    return f"attribute {name} = {_ADDRESS.sub('', repr(raw))}"


def _class_lines(prefix: str, cls: type) -> list[str]:
    bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__ if b is not object)
    lines = [f"{prefix}: class({bases})"]
    names: dict[str, type] = {}
    for klass in reversed(cls.__mro__):  # the most derived owner wins
        if not _own(klass):
            continue
        for name in [*vars(klass), *getattr(klass, "__annotations__", {})]:
            if not name.startswith("_"):
                names[name] = klass
    if issubclass(cls, enum.Enum):
        return lines + [f"{prefix}.{m.name}: member = {m.value!r}" for m in cls]
    for name, owner in sorted(names.items()):
        annotated = getattr(owner, "__annotations__", {}).get(name)
        if name not in vars(owner):  # declared only by an annotation (an attrs field, a dataclass field)
            lines.append(f"{prefix}.{name}: attribute: {annotated}")
            continue
        line = _member(name, getattr(cls, name), owner)
        if line is not None:
            lines.append(f"{prefix}.{name}: {line}")
    if any("__init__" in vars(k) for k in cls.__mro__ if _own(k)):  # how a plugin constructs it
        lines.append(f"{prefix}.__init__: method __init__{_signature(cls.__init__)}")
    return lines


def module_lines(name: str) -> list[str]:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return [f"{name}: NO __all__"]
    lines = [f"{name}: module"]
    for attr in sorted(exported):
        value = getattr(module, attr)
        prefix = f"{name}.{attr}"
        if inspect.ismodule(value):
            lines.append(f"{prefix}: module {value.__name__}")
        elif inspect.isclass(value):
            lines.extend(_class_lines(prefix, value))
        elif callable(value):
            lines.append(f"{prefix}: def{_signature(value)}")
        elif attr == "__version__":
            lines.append(f"{prefix}: str")  # changes every release; not a contract
        else:
            lines.append(f"{prefix}: = {_ADDRESS.sub('', repr(value))}")
    return lines


def surface() -> list[str]:
    return [line for name in PUBLIC_MODULES for line in module_lines(name)]


def contract() -> int:
    from rtpcore import FORWARD_CONTRACT

    return FORWARD_CONTRACT


def read_snapshot(path: Path = SNAPSHOT) -> tuple[int | None, list[str]]:
    """The snapshot's forward contract and its lines (``# ...`` lines are comments)."""
    if not path.exists():
        return None, []
    text = path.read_text(encoding="utf-8").splitlines()
    major = next((int(line.split()[-1]) for line in text if line.startswith("# forward_contract ")), None)
    return major, [line for line in text if line and not line.startswith("#")]


def incompatible(old: list[str], new: list[str]) -> list[str]:
    """The snapshot's lines the new surface no longer has, as they were."""
    keep = set(new)
    return [line for line in old if line not in keep]


def changed_names(lines: list[str]) -> list[str]:
    return sorted({line.split(":", 1)[0] for line in lines})


def update(path: Path = SNAPSHOT, changelog: Path = CHANGELOG, compatible: tuple[str, ...] = ()) -> list[str]:
    """Rewrite the snapshot; the problems that refuse it (nothing written then).

    ``compatible``: entries (``rtpcore.ModelPlugin.forward_contract``) whose change breaks no
    plugin that worked (a default every working plugin overrides, say) -- they need the CHANGELOG
    entry, not a new FORWARD_CONTRACT. Saying so is a reviewed decision: it is on the command line."""
    old_major, old = read_snapshot(path)
    new, major = surface(), contract()
    gone = incompatible(old, new)
    problems = []
    if gone and old_major is not None:
        breaking = [n for n in changed_names(gone) if n not in compatible]
        if breaking and major <= old_major:
            problems.append(
                f"an incompatible change to the plugin API needs a new FORWARD_CONTRACT (now {major}, "
                f"the snapshot's {old_major}): {', '.join(breaking)}"
            )
        log = changelog.read_text(encoding="utf-8") if changelog.exists() else ""
        missing = [n for n in changed_names(gone) if n.rsplit(".", 1)[-1] not in log]
        if missing:
            problems.append(f"CHANGELOG.md does not name the changed or removed: {', '.join(missing)}")
    if not problems:
        header = [
            "# The plugin author's API (docs/design.md §21): written by `python tests/api_surface.py --update`.",
            f"# forward_contract {major}",
        ]
        path.write_text("\n".join([*header, *new]) + "\n", encoding="utf-8")
    return problems


def main(argv: list[str]) -> int:
    if "--update" in argv:
        compatible = tuple(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--compatible")
        problems = update(compatible=compatible)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    _, old = read_snapshot()
    new = surface()
    for line in incompatible(old, new):
        print(f"- {line}")
    for line in incompatible(new, old):
        print(f"+ {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
