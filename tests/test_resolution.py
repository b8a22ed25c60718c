"""Resolution against real dist-info folders: direct lookup, fallback, specifiers, shadowing."""

from __future__ import annotations

import pickle
import sys

import importlib_metadata
import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist, Plan
from rtpcore.errors import PluginConflictError, PluginNotFoundError, PluginVersionError
from rtpcore.plugins.metadata import find, metadata_folder

RAISES = "raise RuntimeError('imported!')\n"


def _resolve(*items: str, modules: tuple[str, ...] = ()) -> Plan:
    return Allowlist.from_cli(plugins=items, external_model_packages=modules).resolve(strict=False)


def test_a_distribution_resolves_to_its_entry_points_without_importing(
    plugin_env: PluginEnv,
) -> None:
    """The plan records name, value, distribution, version and the metadata folder; nothing is imported."""
    info = plugin_env.add_dist(
        "res-a", "1.2", plugins={"a": "res_a_mod:hooks"}, modules={"res_a_mod/__init__.py": RAISES}
    )
    plan = Allowlist.from_cli(plugins=["res-a"]).resolve()
    (entry,) = plan.entries
    assert (entry.name, entry.value, entry.distribution, entry.version) == (
        "a",
        "res_a_mod:hooks",
        "res-a",
        "1.2",
    )
    assert entry.metadata_path == str(info)
    assert entry.request == "res-a"
    assert "res_a_mod" not in sys.modules


def test_names_are_compared_after_pep503_normalization(plugin_env: PluginEnv) -> None:
    """'Res.B_Plugin' finds the distribution 'res-b-plugin'."""
    plugin_env.add_dist("res-b-plugin", plugins={"b": "res_b"})
    (entry,) = _resolve("Res.B_Plugin").entries
    assert entry.distribution == "res-b-plugin"


def test_every_entry_point_of_a_distribution_is_planned_unless_one_is_named(
    plugin_env: PluginEnv,
) -> None:
    """DIST selects all its rtpcore.plugins entry points; DIST:EP exactly one."""
    plugin_env.add_dist("res-c", plugins={"one": "c1", "two": "c2"})
    assert [e.name for e in _resolve("res-c").entries] == ["one", "two"]
    assert [e.name for e in _resolve("res-c:two").entries] == ["two"]


def test_a_distribution_name_is_looked_up_without_any_discovery_scan(
    plugin_env: PluginEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolving a distribution name asks importlib-metadata for that name only (never an
    unnamed discovery or entry_points()) and reads no other distribution's metadata."""
    info = plugin_env.add_dist("res-d", plugins={"d": "d_mod"})
    plugin_env.add_dist("res-d-neighbour", plugins={"n": "n_mod"})
    discover = importlib_metadata.Distribution.discover.__func__  # type: ignore[attr-defined]
    read_text = importlib_metadata.PathDistribution.read_text
    folders: set[str] = set()

    def named_only(cls: type, **kwargs: object) -> object:
        if not kwargs.get("name"):
            raise AssertionError(f"discovery scan: {kwargs}")
        return discover(cls, **kwargs)

    def reading(self: importlib_metadata.PathDistribution, filename: str) -> str | None:
        folders.add(metadata_folder(self) or "")
        return read_text(self, filename)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("discovery scan")

    monkeypatch.setattr(importlib_metadata.Distribution, "discover", classmethod(named_only))
    monkeypatch.setattr(importlib_metadata.PathDistribution, "read_text", reading)
    monkeypatch.setattr(importlib_metadata, "entry_points", forbidden)
    assert [e.name for e in _resolve("res-d>=1").entries] == ["d"]
    assert folders == {str(info)}


def test_an_entry_point_name_is_accepted_when_it_names_no_distribution(
    plugin_env: PluginEnv,
) -> None:
    """'fallback-ep' names no distribution but exactly one entry point, of 'res-e'."""
    plugin_env.add_dist("res-e", "2.0", plugins={"fallback-ep": "e_mod"})
    (entry,) = _resolve("fallback-ep>=2").entries
    assert (entry.distribution, entry.name, entry.request) == (
        "res-e",
        "fallback-ep",
        "fallback-ep>=2",
    )
    assert _resolve("fallback-ep<2").failures[0].state == "version-mismatch"


def test_an_entry_point_name_of_two_distributions_is_refused_naming_both(
    plugin_env: PluginEnv,
) -> None:
    """Two distributions with the entry point 'twin' make '--plugins twin' ambiguous."""
    plugin_env.add_dist("res-f1", plugins={"twin": "f1"})
    plugin_env.add_dist("res-f2", plugins={"twin": "f2"})
    (failure,) = _resolve("twin").failures
    assert failure.state == "not-installed"
    assert "res-f1:twin" in failure.message and "res-f2:twin" in failure.message


def test_nothing_installed_is_not_installed(plugin_env: PluginEnv) -> None:
    """An unknown name fails with PluginNotFoundError, state not-installed."""
    with pytest.raises(PluginNotFoundError) as excinfo:
        Allowlist.from_cli(plugins=["res-missing"]).resolve()
    assert excinfo.value.state == "not-installed"
    assert excinfo.value.plugin == "res-missing"
    assert "'res-missing'" in str(excinfo.value)


def test_a_missing_entry_point_lists_the_ones_there_are(plugin_env: PluginEnv) -> None:
    """res-g:nope fails with no-such-entry-point naming the available 'real'."""
    plugin_env.add_dist("res-g", "3.1", plugins={"real": "g"})
    plugin_env.add_dist("res-h", "1.0")
    with pytest.raises(PluginNotFoundError) as excinfo:
        Allowlist.from_cli(plugins=["res-g:nope"]).resolve()
    assert excinfo.value.state == "no-such-entry-point"
    assert (excinfo.value.distribution, excinfo.value.version, excinfo.value.entry_point) == (
        "res-g",
        "3.1",
        "nope",
    )
    assert "'real'" in str(excinfo.value)
    (failure,) = _resolve("res-h").failures
    assert failure.state == "no-such-entry-point"
    assert "no rtpcore.plugins entry points" in failure.message


def test_a_specifier_mismatch_fails_before_any_import(plugin_env: PluginEnv) -> None:
    """res-i 1.0 does not satisfy >=2; the module (which raises on import) is untouched."""
    plugin_env.add_dist(
        "res-i", "1.0", plugins={"i": "res_i_mod"}, modules={"res_i_mod.py": RAISES}
    )
    with pytest.raises(PluginVersionError) as excinfo:
        Allowlist.from_cli(plugins=["res-i>=2,<3"]).resolve()
    assert excinfo.value.state == "version-mismatch"
    assert excinfo.value.version == "1.0"
    assert "res-i<3,>=2" in str(excinfo.value) and "1.0" in str(excinfo.value)
    assert "res_i_mod" not in sys.modules
    assert [e.version for e in _resolve("res-i>=1.0,<3").entries] == ["1.0"]


def test_a_prerelease_that_satisfies_the_bounds_is_accepted(plugin_env: PluginEnv) -> None:
    """An installed 2.0rc1 satisfies >=1 (the operator installed it on purpose)."""
    plugin_env.add_dist("res-j", "2.0rc1", plugins={"j": "j"})
    assert _resolve("res-j>=1").entries


def test_two_installed_copies_are_shadowed(plugin_env: PluginEnv) -> None:
    """One name in two path folders is PluginConflictError, state shadowed, naming both."""
    second = plugin_env.add_site("second")
    plugin_env.add_dist("res-k", "1.0", plugins={"k": "k"})
    plugin_env.add_dist("res-k", "2.0", plugins={"k": "k"}, site=second)
    with pytest.raises(PluginConflictError) as excinfo:
        Allowlist.from_cli(plugins=["res-k"]).resolve()
    assert excinfo.value.state == "shadowed"
    assert len(excinfo.value.providers) == 2
    assert "1.0" in str(excinfo.value) and "2.0" in str(excinfo.value)
    assert [d.version for d in find("Res_K")] == ["2.0", "1.0"]


def test_the_same_folder_twice_on_the_path_is_not_shadowing(plugin_env: PluginEnv) -> None:
    """A folder listed twice on sys.path is one installation."""
    plugin_env.add_dist("res-l", plugins={"l": "l"})
    sys.path.append(str(plugin_env.site))
    assert len(_resolve("res-l").entries) == 1


def test_a_plan_is_frozen_hashable_and_picklable(plugin_env: PluginEnv) -> None:
    """Equal plans hash alike, survive pickling and cannot be mutated."""
    plugin_env.add_dist("res-m", plugins={"m": "m"})
    plan = _resolve("res-m", "gone", modules=("ext.mod",))
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert (
        hash(pickle.loads(pickle.dumps(plan)))
        == hash(plan)
        == hash(_resolve("res-m", "gone", modules=("ext.mod",)))
    )
    with pytest.raises(AttributeError):
        plan.entries = ()  # type: ignore[misc]
    assert [e.name for e in plan.entries] == ["m", "ext.mod"]
    assert plan.entries[1].distribution is None and plan.entries[1].version is None
    assert plan.requests == ("res-m", "gone", "ext.mod")


def test_strict_resolution_raises_the_first_failure_in_request_order(plugin_env: PluginEnv) -> None:
    """With several bad requests, the first one's error is raised."""
    plugin_env.add_dist("res-n", "1.0", plugins={"n": "n"})
    with pytest.raises(PluginVersionError):
        Allowlist.from_cli(plugins=["res-n>5", "res-unknown"]).resolve()
    plan = _resolve("res-n>5", "res-unknown")
    assert [f.state for f in plan.failures] == ["version-mismatch", "not-installed"]


def test_an_explicit_path_is_searched_instead_of_sys_path(plugin_env: PluginEnv) -> None:
    """resolve(path=[folder]) finds distributions only there, by name and by entry point."""
    elsewhere = plugin_env.root / "elsewhere"
    elsewhere.mkdir()
    plugin_env.add_dist("res-p", "4.0", plugins={"p-ep": "p"}, site=elsewhere)
    allowlist = Allowlist.from_cli(plugins=["res-p", "p-ep"])
    plan = allowlist.resolve(path=[str(elsewhere)])
    assert [(e.distribution, e.version) for e in plan.entries] == [("res-p", "4.0")]
    assert [f.state for f in allowlist.resolve(strict=False).failures] == ["not-installed"] * 2


@pytest.mark.parametrize("neighbour", ["plain-1.0.dist-info", "\u0130stanbul-1.0.dist-info"])
def test_direct_lookup_matches_every_spelling_of_a_name(
    plugin_env: PluginEnv, neighbour: str
) -> None:
    """Mixed case, dots and egg-info folders are found; look-alike names are not (also when a
    non-ASCII neighbour changes length when lowercased)."""
    site = plugin_env.site
    (site / neighbour).mkdir()
    plugin_env.add_dist("Res_Q.Plugin", "1.0")
    legacy = site / "res.q.plugin.egg-info"
    legacy.mkdir()
    (legacy / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: res-q-plugin\nVersion: 0.9\n")
    plugin_env.add_dist("res-q-plugins", "3.0")  # a longer name is another distribution
    found = find("RES-Q-PLUGIN", path=[str(site)])
    assert sorted((d.name, d.version) for d in found) == [
        ("Res_Q.Plugin", "1.0"),
        ("res-q-plugin", "0.9"),
    ]


def test_a_stale_folder_listing_is_not_trusted(plugin_env: PluginEnv) -> None:
    """A distribution installed after the folder listing was cached (no invalidate_caches)
    is still found: importlib-metadata reuses a listing only while the folder's mtime is
    unchanged."""
    import importlib

    plugin_env.add_module("res_r_mod.py", "")
    importlib.import_module("res_r_mod")  # the import system now holds the folder listing
    assert find("res-r") == []  # ...and so does importlib-metadata
    info = plugin_env.site / "res_r-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: res-r\nVersion: 1.0\n")
    assert [d.version for d in find("res-r")] == ["1.0"]
