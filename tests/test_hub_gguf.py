"""GGUF checkpoints on the Hub (docs/design.md §20), against the fake Hub of ``fake_hub``: a Hub
id with ``gguf_file`` fetches that file alone (every part of a split set) and generates as the
local file; a repository of one GGUF model and no config.json needs no name; a folder holding
several .gguf files selects one; failures are one CheckpointError naming the id or folder, the
file and why."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from fake_hub import FakeHub, hub_environment
from gguf_files import write_gguf
from rtpcore import Engine
from rtpcore.checkpoint.hub import resolve_checkpoint
from rtpcore.errors import CheckpointError
from test_hub import rtpcore
from test_llama import make_checkpoint
from tokenizer_files import byte_bpe

PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 6
Q8, F32 = "tiny-Q8_0.gguf", "tiny-F32.gguf"
SPLIT = [f"tiny-F16-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
MODELS = f"tiny-F16-00001-of-00003.gguf (3 parts), {F32}, {Q8}"  # as the errors list them


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"many": two GGUF files and a three-part split set of one tiny Llama, a README, no
    config.json (as most GGUF repositories); "one": a single GGUF file."""
    root = tmp_path_factory.mktemp("gguf-repos")
    make_checkpoint(root / "st", vocab_size=420)
    options: dict[str, Any] = {"tokenizer": byte_bpe(), "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}
    many = root / "many"
    many.mkdir()
    write_gguf(root / "st", many / Q8, file_type="Q8_0", **options)
    write_gguf(root / "st", many / F32, file_type="F32", **options)
    first = write_gguf(root / "st", many / "tiny-F16.gguf", file_type="F16", split_max_tensors=8, **options)
    assert sorted(p.name for p in many.glob("tiny-F16-*")) == SPLIT and first.name == SPLIT[0]
    (many / "README.md").write_text("# tiny GGUF\n")
    one = root / "one"
    one.mkdir()
    (one / Q8).write_bytes((many / Q8).read_bytes())
    configured = root / "configured"  # the original config.json beside the GGUF files, no safetensors
    shutil.copytree(many, configured)
    shutil.copy(root / "st" / "config.json", configured / "config.json")
    return {"many": many, "one": one, "configured": configured}


def generate(path: str | Path, **options: Any) -> list[list[int]]:
    with Engine.from_pretrained(path, max_batch_size=4, **options) as engine:
        return engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])


@pytest.fixture(scope="module")
def local(repos: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy output of the local Q8_0 file and of the local split set."""
    return {"q8": generate(repos["many"] / Q8), "split": generate(repos["many"] / SPLIT[0])}


@pytest.fixture
def hub(repos: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub() as server:
        for name, folder in repos.items():
            server.add(f"org/{name}", folder)
        yield server


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "hf-home"


@pytest.fixture
def online(hub: FakeHub, home: Path) -> Iterator[Path]:
    with hub_environment(HF_ENDPOINT=hub.url, HF_HOME=str(home)):
        yield home


def asked(hub: FakeHub) -> set[str | None]:
    """Every file of a repository the Hub was asked about (HEAD or GET)."""
    return {r.filename for r in hub.requests if r.repo_id is not None and r.filename is not None}


# --- a Hub id with gguf_file ---------------------------------------------------------------------


def test_gguf_file_fetches_that_file_alone_and_generates_as_the_local_file(
    hub: FakeHub, online: Path, local: dict[str, list[list[int]]]
) -> None:
    """Only the named file is asked of the Hub (no config.json, no listing, no other GGUF file);
    the greedy tokens are the local file's, and the engine's config carries the file's path in
    the Hub cache to every rank (picklable)."""
    with Engine.from_pretrained("org/many", max_batch_size=4, gguf_file=Q8) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        config = engine.config
    assert out == local["q8"]
    assert hub.downloads("org/many") == [Q8]
    assert asked(hub) == {Q8} and hub.listings() == []
    checkpoint = Path(config.checkpoint)
    assert checkpoint.name == Q8 and checkpoint.parent.name == hub.repos["org/many"]["main"].commit
    assert checkpoint.is_relative_to(online / "hub")
    assert config.gguf_file == Q8
    assert pickle.loads(pickle.dumps(config)).checkpoint == str(checkpoint)


def test_a_split_set_named_by_any_part_fetches_every_part(
    hub: FakeHub, online: Path, local: dict[str, list[list[int]]]
) -> None:
    """The second part's name fetches it first (it pins the commit), then the others; the
    checkpoint is the first part's path and generates as the local set."""
    with Engine.from_pretrained("org/many", max_batch_size=4, gguf_file=SPLIT[1]) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        checkpoint = Path(engine.config.checkpoint)
    assert out == local["split"]
    assert hub.downloads("org/many") == [SPLIT[1], SPLIT[0], SPLIT[2]]
    assert asked(hub) == set(SPLIT)
    assert checkpoint.name == SPLIT[0]
    commit = hub.repos["org/many"]["main"].commit
    assert {r.revision for r in hub.requests if r.filename in (SPLIT[0], SPLIT[2])} == {commit}


def test_a_name_the_repository_lacks_lists_its_gguf_files(hub: FakeHub, online: Path) -> None:
    """A CheckpointError naming the id, the file and the revision, and the GGUF models the
    repository's file list holds (a split set once, by its first part); nothing is downloaded."""
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained("org/many", gguf_file="tiny-Q4_K_M.gguf")
    assert str(excinfo.value) == (
        "Hugging Face Hub model org/many: the repository has no file 'tiny-Q4_K_M.gguf' at revision 'main' "
        f"(gguf_file); its GGUF files: {MODELS}"
    )
    assert excinfo.value.path == "org/many"
    assert hub.downloads() == [] and hub.listings("org/many") == ["main"]


def test_a_missing_repository_names_both_readings(hub: FakeHub, online: Path) -> None:
    """An id the Hub does not know is the usual error: neither a folder nor a Hub model."""
    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint("org/missing", gguf_file=Q8)
    assert str(excinfo.value).startswith("checkpoint 'org/missing' is neither a local folder")
    assert "no such model repository" in str(excinfo.value)


def test_offline_a_cached_file_loads_and_an_uncached_one_is_named(
    hub: FakeHub, home: Path, local: dict[str, list[list[int]]]
) -> None:
    """With HF_HUB_OFFLINE=1 and the Hub gone, the cached GGUF file loads and generates as
    before; another file of the repository, never fetched, is a CheckpointError naming it and
    the offline mode."""
    url = hub.url
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home)):
        resolve_checkpoint("org/many", gguf_file=Q8)
    hub.stop()
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_OFFLINE="1"):
        assert generate("org/many", gguf_file=Q8) == local["q8"]
        with pytest.raises(CheckpointError) as excinfo:
            Engine.from_pretrained("org/many", gguf_file=F32)
    message = str(excinfo.value)
    assert message.startswith("checkpoint 'org/many' is neither a local folder")
    assert f"HF_HUB_OFFLINE is set and the cache {str(home / 'hub')!r} holds no {F32!r}" in message


# --- a Hub id without gguf_file ---------------------------------------------------------------------


def test_a_repository_of_one_gguf_model_and_no_config_needs_no_name(
    hub: FakeHub, home: Path, local: dict[str, list[list[int]]]
) -> None:
    """config.json is missing, the file list holds one GGUF model: that file is fetched, and
    nothing else; offline, the cached snapshot's files stand for the list."""
    url = hub.url
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home)):
        assert generate("org/one") == local["q8"]
    assert hub.downloads("org/one") == [Q8]
    assert asked(hub) == {"config.json", Q8} and hub.listings("org/one") == ["main"]
    hub.stop()
    with hub_environment(HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_OFFLINE="1"):
        assert Path(resolve_checkpoint("org/one")).name == Q8


def test_several_gguf_models_and_no_config_ask_for_a_name(hub: FakeHub, online: Path) -> None:
    """A CheckpointError listing the models and naming --gguf-file; nothing is downloaded."""
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained("org/many")
    assert str(excinfo.value) == (
        f"Hugging Face Hub model org/many: it has no 'config.json' but 3 GGUF models ({MODELS}); "
        "pass one as --gguf-file NAME (gguf_file=NAME)"
    )
    assert hub.downloads() == []


def test_config_json_and_gguf_files_without_safetensors_ask_for_a_name(hub: FakeHub, online: Path) -> None:
    """A repository with the original config.json beside GGUF files: without a name the
    safetensors are looked for, and the error lists the GGUF models and names --gguf-file."""
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained("org/configured")
    commit = hub.repos["org/configured"]["main"].commit
    assert str(excinfo.value) == (
        f"Hugging Face Hub model org/configured (commit {commit}): it has neither "
        f"'model.safetensors.index.json' nor 'model.safetensors'; its GGUF models: {MODELS}: pass one as "
        "--gguf-file NAME (gguf_file=NAME)"
    )
    assert not [f for f in hub.downloads() if f.endswith(".gguf")]


# --- a local folder, and bad names ----------------------------------------------------------------


def test_gguf_file_selects_a_file_in_a_local_folder(repos: dict[str, Path]) -> None:
    """A folder of several models is an error without a name; with one, the checkpoint is that
    file (or the first part of a set named by any part)."""
    folder = repos["many"]
    with pytest.raises(CheckpointError, match="holds 3 GGUF models"):
        Engine.from_pretrained(folder)
    assert resolve_checkpoint(folder, gguf_file=F32) == str(folder / F32)
    with Engine.from_pretrained(folder, max_batch_size=1, gguf_file=F32) as engine:
        assert engine.config.checkpoint == str(folder / F32)
        assert engine.config.gguf_file == F32


def test_a_name_the_folder_lacks_lists_its_gguf_files(repos: dict[str, Path], tmp_path: Path) -> None:
    """A missing file, or a missing part of the set it names, is a CheckpointError naming the
    folder, the file and the folder's GGUF models."""
    folder = repos["many"]
    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint(folder, gguf_file="tiny-Q4_K_M.gguf")
    assert str(excinfo.value) == (
        f"checkpoint directory {str(folder)!r} has no file 'tiny-Q4_K_M.gguf'; it holds {MODELS}"
    )
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in SPLIT[:2]:
        (partial / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint(partial, gguf_file=SPLIT[0])
    assert str(excinfo.value) == (
        f"checkpoint directory {str(partial)!r} has no part {SPLIT[2]!r} of the split set {SPLIT[0]!r}; "
        f"it holds {SPLIT[0]} (3 parts)"
    )


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("tiny-Q8_0", "gguf_file must name a .gguf file within the checkpoint"),
        ("../tiny-Q8_0.gguf", "must be a file's name (or relative path, with /) within the checkpoint"),
        (F32, "is a file itself: pass the file alone, or its folder with gguf_file"),
    ],
)
def test_a_bad_gguf_file_is_a_clear_error_before_anything_loads(
    repos: dict[str, Path], name: str, problem: str
) -> None:
    """A name that is no .gguf file's, one leaving the folder, or gguf_file with a .gguf file as
    the checkpoint: a CheckpointError naming the checkpoint and the name."""
    checkpoint = repos["many"] / Q8 if name == F32 else repos["many"]
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(checkpoint, gguf_file=name)
    assert problem in str(excinfo.value) and repr(name) in str(excinfo.value)
    assert str(checkpoint) in str(excinfo.value)


# --- the command line -------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_takes_a_hub_id_with_gguf_file(hub: FakeHub, home: Path, repos: dict[str, Path]) -> None:
    """`rtpcore generate org/name --gguf-file NAME` in a fresh process fetches that file alone
    and answers as the local file."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home)}
    done = rtpcore("generate", "org/many", "--gguf-file", Q8, "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
                   "--json", env=env)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    with Engine.from_pretrained(repos["many"] / Q8, max_batch_size=1) as engine:
        assert record["output_ids"] == engine.generate([[1, 2, 3]], max_new_tokens=5)[0]
    assert Path(record["checkpoint"]).name == Q8
    assert hub.downloads() == [Q8]

    done = rtpcore("generate", "org/many", "--gguf-file", "nope.gguf", "--prompt-ids", "1", env=env)
    assert done.returncode == 1
    assert done.stderr.startswith("rtpcore: error: Hugging Face Hub model org/many: the repository has no file")
    assert MODELS in done.stderr and "Traceback" not in done.stderr
