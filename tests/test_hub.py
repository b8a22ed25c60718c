"""Hub ids (``org/name[@revision]``) as checkpoints, against the fake Hub of ``fake_hub``:
the files requested are exactly the shards a model reads plus config and tokenizer files,
offline runs come from the cache, revisions pick their files, and failures are one
CheckpointError naming what went wrong."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

from fake_hub import FakeHub, hub_environment  # noqa: E402
from rtpcore import Engine  # noqa: E402
from rtpcore.checkpoint.hub import HubId, hub_id, resolve_checkpoint  # noqa: E402
from rtpcore.errors import CheckpointError, UnknownArchitectureError  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from tokenizer_files import write_tokenizer  # noqa: E402

PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 6
INDEX = "model.safetensors.index.json"
EXTRAS = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]  # what the llama repos hold


# --- the repositories, written once -------------------------------------------------------------


def _llama(path: Path, seed: int) -> Path:
    """A 3-layer Llama over the 420-token BPE of tokenizer_files, sharded by transformers so that
    its layers land in different shards."""
    model = make_checkpoint(path.with_name(path.name + "-single"), vocab_size=420, num_hidden_layers=3, seed=seed)
    model.save_pretrained(path, max_shard_size="150KB")
    write_tokenizer(path, {"tokenizer_class": "PreTrainedTokenizerFast"})
    return path


def _weight_map(folder: Path) -> dict[str, str]:
    return dict(json.loads((folder / INDEX).read_text())["weight_map"])


def _deepseek(path: Path, demo: Path) -> Path:
    """atom-plugin's DeepSeek-V3 demo, sharded by hand: the embeddings, head and layer 0 in
    model-a; the other decoder layers in model-b; the MTP layer (the one after them) alone."""
    from safetensors.torch import load_file, save_file

    path.mkdir()
    for f in demo.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    layers = json.loads((demo / "config.json").read_text())["num_hidden_layers"]
    shards: dict[str, dict[str, Any]] = {}
    for name, t in load_file(str(demo / "model.safetensors")).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        file = "model-a" if layer == 0 else "model-b" if layer < layers else "model-mtp"
        shards.setdefault(f"{file}.safetensors", {})[name] = t
    weight_map = {}
    for file, part in shards.items():
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repos")
    tiny = _llama(root / "tiny", seed=0)
    v2 = _llama(root / "tiny-v2", seed=1)
    draft = root / "tiny-draft"  # the same shards; config.json asks for the first layer only
    shutil.copytree(tiny, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    nothing = root / "no-weights"  # a repository without safetensors
    nothing.mkdir()
    shutil.copy(tiny / "config.json", nothing / "config.json")
    (nothing / "pytorch_model.bin").write_bytes(b"\0")
    alien = root / "alien"  # an architecture no plugin serves
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({**config, "architectures": ["AlienForCausalLM"]}))
    shutil.copy(tiny / INDEX, alien / INDEX)
    return {"tiny": tiny, "tiny-v2": v2, "tiny-draft": draft, "no-weights": nothing, "alien": alien}


@pytest.fixture(scope="module")
def reference(repos: dict[str, Path]) -> list[list[int]]:
    """Greedy output of the local folder of org/tiny."""
    return generate(repos["tiny"])


def generate(path: str | Path, **options: Any) -> list[list[int]]:
    with Engine.from_pretrained(path, max_batch_size=4, **options) as engine:
        return engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])


@pytest.fixture
def hub(repos: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub() as server:
        for name, folder in repos.items():
            if name != "tiny-v2":
                server.add(f"org/{name}", folder)
        server.add("org/tiny", repos["tiny-v2"], revision="v2")
        server.add("org/private", repos["tiny"], token="hf_secret")
        yield server


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "hf-home"


@pytest.fixture
def online(hub: FakeHub, home: Path) -> Iterator[Path]:
    """huggingface_hub pointed at the fake Hub, its cache under a fresh HF_HOME."""
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)):
        yield home


def shards(files: list[str]) -> set[str]:
    return {f for f in files if f.endswith(".safetensors")}


# --- what counts as a Hub id ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/name", HubId("org/name")),
        ("meta-llama/Llama-3.1-8B", HubId("meta-llama/Llama-3.1-8B")),
        ("org/name@v2", HubId("org/name", "v2")),
        ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        ("name", None),
        ("a/b/c", None),
        ("./ckpt", None),
        ("../ckpt", None),
        ("/abs/ckpt", None),
        ("org/", None),
        ("org/name@", None),
    ],
)
def test_a_hub_id_is_org_slash_name_with_an_optional_revision(text: str, expected: HubId | None) -> None:
    assert hub_id(text) == expected


def test_a_local_folder_always_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing path of the id's form is a folder, and a Path is never an id: nothing is asked of the Hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_id("org/name") is None and hub_id(Path("org/other")) is None
    assert resolve_checkpoint("org/name") == "org/name"


# --- pruned downloads -------------------------------------------------------------------------------


def test_full_model_fetches_every_shard_it_reads_and_the_tokenizer(
    hub: FakeHub, online: Path, repos: dict[str, Path], reference: list[list[int]]
) -> None:
    """Config first, then the index, the shards holding the model's tensors (all of them for the
    whole model) and the tokenizer files the repository has; greedy output equals the folder's,
    and the engine's config carries the snapshot folder (what tensor-parallel ranks receive)."""
    with Engine.from_pretrained("org/tiny", max_batch_size=4) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        checkpoint = Path(engine.config.checkpoint)
    assert out == reference
    every_shard = set(_weight_map(repos["tiny"]).values())
    assert len(every_shard) > 2
    fetched = hub.downloads("org/tiny")
    assert fetched[:2] == ["config.json", INDEX]
    assert sorted(fetched) == sorted(["config.json", INDEX, *every_shard, *EXTRAS])
    assert checkpoint.is_relative_to(online / "hub") and checkpoint.parent.name == "snapshots"
    api = {r.filename for r in hub.requests if r.repo_id is not None}
    assert api == {*fetched, "special_tokens_map.json", "chat_template.jinja"}  # absent ones: a 404 each


@pytest.mark.slow
def test_tensor_parallel_ranks_get_the_snapshot_folder(hub: FakeHub, online: Path, reference: list[list[int]]) -> None:
    """The leader resolves the id once; the spawned rank reads the same snapshot and asks the Hub nothing."""
    assert generate("org/tiny", tensor_parallel_size=2, device="cpu") == reference
    assert [r.method for r in hub.requests if r.filename == "config.json"] == ["HEAD", "GET"]


def test_one_layer_draft_fetches_only_the_shards_of_its_layer(
    hub: FakeHub, online: Path, repos: dict[str, Path], reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """A draft whose config.json has one layer, over shards holding three, fetches the shards of
    layer 0, the embeddings and the head -- not the others -- and keeps the greedy output; the
    shards left on the Hub are no stale index entries to warn about."""
    with caplog.at_level(logging.WARNING, logger="rtpcore"):
        out = generate("org/tiny", draft_model="org/tiny-draft", num_speculative_tokens=2)
    assert out == reference
    assert not [r for r in caplog.records if r.name.startswith("rtpcore.checkpoint")]
    weight_map = _weight_map(repos["tiny-draft"])
    needed = {f for name, f in weight_map.items() if not name.startswith(("model.layers.1.", "model.layers.2."))}
    assert needed < set(weight_map.values())  # the fixture's shards split the layers
    assert shards(hub.downloads("org/tiny-draft")) == needed


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("atom_plugin")
    from rtpcore.testing import demo_checkpoint

    demo = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"], cache_dir=tmp_path_factory.mktemp("demo"))
    return _deepseek(tmp_path_factory.mktemp("deepseek") / "repo", demo)


def test_mtp_draft_fetches_only_the_mtp_shard(deepseek: Path, hub: FakeHub, home: Path) -> None:
    """The target alone leaves the MTP layer's shard on the Hub; draft_model="mtp" then fetches
    that one shard and nothing else of the model, and keeps the greedy output."""
    hub.add("org/deepseek", deepseek)
    options = {"plugins": ("atom-plugin",), "tokens_per_block": 4}
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)):
        plain = generate("org/deepseek", **options)
        assert shards(hub.downloads()) == {"model-a.safetensors", "model-b.safetensors"}
        hub.clear()
        out = generate("org/deepseek", draft_model="mtp", num_speculative_tokens=2, **options)
    assert out == plain == generate(deepseek, **options)
    assert hub.downloads() == ["model-mtp.safetensors"]


def test_an_unknown_architecture_fails_before_any_weight_is_fetched(hub: FakeHub, online: Path) -> None:
    """The plugins decide from config.json alone: an architecture none serves fetches nothing more."""
    with pytest.raises(UnknownArchitectureError, match="AlienForCausalLM"):
        Engine.from_pretrained("org/alien")
    assert hub.downloads() == ["config.json"]


def test_kv_spec_reads_config_json_only(hub: FakeHub, online: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rtpcore kv-spec org/name` fetches config.json and nothing else."""
    from rtpcore.cli import main

    assert main(["kv-spec", "org/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "llama"
    assert hub.downloads() == ["config.json"]


# --- offline, revisions, tokens -----------------------------------------------------------------------


def test_offline_resolution_comes_from_the_cache(
    hub: FakeHub, home: Path, reference: list[list[int]]
) -> None:
    """With HF_HUB_OFFLINE=1 a cached id loads with the Hub gone; an uncached one is a
    CheckpointError that names the offline mode and the cache."""
    url, main = hub.url, hub.repos["org/tiny"]["main"].commit
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home)):
        generate("org/tiny")  # fills the cache
    hub.stop()
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_OFFLINE="1"):
        with Engine.from_pretrained("org/tiny", max_batch_size=4) as engine:
            assert Path(engine.config.checkpoint).name == main
            assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]) == reference
        with pytest.raises(CheckpointError) as excinfo:
            Engine.from_pretrained("org/tiny@v2")
    message = str(excinfo.value)
    assert "'org/tiny@v2' is neither a local folder" in message
    assert "HF_HUB_OFFLINE is set" in message and str(home / "hub") in message


def test_offline_a_shard_the_cache_lacks_is_named(hub: FakeHub, home: Path, repos: dict[str, Path]) -> None:
    """Offline, a shard the model needs and the cache lacks is a CheckpointError naming it; nothing is requested."""
    from rtpcore.checkpoint.request import WeightRequest

    wanted = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    weight_map = _weight_map(repos["tiny"])
    assert weight_map[wanted["embed"]] != weight_map[wanted["head"]]
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)):
        resolve_checkpoint("org/tiny", weights=lambda hf: [WeightRequest([wanted["embed"]])])
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="1"):
        hub.clear()
        with pytest.raises(CheckpointError) as excinfo:
            resolve_checkpoint("org/tiny", weights=lambda hf: [WeightRequest([wanted["head"]])])
    commit = hub.repos["org/tiny"]["main"].commit
    assert str(excinfo.value) == (
        f"Hugging Face Hub model org/tiny (commit {commit}): cannot fetch {weight_map[wanted['head']]!r}: "
        f"HF_HUB_OFFLINE is set and the cache {str(home / 'hub')!r} holds no {weight_map[wanted['head']]!r} "
        "of this revision"
    )
    assert not [r for r in hub.requests if r.repo_id is not None]


def resolve(ref: str, draft: str | None = None) -> tuple[str, str | None]:
    """What EngineConfig.create does with a checkpoint and a draft, without building an engine."""
    from rtpcore.checkpoint.resolve import resolve_checkpoints
    from rtpcore.plugins.allowlist import Allowlist

    return resolve_checkpoints(ref, draft, plan=Allowlist.from_cli([], []).resolve())


def test_a_revision_picks_that_revisions_files(hub: FakeHub, online: Path, repos: dict[str, Path]) -> None:
    """org/name@v2 resolves v2 to its commit once and fetches that commit's files, into its own snapshot."""
    main, _ = resolve("org/tiny")
    v2, _ = resolve("org/tiny@v2")
    assert Path(main).name == hub.repos["org/tiny"]["main"].commit
    assert Path(v2).name == hub.repos["org/tiny"]["v2"].commit
    for f in ["config.json", INDEX, *set(_weight_map(repos["tiny-v2"]).values())]:
        assert (Path(v2) / f).read_bytes() == (repos["tiny-v2"] / f).read_bytes()
    asked = [r.revision for r in hub.requests if r.filename == "config.json" and r.method == "HEAD"]
    assert asked == ["main", "v2"]  # every later file by the commit config.json came from
    assert {r.revision for r in hub.requests if r.filename == INDEX} == {Path(main).name, Path(v2).name}


def test_a_private_repository_is_fetched_with_hf_token(hub: FakeHub, repos: dict[str, Path], home: Path) -> None:
    """Without HF_TOKEN a private repository is refused, naming the token; with it every request carries it."""
    denied = pytest.raises(CheckpointError, match=r"private and HF_TOKEN grants no access \(HTTP 401")
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)), denied:
        resolve("org/private")
    hub.clear()
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_TOKEN="hf_secret"):
        folder, _ = resolve("org/private")
    assert (Path(folder) / "config.json").read_bytes() == (repos["tiny"] / "config.json").read_bytes()
    file_requests = [r for r in hub.requests if r.repo_id is not None]
    assert file_requests and {r.authorization for r in file_requests} == {"Bearer hf_secret"}


# --- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "answer"),
    [
        ("org/missing", "no such model repository, or it is private and HF_TOKEN grants no access (HTTP 404: Repository not found)"),
        ("org/tiny@nope", "the repository has no such revision (HTTP 404: Invalid rev id: nope)"),
    ],
)
def test_an_id_neither_a_folder_nor_on_the_hub_names_both_readings(
    hub: FakeHub, online: Path, ref: str, answer: str
) -> None:
    """One CheckpointError: the folder it is not, the Hub it asked and the Hub's answer."""
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(ref)
    assert excinfo.value.path == ref
    assert str(excinfo.value) == (
        f"checkpoint {ref!r} is neither a local folder (no such path: {os.path.abspath(ref)!r}) "
        f"nor a model on the Hugging Face Hub ({hub.url}): {ref}: {answer}"
    )
    assert excinfo.value.__cause__ is not None  # the library's exception, for --debug


def test_a_repository_without_safetensors_names_what_was_looked_for(hub: FakeHub, online: Path) -> None:
    """A repository with neither an index nor model.safetensors is an error naming both and the commit."""
    with pytest.raises(CheckpointError) as excinfo:
        resolve("org/no-weights")
    commit = hub.repos["org/no-weights"]["main"].commit
    assert str(excinfo.value) == (
        f"Hugging Face Hub model org/no-weights (commit {commit}): it has neither {INDEX!r} nor "
        "'model.safetensors' (only safetensors checkpoints are supported, or a GGUF file named by gguf_file)"
    )


# --- the command line -----------------------------------------------------------------------------------


def rtpcore(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The rtpcore this interpreter imports (installed, or PYTHONPATH as the caller set it): a
    # source tree's rtpcore_native has no built extension.
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return subprocess.run(
        [sys.executable, "-m", "rtpcore", *argv], env={**variables, **env},
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
def test_generate_takes_a_hub_id(hub: FakeHub, home: Path, repos: dict[str, Path]) -> None:
    """`rtpcore generate org/name` in a fresh process (HF_ENDPOINT and HF_HOME from its
    environment) tokenizes with the fetched tokenizer and answers as the local folder does."""
    from rtpcore.engine.text.tokenizer import Tokenizer

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home)}
    done = rtpcore("generate", "org/tiny", "--prompt", "Hello world", "--max-new-tokens", "5", "--json", env=env)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    ids = list(Tokenizer.from_pretrained(repos["tiny"]).encode("Hello world"))
    assert record["prompt_ids"] == ids
    with Engine.from_pretrained(repos["tiny"], max_batch_size=1) as engine:
        assert record["output_ids"] == engine.generate([ids], max_new_tokens=5)[0]
    assert Path(record["checkpoint"]).name == hub.repos["org/tiny"]["main"].commit
    assert set(hub.downloads()) == {"config.json", INDEX, *_weight_map(repos["tiny"]).values(), *EXTRAS}

    done = rtpcore("generate", "org/missing", "--prompt-ids", "1", env=env)
    assert done.returncode == 1
    assert done.stderr.startswith("rtpcore: error: checkpoint 'org/missing' is neither a local folder")
    assert "Traceback" not in done.stderr


def test_served_model_name_of_a_hub_id_is_the_repository(tmp_path: Path) -> None:
    """`rtpcore serve org/name@rev` serves the model as "org/name", not as its snapshot folder's commit."""
    from rtpcore.cli._args import checkpoint_name

    args = argparse.Namespace(demo=None, checkpoint="org/tiny@v2")
    assert checkpoint_name(args, tmp_path / "snapshots" / "abc") == "org/tiny"
    args = argparse.Namespace(demo=None, checkpoint=str(tmp_path))
    assert checkpoint_name(args, tmp_path) == tmp_path.name
