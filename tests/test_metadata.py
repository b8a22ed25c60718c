"""Distribution lookup through importlib-metadata, against real metadata folders."""

from __future__ import annotations

import logging
import sys

import importlib_metadata
import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist
from rtpcore.errors import PluginLoadError
from rtpcore.plugins.discovery import installed_plugins
from rtpcore.plugins.metadata import (
    PLUGIN_GROUP,
    at,
    canonical_name,
    find,
    metadata_folder,
    scan,
)

BROKEN = "[rtpcore.plugins]\nbroken_line_without_equals\n"


@pytest.mark.parametrize(
    "spelling", ["atom-plugin", "Atom_Plugin", "atom.plugin", "ATOM--plugin", "atom_._plugin"]
)
def test_every_pep503_spelling_of_a_name_finds_the_distribution(
    plugin_env: PluginEnv, spelling: str
) -> None:
    """Case and runs of '-', '_', '.' do not matter; the METADATA Name is reported (the
    search stays in the temporary site: the real atom-plugin may be installed too)."""
    info = plugin_env.add_dist("Atom_Plugin", "0.3", plugins={"atom": "atom_mod"})
    (dist,) = find(spelling, path=[str(plugin_env.site)])
    assert (dist.name, dist.version, dist.path) == ("Atom_Plugin", "0.3", str(info))
    assert canonical_name(spelling) == "atom-plugin"


def test_a_folder_whose_name_header_differs_is_not_that_distribution(
    plugin_env: PluginEnv,
) -> None:
    """The folder name only nominates: its METADATA Name must normalize to the name asked."""
    info = plugin_env.site / "res_s-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: something-else\nVersion: 1.0\n")
    assert find("res-s") == []


def test_metadata_folder_is_the_dist_info_folder_importlib_metadata_found(
    plugin_env: PluginEnv,
) -> None:
    """metadata_folder reads importlib-metadata's private PathDistribution._path: this fails
    loudly if that attribute stops naming the metadata folder (dist-info, egg-info folder and
    legacy egg-info file alike)."""
    info = plugin_env.add_dist("res-t", "1.0")
    egg_dir = plugin_env.site / "res_u.egg-info"
    egg_dir.mkdir()
    (egg_dir / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: res-u\nVersion: 2.0\n")
    egg_file = plugin_env.site / "res_v-3.0.egg-info"
    egg_file.write_text("Metadata-Version: 1.1\nName: res-v\nVersion: 3.0\n")
    for name, folder, version in (
        ("res-t", info, "1.0"),
        ("res-u", egg_dir, "2.0"),
        ("res-v", egg_file, "3.0"),
    ):
        (dist,) = importlib_metadata.distributions(name=name, path=[str(plugin_env.site)])
        assert metadata_folder(dist) == str(folder)
        assert [(d.path, d.version) for d in find(name)] == [(str(folder), version)]
        found = at(str(folder))
        assert found is not None and found.version == version


def test_a_removed_metadata_folder_reads_as_nothing(plugin_env: PluginEnv) -> None:
    """at() on a folder that is gone (uninstalled behind a worker's back) is None."""
    assert at(str(plugin_env.site / "gone-1.0.dist-info")) is None


def test_a_malformed_entry_points_file_makes_the_named_distribution_invalid(
    plugin_env: PluginEnv,
) -> None:
    """Naming a distribution whose entry_points.txt cannot be parsed fails with state
    'invalid' (PluginLoadError) naming the distribution and the file; nothing is imported."""
    info = plugin_env.add_dist("res-w", "1.5", modules={"res_w_mod.py": "raise RuntimeError"})
    (info / "entry_points.txt").write_text(BROKEN)
    with pytest.raises(PluginLoadError) as excinfo:
        Allowlist.from_cli(plugins=["res-w"]).resolve()
    assert excinfo.value.state == "invalid"
    assert (excinfo.value.distribution, excinfo.value.version) == ("res-w", "1.5")
    assert "entry_points.txt cannot be parsed" in str(excinfo.value)
    assert str(info) in str(excinfo.value)
    assert "res_w_mod" not in sys.modules


def test_a_malformed_entry_points_file_is_skipped_by_the_scan(
    plugin_env: PluginEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """`plugins list` and the entry-point fallback skip the broken distribution with a
    warning and still see every other plugin."""
    broken = plugin_env.add_dist("res-x", plugins={"x": "x_mod"})
    (broken / "entry_points.txt").write_text(BROKEN)
    plugin_env.add_dist("res-y", plugins={"y-ep": "y_mod"})
    with caplog.at_level(logging.WARNING, logger="rtpcore.plugins.metadata"):
        names = {p.name for p in installed_plugins()}
    assert "y-ep" in names and "x" not in names
    assert str(broken) in caplog.text and "entry_points.txt" in caplog.text
    (entry,) = Allowlist.from_cli(plugins=["y-ep"]).resolve().entries
    assert entry.distribution == "res-y"


def test_the_scan_reads_only_distributions_with_the_group(plugin_env: PluginEnv) -> None:
    """scan() returns the distributions that have an entry point in the group, with all
    their entry points, once per metadata folder."""
    plugin_env.add_dist("res-z", plugins={"z": "z_mod"}, architectures={"ZForCausalLM": "z"})
    plugin_env.add_dist("res-plain", "1.0")
    sys.path.append(str(plugin_env.site))  # the same folder twice is one installation
    found = [d for d in scan(PLUGIN_GROUP) if d.name.startswith("res-")]
    assert [d.name for d in found] == ["res-z"]
    assert found[0].entry_points == (
        ("rtpcore.plugins", "z", "z_mod"),
        ("rtpcore.architectures", "ZForCausalLM", "z"),
    )
