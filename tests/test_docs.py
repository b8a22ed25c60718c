"""The documentation names only things that exist, and the README stays short.

Every ``rtpcore.<dotted>`` / ``rtpcore_native.<dotted>`` path and every repository file
path (``src/...``, ``docs/...``, ``benchmarks/...``, ``tests/...``, ``plugins_example/...``)
written in README.md and docs/*.md must exist. docs/design.md, the contract, is exempt: it
keeps historical names. Module paths are resolved to files under src/ without importing
anything; a trailing attribute (``rtpcore.errors.WorkerError``) must be defined or
re-exported by its module.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
README_MAX_LINES = 250

# Dotted names that are entry-point groups, not modules.
ENTRY_POINT_GROUPS = {"rtpcore.plugins", "rtpcore.architectures", "rtpcore.quantization_methods"}

MODULE_PATH = re.compile(r"(?<![\w./~-])(rtpcore(?:_native)?(?:\.[A-Za-z_]\w*)+)")
FILE_PATH = re.compile(r"(?<![\w./~-])((?:src|docs|benchmarks|tests|plugins_example)/[\w./-]*[\w/])")


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` under src/ (a compiled module's stub), or None."""
    base = SRC.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi")):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines or re-exports at top level: defs, classes, assignments,
    imports, ``__all__`` entries and the keys of a lazy-export table."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            value = node.value
            if isinstance(value, ast.List | ast.Tuple | ast.Set):
                names.update(e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            elif isinstance(value, ast.Dict):
                names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """True when the longest module prefix of ``dotted`` exists and the next part, if
    any, is a module of it or a name it defines."""
    if dotted in ENTRY_POINT_GROUPS:
        return True
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:i]))
        if path is not None:
            return i == len(parts) or parts[i] in defined_names(path)
    return False


def mentions(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted({(doc.name, m) for doc in DOCS for m in pattern.findall(doc.read_text(encoding="utf-8"))})


@pytest.mark.parametrize(("doc", "dotted"), mentions(MODULE_PATH))
def test_module_paths_in_docs_exist(doc: str, dotted: str) -> None:
    assert resolves(dotted), f"{doc} names {dotted}, which is not a module or a name of one under src/"


@pytest.mark.parametrize(("doc", "path"), mentions(FILE_PATH))
def test_file_paths_in_docs_exist(doc: str, path: str) -> None:
    assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


def test_the_checker_catches_a_stale_name() -> None:
    """The resolver refuses moved modules and unknown attributes (so the tests above can fail)."""
    assert resolves("rtpcore.plugins.allowlist") and resolves("rtpcore.errors.WorkerError")
    assert resolves("rtpcore.Engine") and resolves("rtpcore_native.KVCacheSpecDesc")
    assert not resolves("rtpcore.kv_packing") and not resolves("rtpcore.errors.NoSuchError")
    assert MODULE_PATH.findall("see `rtpcore.kv.codecs`, not ~/rtpcore.secret") == ["rtpcore.kv.codecs"]
    assert FILE_PATH.findall("`plugins_example/atom_plugin/src/atom_plugin/hooks.py`") == [
        "plugins_example/atom_plugin/src/atom_plugin/hooks.py"
    ]


LINK = re.compile(r"\]\(((?:[\w./-]+\.md)?)#([\w-]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_to_headings_resolve(doc: Path) -> None:
    for target, anchor in LINK.findall(doc.read_text(encoding="utf-8")):
        linked = (doc.parent / target).resolve() if target else doc
        assert anchor in anchors(linked), f"{doc.name} links to {target}#{anchor}, which is no heading there"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES}, move the rest to docs/"


def _synopsis(doc: Path, command: str) -> str:
    """The synopsis of ``rtpcore COMMAND`` in ``doc``'s first plain code block that has one."""
    blocks, block, fence = [], [], None
    for line in doc.read_text(encoding="utf-8").splitlines():
        if fence is None and line.startswith("```"):
            fence, block = line, []
        elif fence is not None and line.strip() == "```":
            if fence == "```":
                blocks.append(block)
            fence = None
        elif fence is not None:
            block.append(line)
    for lines in blocks:
        start = next((i for i, ln in enumerate(lines) if ln.startswith(f"rtpcore {command} [")), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
            return "\n".join(lines[start:end])
    raise AssertionError(f"{doc.name} has no synopsis of rtpcore {command}")


def test_the_guide_synopsis_of_generate_lists_every_flag() -> None:
    """docs/plugins.md §15's synopsis of ``rtpcore generate`` names every flag the command takes
    (it once lacked --quantization and --no-native-decode)."""
    import subprocess
    import sys

    helped = subprocess.run([sys.executable, "-m", "rtpcore", "generate", "--help"], capture_output=True,
                            text=True, check=True).stdout
    usage = helped.split("\n\n", 1)[0]  # the usage paragraph lists every option once
    flags = set(re.findall(r"--[a-z][\w-]*", usage))
    assert {"--plugins", "--prompt", "--dtype"} <= flags
    synopsis = _synopsis(ROOT / "docs" / "plugins.md", "generate")
    missing = sorted(f for f in flags - {"--help"} if not re.search(re.escape(f) + r"(?![\w-])", synopsis))
    assert missing == []
