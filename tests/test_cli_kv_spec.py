"""``rtpcore kv-spec``: the per-layer KV table and block count of a real checkpoint config."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rtpcore.cli import main
from rtpcore.cli._kv_spec import parse_bytes


@pytest.fixture
def deepseek(tmp_path: Path) -> Path:
    """A DeepSeek-V3 checkpoint directory (config.json only) served by the atom-plugin."""
    from atom_plugin.deepseek import DeepseekV3Plugin

    config = dict(DeepseekV3Plugin.demo_config(), kv_lora_rank=512, qk_rope_head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    """A Llama checkpoint directory served by the built-in plugin."""
    from rtpcore.models.llama import LlamaPlugin

    (tmp_path / "config.json").write_text(json.dumps(LlamaPlugin.demo_config()))
    return tmp_path


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["kv-spec", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_lists_every_layer_and_the_blocks_that_fit(
    deepseek: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp8 DeepSeek layers default to "padded" (656 B/token) and --memory gives the block count."""
    assert main(["kv-spec", str(deepseek), "--plugins", "atom-plugin", "--kv-cache-dtype", "fp8", "--memory", "1MiB"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "deepseek_v3: 3 layers, KV fp8_e4m3, 16 tokens per block"
    assert out[1].split() == ["layer", "kind", "dtype", "layout", "B/token", "k", "B/block", "v", "B/block", "scale", "B/block"]  # fmt: skip
    assert [line.split() for line in out[2:5]] == [
        [f"layers.{i}", "mla", "fp8_e4m3", "padded", "656", "8192", "2048", "256"] for i in range(3)
    ]
    assert out[5] == "all layers: 1968 bytes per token, 31488 bytes per block"
    assert (
        out[6]
        == f"memory {2**20} bytes: {2**20 // 31488} blocks ({2**20 // 31488 * 16} tokens) per layer"
    )


def test_json_carries_regions_partition_and_block_count(
    deepseek: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json: one object with every layer's regions and the planned blocks."""
    report = run_json(capsys, str(deepseek), "--plugins", "atom-plugin", "--kv-cache-dtype", "fp8",
                      "--kv-layout", "compact", "--tokens-per-block", "64", "--memory", "10GB")  # fmt: skip
    assert report["model_type"] == "deepseek_v3" and report["tokens_per_block"] == 64
    layer = report["layers"][0]
    assert (layer["layout"], layer["bytes_per_token"], layer["block_bytes"]) == (
        "compact",
        576,
        576 * 64,
    )
    assert layer["regions"] == [
        {"name": "nope", "offset": 0, "nbytes": 512, "dtype": "fp8_e4m3"},
        {"name": "rope", "offset": 512, "nbytes": 64, "dtype": "fp8_e4m3"},
    ]
    assert report["bytes_per_block"] == 3 * 576 * 64
    assert report["num_blocks"] == 10 * 10**9 // (3 * 576 * 64)


def test_plugin_layout_selected_by_name(deepseek: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-layout names the atom-plugin's registered "ue8m0" layout (644 B/token)."""
    report = run_json(capsys, str(deepseek), "--plugins", "atom-plugin", "--kv-cache-dtype", "fp8", "--kv-layout", "ue8m0")  # fmt: skip
    assert {(x["layout"], x["bytes_per_token"], x["scale_block_bytes"]) for x in report["layers"]} == {("ue8m0", 644, 64)}  # fmt: skip
    assert report["num_blocks"] is None


def test_auto_dtype_follows_the_model_dtype_for_a_built_in_model(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A built-in Llama with --dtype bfloat16: bf16 MHA layers, no layout."""
    report = run_json(capsys, str(llama), "--dtype", "bfloat16")
    layer = report["layers"][0]
    assert (layer["kind"], layer["dtype"], layer["layout"]) == ("mha", "bf16", None)
    assert layer["scale_block_bytes"] == 0
    assert layer["k_block_bytes"] + layer["v_block_bytes"] == layer["block_bytes"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--plugins", "atom-plugin", "--kv-cache-dtype", "fp8", "--kv-layout", "ue9m0"],
         "rtpcore: error: unknown KV layout 'ue9m0'; known: 'compact', 'padded', 'ue8m0'"),
        ([], "rtpcore: error: no registered model serves the architectures ['DeepseekV3ForCausalLM']"),
        (["--plugins", "atom-plugin", "--kv-layout", "padded"],
         "needs an fp8 KV cache, but kv_cache_dtype is 'fp32'"),
    ],
)  # fmt: skip
def test_errors_are_one_line_and_exit_1(
    deepseek: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """Unknown layouts, unserved architectures and refused options: exit 1, one line on stderr."""
    assert main(["kv-spec", str(deepseek), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_bad_memory_is_a_usage_error(deepseek: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--memory 12XB and --tokens-per-block 0 exit with status 2 naming the argument."""
    for argv in (["--memory", "12XB"], ["--tokens-per-block", "0"]):
        with pytest.raises(SystemExit) as excinfo:
            main(["kv-spec", str(deepseek), *argv])
        assert excinfo.value.code == 2
        assert f"argument {argv[0]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [("1073741824", 2**30), ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5G", 1_500_000_000), ("64 kib", 65536)],
)  # fmt: skip
def test_parse_bytes_accepts_units(text: str, value: int) -> None:
    """Byte counts take decimal and binary units."""
    assert parse_bytes(text) == value
    with pytest.raises(argparse.ArgumentTypeError, match="invalid byte count '-1'"):
        parse_bytes("-1")


def test_console_command_in_a_spawned_process(deepseek: Path) -> None:
    """`python -m rtpcore kv-spec ... --json` prints the JSON report from a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-m", "rtpcore", "kv-spec", str(deepseek), "--plugins", "atom-plugin",
         "--kv-cache-dtype", "fp8", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout)["layers"][2]["bytes_per_token"] == 656
