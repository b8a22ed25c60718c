"""``rtpcore generate``: checkpoints, demo models, output formats and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rtpcore.cli import main
from rtpcore.errors import EngineBuildError


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["generate", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "rtpcore" / "demo"


def test_demo_builds_once_and_is_deterministic(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--demo llama builds a labelled random-weight checkpoint in the user cache and answers the same twice."""
    code, out, err = run(capsys, "--demo", "llama", "--prompt", "Hello", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    first = json.loads(out)
    assert first["model_type"] == "llama" and first["demo"] is True
    assert first["prompt_ids"] == list(b"Hello")
    assert len(first["output_ids"]) == 8
    assert first["text"].isprintable() and len(first["text"]) == 8
    assert "RANDOM WEIGHTS" in err
    (built,) = cache.iterdir()
    assert built.name.startswith("llama-") and Path(first["checkpoint"]) == built
    assert "RANDOM WEIGHTS" in (built / "README.txt").read_text()
    assert json.loads((built / "config.json").read_text())["rtpcore_demo"]
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    code, out, _ = run(capsys, "--demo", "llama", "--prompt", "Hello", "--max-new-tokens", "8", "--json")
    assert code == 0 and json.loads(out) == first
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime


def test_demo_tokenizer_json_matches_the_builtin_byte_tokenizer(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With `tokenizers` installed the demo ships tokenizer.json giving the same byte ids as ByteTokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from rtpcore.testing.demo import ByteTokenizer

    assert run(capsys, "--demo", "llama", "--prompt-ids", "1", "--max-new-tokens", "1")[0] == 0
    (built,) = cache.iterdir()
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "Hello, wörld ✓"
    assert tok.encode(text).ids == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    assert tok.token_to_id("<bos>") == 256 and tok.token_to_id("<eos>") == 257


def test_checkpoint_with_prompt_ids_matches_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """generate CHECKPOINT --prompt-ids prints what Engine.generate returns (ids without a tokenizer)."""
    pytest.importorskip("transformers")
    from rtpcore import Engine
    from test_llama import make_checkpoint

    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path) as engine:
        want = engine.generate([[5, 9, 33]], max_new_tokens=6)[0]
    code, out, err = run(capsys, str(tmp_path), "--prompt-ids", "5,9,33", "--max-new-tokens", "6", "--json")
    assert code == 0, err
    assert json.loads(out)["output_ids"] == want and json.loads(out)["text"] is None
    code, out, err = run(capsys, str(tmp_path), "--prompt-ids", "5,9,33", "--max-new-tokens", "6")
    assert (code, out) == (0, " ".join(map(str, want)) + "\n")
    assert "RANDOM" not in err


def test_prompt_text_without_tokenizer_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt on a checkpoint without tokenizer.json exits 1 naming the file and the alternative."""
    (tmp_path / "config.json").write_text("{}")
    code, out, err = run(capsys, str(tmp_path), "--prompt", "Hi")
    assert code == 1 and out == ""
    assert err.startswith("rtpcore: error: --prompt needs") and "tokenizer.json" in err and "--prompt-ids" in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["ckpt", "--demo", "llama", "--prompt", "x"], "exactly one of CHECKPOINT or --demo"),
    (["--prompt", "x"], "exactly one of CHECKPOINT or --demo"),
    (["--demo", "llama"], "one of the arguments --prompt --prompt-ids is required"),
    (["--demo", "llama", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["--demo", "llama", "--prompt", "a", "--prompt-ids", "1"], "not allowed with argument"),
    (["--demo", "llama", "--prompt", "a", "--plugins", ""], "--plugins"),
])
def test_bad_usage_exits_2(cache: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    """Usage errors exit with status 2 and say what is wrong."""
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err


def test_unknown_demo_and_missing_checkpoint_exit_1(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown demo model type or a missing checkpoint is one error line and exit status 1."""
    code, _, err = run(capsys, "--demo", "nosuch", "--prompt", "x")
    assert code == 1 and err.startswith("rtpcore: error: ") and "'nosuch'" in err and "'llama'" in err
    assert err.count("\n") == 1
    code, _, err = run(capsys, str(tmp_path / "missing"), "--prompt-ids", "1")
    assert code == 1 and err.startswith("rtpcore: error: ") and err.count("\n") == 1


@pytest.mark.slow
def test_readme_demo_command_runs_in_a_fresh_process(tmp_path: Path) -> None:
    """`rtpcore generate --demo llama --prompt Hello` works from a fresh process with an empty cache."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "generate", "--demo", "llama", "--prompt", "Hello", "--max-new-tokens", "12"],
        capture_output=True, text=True, env=env, timeout=300, check=False,  # only against a hang
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.rstrip("\n")) == 12
    assert "RANDOM WEIGHTS" in proc.stderr


def test_seeded_sampling_flags_reproduce(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature/--top-k/--top-p with --seed give the same tokens twice; another seed differs."""
    argv = ["--demo", "llama", "--prompt", "Hi", "--max-new-tokens", "16", "--temperature", "1.5",
            "--top-k", "50", "--top-p", "0.95", "--json"]
    outs = [json.loads(run(capsys, *argv, "--seed", seed)[1])["output_ids"] for seed in ("1", "1", "2")]
    assert outs[0] == outs[1] != outs[2]


def test_demo_of_a_plugin_without_demo_config_is_a_clear_error(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--demo NAME for a model type whose plugin offers no demo_config() exits 1 saying so."""
    (tmp_path / "rtpcore_test_nodemo.py").write_text(
        "from rtpcore import hookimpl\n"
        "from rtpcore.models.llama import LlamaPlugin\n\n"
        "class NoDemo(LlamaPlugin):\n"
        "    model_type = 'nodemo'\n"
        "    architectures = ('NoDemoForCausalLM',)\n\n"
        "    @classmethod\n"
        "    def demo_config(cls):\n"
        "        return None\n\n"
        "@hookimpl\n"
        "def rtpcore_register_models(registry):\n"
        "    registry.register(NoDemo)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "--external-model-packages", "rtpcore_test_nodemo", "--demo", "nodemo", "--prompt", "x")
    assert code == 1
    assert "model type 'nodemo'" in err and "no demo_config()" in err


def test_a_foreign_exception_from_a_plugin_is_one_line_naming_its_type(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception that is not rtpcore's (a plugin's build_model raising RuntimeError) exits 1
    with one `rtpcore: error:` line naming its type, and --debug shows the traceback instead."""
    (tmp_path / "rtpcore_test_boom.py").write_text(
        "from rtpcore import hookimpl\n"
        "from rtpcore.models.llama import LlamaPlugin\n\n"
        "class Boom(LlamaPlugin):\n"
        "    model_type = 'boom'\n"
        "    architectures = ('BoomForCausalLM',)\n\n"
        "    @classmethod\n"
        "    def build_model(cls, config, weights, **options):\n"
        "        raise RuntimeError('kernel library missing')\n\n"
        "@hookimpl\n"
        "def rtpcore_register_models(registry):\n"
        "    registry.register(Boom)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ("--external-model-packages", "rtpcore_test_boom", "--demo", "boom", "--prompt-ids", "1")
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("rtpcore: error: building the engine for ")
    assert "failed in build_model of model type 'boom' (rtpcore_test_boom:Boom, from plugin 'rtpcore_test_boom'" \
        in lines[-1]
    assert lines[-1].endswith(": RuntimeError: kernel library missing (run with --debug for the traceback)")
    assert "Traceback" not in err
    with pytest.raises(EngineBuildError, match="kernel library missing") as excinfo:
        main(["--debug", "generate", *argv])
    assert isinstance(excinfo.value.__cause__, RuntimeError)


LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _instruct_checkpoint(path: Path) -> None:
    """The Llama test checkpoint with a real byte-level BPE tokenizer.json (BOS from its
    post-processor, as Llama 3's) and a Llama 3 chat template."""
    from test_llama import make_checkpoint
    from tokenizer_files import write_tokenizer

    make_checkpoint(path, vocab_size=512)
    write_tokenizer(path, {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    }, bos_processor=True)


def test_chat_renders_the_prompt_with_the_checkpoint_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--chat feeds the ids transformers' apply_chat_template gives (one BOS, from the template),
    generates what Engine.generate gives, and prints the tokenizer's decode of the output."""
    transformers = pytest.importorskip("transformers")
    from rtpcore import Engine

    _instruct_checkpoint(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    question = "What is the capital of France?"
    rendered = hf.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    want_prompt = hf.encode(rendered, add_special_tokens=False)
    assert want_prompt.count(hf.bos_token_id) == 1
    with Engine.from_pretrained(tmp_path) as engine:
        want = engine.generate([want_prompt], max_new_tokens=6)[0]
    code, out, err = run(capsys, str(tmp_path), "--chat", "--prompt", question, "--max-new-tokens", "6", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["chat"] is True and record["prompt_ids"] == want_prompt
    assert record["output_ids"] == want and record["text"] == hf.decode(want, skip_special_tokens=True)
    code, out, err = run(capsys, str(tmp_path), "--prompt", question, "--max-new-tokens", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_ids"] == hf.encode(question)  # without --chat: the plain text, BOS added


def test_demo_chat_uses_the_demo_template(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo checkpoint ships tokenizer_config.json with a chat template; --chat renders with it."""
    code, out, err = run(capsys, "--demo", "llama", "--chat", "--prompt", "Hi", "--max-new-tokens", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_ids"] == list(b"<|user|>\nHi\n<|assistant|>\n")
    (built,) = cache.iterdir()
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<bos>" and config["eos_token"] == "<eos>" and "chat_template" in config


def test_chat_without_a_template_or_with_prompt_ids_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--chat on a checkpoint without a chat template exits 1 naming it; with --prompt-ids it is a usage error."""
    from tokenizer_files import write_tokenizer

    write_tokenizer(tmp_path, {"eos_token": "<|eot_id|>"})
    (tmp_path / "config.json").write_text("{}")
    code, out, err = run(capsys, str(tmp_path), "--chat", "--prompt", "Hi")
    assert code == 1 and out == ""
    assert "has no chat template" in err and str(tmp_path) in err and err.count("\n") == 1
    code, _, err = run(capsys, str(tmp_path), "--chat", "--prompt-ids", "1,2")
    assert code == 2 and "--chat" in err


def test_num_speculative_tokens_needs_a_draft_model(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    code, _, err = run(capsys, "--demo", "llama", "--num-speculative-tokens", "2", "--prompt-ids", "1,2")
    assert code == 2 and "--num-speculative-tokens needs --draft-model" in err
    code, _, err = run(capsys, "--demo", "llama", "--draft-model", "mtp", "--num-speculative-tokens", "0",
                       "--prompt-ids", "1,2")
    assert code == 2 and "--num-speculative-tokens" in err and "positive integer" in err


def test_generate_with_a_draft_checkpoint_gives_the_same_tokens(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    args = ["--demo", "llama", "--prompt-ids", "256,72,105", "--max-new-tokens", "6", "--json"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    plain = json.loads(out)
    code, out, _ = run(capsys, *args, "--draft-model", plain["checkpoint"], "--num-speculative-tokens", "3")
    assert code == 0
    spec = json.loads(out)
    assert spec["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 6
    assert spec["speculative"]["proposed"] == spec["speculative"]["accepted"] > 0
    code, _, err = run(capsys, "--demo", "llama", "--prompt-ids", "1", "--draft-model", "mtp")
    assert code == 1 and "offers no multi-token-prediction draft" in err


def test_no_async_scheduling_reaches_the_engine(capsys: pytest.CaptureFixture[str], cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-async-scheduling is async_scheduling=False; without it the engine decides (None)."""
    from rtpcore import Engine

    seen: list[Any] = []
    real = Engine.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, path: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("async_scheduling", "missing"))
        return real(cls, path, **kwargs)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    for flags in (["--no-async-scheduling"], []):
        code, out, _ = run(capsys, "--demo", "llama", *flags, "--prompt-ids", "256,72", "--max-new-tokens", "2", "--json")
        assert code == 0 and len(json.loads(out)["output_ids"]) == 2
    assert seen == [False, None]


def test_no_cuda_graphs_is_accepted_on_the_cpu(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    code, out, _ = run(capsys, "--demo", "llama", "--no-cuda-graphs", "--prompt-ids", "256,72", "--max-new-tokens", "2",
                       "--json")
    assert code == 0 and len(json.loads(out)["output_ids"]) == 2
