"""Start-up: a model that cannot run fails the engine's build, naming its plugin and
distribution, before any request reaches it (the warm-up forward, rtpcore.engine.worker.rank).

The plugins are real distributions (``*.dist-info`` on a temporary site folder); the models
are real torch modules over real safetensors files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rtpcore import Engine
from rtpcore.errors import EngineBuildError

VOCAB, DIM = 32, 16

# A one-matrix model: logits = embed[ids] @ head.T. It declares no weight_shapes, so the loader
# cannot know that head.weight must be (VOCAB, DIM); the forward finds out.
TOY = '''
import torch
from rtpcore import ModelPlugin, hookimpl
from rtpcore_native import KVCacheSpecDesc


class Toy(ModelPlugin):
    model_type = "toy"
    architectures = ("ToyForCausalLM",)
    forward_contract = 2

    @classmethod
    def config_from_hf(cls, hf_config):
        return dict(hf_config)

    @classmethod
    def weight_patterns(cls, config):
        return ["embed.weight", "head.weight"]

    @classmethod
    def kv_cache_descs(cls, config, *, kv_cache_dtype="fp32", tokens_per_block=16, **options):
        return [KVCacheSpecDesc(tag="layers.0", kind="mha", dtype=kv_cache_dtype, num_kv_heads=1,
                                head_dim=8, tokens_per_block=tokens_per_block)]

    @classmethod
    def build_model(cls, config, weights, **options):
        BUILD
        return ToyModel(weights["embed.weight"], weights["head.weight"])


class ToyModel(torch.nn.Module):
    def __init__(self, embed, head):
        super().__init__()
        self.embed, self.head = embed, head

    def forward(self, batch, kv_caches):
        x = self.embed[batch.input_ids]
        if batch.logits_index is not None:
            x = x[batch.logits_index]
        return x @ self.head.T


@hookimpl
def rtpcore_register_models(registry):
    registry.register(Toy)
'''


def toy_dist(plugin_env, build: str = "pass") -> None:
    """Install the toy model as distribution ``toy-models`` 2.1, plugin ``toy``."""
    plugin_env.add_dist(
        "toy-models", "2.1",
        plugins={"toy": "toy_plugin.model"},
        architectures={"ToyForCausalLM": "toy"},
        modules={"toy_plugin/model.py": TOY.replace("BUILD", build)},
    )


def toy_checkpoint(path: Path, head_dim: int = DIM) -> Path:
    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file(
        {"embed.weight": torch.randn(VOCAB, DIM, generator=gen),
         "head.weight": torch.randn(VOCAB, head_dim, generator=gen)},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["ToyForCausalLM"], "vocab_size": VOCAB, "max_position_embeddings": 64}
    ))
    return path


def test_the_toy_model_runs(plugin_env, tmp_path):
    """The control: with the right shapes the same plugin builds and generates."""
    toy_dist(plugin_env)
    with Engine.from_pretrained(str(toy_checkpoint(tmp_path / "ok")), plugins=["toy"]) as engine:
        assert engine.warm_up_seconds > 0
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=4)[0]) == 4


def test_a_tensor_of_the_wrong_shape_fails_the_build_naming_the_distribution(plugin_env, tmp_path):
    toy_dist(plugin_env)
    ckpt = toy_checkpoint(tmp_path / "bad", head_dim=DIM - 4)
    with pytest.raises(EngineBuildError) as err:
        Engine.from_pretrained(str(ckpt), plugins=["toy"])
    message = str(err.value)
    assert "warm-up forward" in message and "model type 'toy'" in message
    assert "toy-models 2.1" in message and "toy_plugin.model:Toy" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    assert "weight_shapes" in message  # what to change
    assert (err.value.plugin, err.value.distribution, err.value.stage) == ("toy", "toy-models", "warm-up")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_missing_import_in_build_model_names_the_distribution_and_the_module(plugin_env, tmp_path):
    toy_dist(plugin_env, build="import fancy_kernels  # noqa")
    with pytest.raises(EngineBuildError) as err:
        Engine.from_pretrained(str(toy_checkpoint(tmp_path / "ckpt")), plugins=["toy"])
    message = str(err.value)
    assert "build_model of model type 'toy'" in message
    assert "toy-models 2.1" in message
    assert "No module named 'fancy_kernels'" in message
    assert "declare it in toy-models's dependencies" in message
    assert (err.value.distribution, err.value.stage) == ("toy-models", "build_model")


def test_a_forward_that_returns_a_row_per_token_fails_the_build(plugin_env, tmp_path):
    """The forward contract returns one row per sequence; a model that returns every token's
    logits would hand the sampler the wrong rows."""
    toy_dist(plugin_env)
    source = plugin_env.site / "toy_plugin" / "model.py"
    source.write_text(source.read_text().replace("x = x[batch.logits_index]", "pass"))
    with pytest.raises(EngineBuildError) as err:
        Engine.from_pretrained(str(toy_checkpoint(tmp_path / "ckpt")), plugins=["toy"])
    assert "returned (3, 32) for a prefill step of 1 sequence of 3 tokens" in str(err.value)
    assert "toy-models 2.1" in str(err.value)


def test_serve_refuses_to_start_on_a_tensor_of_the_wrong_shape(plugin_env, tmp_path):
    """The server's start-up builds the engine, warm-up included: it exits naming the
    distribution instead of reporting healthy and failing every request."""
    toy_dist(plugin_env)
    ckpt = toy_checkpoint(tmp_path / "bad", head_dim=DIM - 4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_env.site), os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as sock:  # a port nothing listens on: the server must not get to bind it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "serve", str(ckpt), "--plugins", "toy", "--port", str(port)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "toy-models 2.1" in proc.stderr and "warm-up forward" in proc.stderr, proc.stderr
    assert "Uvicorn running" not in proc.stderr


# -- serving a checkpoint without a tokenizer ---------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_serve's tiny Llama with a tokenizer."""
    from test_llama import make_checkpoint
    from test_serve import write_tokenizer

    path = tmp_path_factory.mktemp("served")
    make_checkpoint(path, vocab_size=write_tokenizer(path))
    return path


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of the engine tests, without tokenizer.json (what a new architecture's
    author has before building a tokenizer)."""
    from test_llama import make_checkpoint

    path = tmp_path_factory.mktemp("bare")
    make_checkpoint(path)
    assert not (path / "tokenizer.json").exists()
    return path


@pytest.mark.parametrize("flag", [False, True])
def test_serve_without_a_tokenizer_answers_token_ids_and_refuses_text(bare_checkpoint, checkpoint, flag):
    """A checkpoint without tokenizer.json is served (a warning says so), as one with a tokenizer
    is under --skip-tokenizer-init: token-id prompts give Engine.generate's tokens, whatever
    needs text is a 400 naming the field and why there is no tokenizer."""
    from test_serve import Server

    served = checkpoint if flag else bare_checkpoint
    with Engine.from_pretrained(str(served)) as engine:
        expected = engine.generate([[5, 9, 33, 7]], max_new_tokens=6)[0]
    server = Server(served, *(["--skip-tokenizer-init"] if flag else []))
    why = "--skip-tokenizer-init" if flag else "has no tokenizer"
    try:
        base = {"model": "tiny", "max_tokens": 6, "temperature": 0}
        whole = httpx.post(server.url + "/v1/completions", json={**base, "prompt": [5, 9, 33, 7]}, timeout=120)
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        assert choice["token_ids"] == expected and choice["text"] == ""
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={**base, "prompt": [5, 9, 33, 7], "stream": True}) as stream:
            streamed = [tok for line in stream.iter_lines() if line.startswith("data: {")
                        for tok in json.loads(line[6:])["choices"][0].get("token_ids", [])]
        assert streamed == expected
        refusals = [
            ("/v1/completions", {**base, "prompt": "Hello"}, "prompt"),
            ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}]}, "messages"),
            ("/v1/completions", {**base, "prompt": [1, 2], "stop": ["x"]}, "stop"),
            ("/v1/completions", {**base, "prompt": [1, 2], "logprobs": 2}, "logprobs"),
            ("/v1/completions", {**base, "prompt": [1, 2], "response_format": {"type": "json_object"}},
             "response_format"),
        ]
        for path, body, param in refusals:
            answer = httpx.post(server.url + path, json=body, timeout=60)
            assert answer.status_code == 400, (param, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and why in error["message"], error
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # the refusals cost nothing
    finally:
        code, out = server.stop()
    assert code == 0, out
    assert ("serving token ids only" in out) is not flag  # the warning, for a checkpoint without one


# -- tensor parallelism from scripts and the command line ----------------------------------------

SCRIPT = """
import json
from rtpcore import Engine
from rtpcore.testing import demo_checkpoint

def run():
    with Engine.from_pretrained(demo_checkpoint("llama"), tensor_parallel_size=2) as engine:
        print(json.dumps(engine.generate([[1, 2, 3]], max_new_tokens=6)[0]))
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_a_main_guard_is_named(tmp_path, guarded):
    """Spawned ranks import the main script again: unguarded, its top level would build another
    engine in each rank. The error names the script and the guard; guarded, the script runs."""
    script = tmp_path / "build_tp.py"
    script.write_text(SCRIPT + ('if __name__ == "__main__":\n    run()\n' if guarded else "run()\n"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if guarded:
        assert proc.returncode == 0, proc.stderr
        with Engine.from_pretrained(_demo("llama")) as engine:
            assert json.loads(proc.stdout) == engine.generate([[1, 2, 3]], max_new_tokens=6)[0]
        return
    assert proc.returncode == 1
    assert "WorkerError: tensor-parallel rank 1 exited at start" in proc.stderr, proc.stderr
    assert repr(str(script)) in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr


def _demo(model_type: str) -> str:
    from rtpcore.testing import demo_checkpoint

    return str(demo_checkpoint(model_type))


@pytest.mark.parametrize("demo", ["llama", "deepseek_v3"])
def test_generate_tensor_parallel_size_2_gives_the_tokens_of_1(demo):
    def generate(*extra: str) -> list[int]:
        plugins = ["--plugins", "atom-plugin"] if demo == "deepseek_v3" else []
        proc = subprocess.run(
            [sys.executable, "-m", "rtpcore", "generate", "--demo", demo, *plugins, "--prompt-ids", "1,2,3,4",
             "--max-new-tokens", "8", "--json", *extra],
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        return list(json.loads(proc.stdout)["output_ids"])

    one = generate()
    assert len(one) == 8
    assert generate("--tensor-parallel-size", "2") == one
