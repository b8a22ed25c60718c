"""The engine's options are declared once (rtpcore.engine.config.EngineOptions): the Python API's
keywords, EngineConfig's fields and the command line's flags all come from that declaration."""

from __future__ import annotations

import inspect
import subprocess
import sys

import attrs
import pytest

from rtpcore import AsyncEngine, Engine, EngineConfig
from rtpcore.cli import build_parser
from rtpcore.cli._args import engine_options
from rtpcore.engine.config import DTYPES, QUANTIZATIONS, EngineOptions

OPTIONS = attrs.fields(EngineOptions)


def subparser(command: str) -> object:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")  # argparse's subparsers action
    return action.choices[command]  # type: ignore[index]


@pytest.mark.parametrize("func", [Engine.from_pretrained, AsyncEngine.from_pretrained, EngineConfig.create])
def test_every_option_is_a_keyword_with_its_declared_default(func: object) -> None:
    params = inspect.signature(func).parameters  # type: ignore[arg-type]
    for f in OPTIONS:
        assert f.name in params, f.name
        assert params[f.name].default == f.default and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "plugins" in params and "external_model_packages" in params


def test_every_option_is_a_field_of_the_resolved_config() -> None:
    resolved = {f.name for f in attrs.fields(EngineConfig)}
    assert {f.name for f in OPTIONS} <= resolved
    assert resolved - {f.name for f in OPTIONS} == {"checkpoint", "plan", "platform"}  # platform: device resolved


def test_an_unknown_option_is_a_type_error_naming_it_and_the_closest_before_anything_loads(tmp_path) -> None:
    with pytest.raises(TypeError, match=r"Engine.from_pretrained\(\) got an unexpected option 'max_batch'.*'max_batch_size'"):
        Engine.from_pretrained(tmp_path / "nothing here", max_batch=4)
    with pytest.raises(TypeError, match=r"EngineConfig.create\(\) got an unexpected option 'colour'"):
        EngineConfig.create(tmp_path, colour="red")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_each_flag_is_generated_from_its_option(command: str) -> None:
    """Every option with a flag for this command parses into the option's name, with the option's
    default when absent; a --no-NAME switch gives False; options of other commands are absent."""
    p = subparser(command)
    base = ["--demo", "llama"] + (["--prompt", "hi"] if command == "generate" else [])
    actions = {a.dest: a for a in p._actions}  # type: ignore[attr-defined]
    defaults = engine_options(p.parse_args(base))  # type: ignore[attr-defined]
    for f in OPTIONS:
        flag = f.metadata["cli"]
        if f.name == "allow_plugin_patches":  # the allowlist's own flag (add_allowlist_arguments)
            assert actions[f.name].option_strings == ["--allow-plugin-patches"]
            continue
        if flag is None or (flag.commands is not None and command not in flag.commands):
            assert f.name not in actions, f.name
            continue
        assert actions[f.name].option_strings == [flag.flag(f.name)]
        assert defaults[f.name] == f.default
        if flag.negative:
            assert engine_options(p.parse_args([*base, flag.flag(f.name)]))[f.name] is False  # type: ignore[attr-defined]
    assert ("max_batch_size" in actions) == (command == "serve")


def test_given_flags_reach_the_engine_options() -> None:
    p = subparser("serve")
    args = p.parse_args([  # type: ignore[attr-defined]
        "--demo", "llama", "--dtype", "bfloat16", "--kv-cache-memory", "2MiB", "--max-batch-size", "3",
        "--max-model-len", "64", "--gpu-memory-utilization", "0.5", "--quantization", "int8", "--device", "cpu",
    ])
    got = engine_options(args)
    assert {k: got[k] for k in ("dtype", "kv_cache_memory", "max_batch_size", "max_model_len",
                                "gpu_memory_utilization", "quantization", "device")} == {
        "dtype": "bfloat16", "kv_cache_memory": 2 << 20, "max_batch_size": 3, "max_model_len": 64,
        "gpu_memory_utilization": 0.5, "quantization": "int8", "device": "cpu",
    }
    with pytest.raises(SystemExit):
        p.parse_args(["--demo", "llama", "--max-batch-size", "0"])  # type: ignore[attr-defined]


def test_the_declared_choices_are_what_the_engine_builds() -> None:
    import torch

    from rtpcore.models.layers import QUANTIZATIONS as BUILT

    assert QUANTIZATIONS == BUILT
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in DTYPES)


def test_reading_the_options_imports_no_torch() -> None:
    code = "import sys, rtpcore.engine.config, rtpcore.cli._args; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
