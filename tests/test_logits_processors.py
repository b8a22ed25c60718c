"""The logits-processor seam (docs/design.md §18): processors of a real distribution, registered
through ``rtpcore_register_logits_processors`` and enabled by name, see every step's rows by
the BatchUpdate rules and change only the rows whose requests ask for it (``extra_args``, over
HTTP ``vllm_xargs``), in a concurrent batch whose requests finish, join and move; with a
speculative draft the output is the one without it; a processor that raises fails its step's
requests with an error naming it and the engine goes on; an unknown name and another major
``api_version`` are refused; ``rtpcore generate --logits-processors`` runs one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from plugin_env import PluginEnv
from rtpcore import Allowlist, Engine
from rtpcore.engine.core.outputs import RequestOutput
from rtpcore.engine.sample.logits_processors import batch_update
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import (
    InvalidRequestError,
    LogitsProcessorError,
    PluginIncompatibleError,
    RequestFailedError,
)
from rtpcore.logits import BatchUpdate, LogitsProcessor
from rtpcore.plugins.loading import load_report
from test_llama import make_checkpoint

DIST = "lp-steer"

#: The distribution's processors. ``Rows`` keeps ``row -> (params, output_ids)`` by the
#: BatchUpdate rules and refuses to apply when its rows are not exactly the step's rows.
SOURCE = textwrap.dedent('''
    from rtpcore import hookimpl
    from rtpcore.logits import LogitsProcessor

    class Rows(LogitsProcessor):
        def __init__(self, engine_config, device):
            super().__init__(engine_config, device)
            self.rows = {}
            self.updates = 0

        def update_state(self, update):
            if update is None:
                return
            self.updates += 1
            for row in update.removed:
                del self.rows[row]
            for row, params, prompt_ids, output_ids in update.added:
                assert row not in self.rows, (row, update)
                self.rows[row] = (params, prompt_ids, output_ids)
            for a, b in update.moved:
                x, y = self.rows.pop(a, None), self.rows.pop(b, None)
                if x is not None:
                    self.rows[b] = x
                if y is not None:
                    self.rows[a] = y
            if sorted(self.rows) != list(range(update.batch_size)):
                raise RuntimeError(f"rows {sorted(self.rows)} after {update}")

        def check(self, logits):
            if sorted(self.rows) != list(range(logits.shape[0])):
                raise RuntimeError(f"rows {sorted(self.rows)} for {logits.shape[0]} logits rows")

    class Steer(Rows):
        """extra_args: "ban" a token id; "fresh": never a token the output already holds."""
        name = "steer"

        @classmethod
        def validate_params(cls, params):
            args = params.extra_args or {}
            ban = args.get("ban")
            if ban is not None and (isinstance(ban, bool) or not isinstance(ban, int) or ban < 0):
                raise ValueError(f"'ban' must be a token id, got {ban!r}")
            if not isinstance(args.get("fresh", False), bool):
                raise ValueError("'fresh' must be true or false")

        def apply(self, logits):
            self.check(logits)
            for row, (params, _, output_ids) in self.rows.items():
                args = params.extra_args or {}
                if "ban" in args:
                    logits[row, args["ban"]] = float("-inf")
                if args.get("fresh") and output_ids:
                    logits[row, list(output_ids)] = float("-inf")
            return logits

    class FreshAll(Rows):
        """Every row: never a token its output already holds."""
        name = "fresh_all"

        def apply(self, logits):
            self.check(logits)
            for row, (_, _, output_ids) in self.rows.items():
                if output_ids:
                    logits[row, list(output_ids)] = float("-inf")
            return logits

    class Boom(Rows):
        """Raises on a step holding a request with extra_args {"boom": true}."""
        name = "boom"

        def apply(self, logits):
            for row, (params, _, _) in self.rows.items():
                if (params.extra_args or {}).get("boom"):
                    raise RuntimeError(f"boom on row {row}")
            return logits

    @hookimpl
    def rtpcore_register_logits_processors(registry):
        for cls in (Steer, FreshAll, Boom):
            registry.register_logits_processor(cls)
''')

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100], [7, 7], [3, 1, 4, 1, 5]]
MAX_TOKENS = [20, 9, 24, 14, 17]  # ragged: requests finish at different steps, the waiting ones join


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginEnv]:
    site = PluginEnv(tmp_path_factory.mktemp("logits-site"))
    site.add_dist(DIST, plugins={"lp_steer": "lp_steer"}, modules={"lp_steer.py": SOURCE})
    yield site
    sys.path.remove(str(site.site))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logits")
    make_checkpoint(root / "target", seed=0)
    make_checkpoint(root / "other", seed=1, num_hidden_layers=1)
    return {"target": root / "target", "same": root / "target", "other": root / "other"}


def engine(ckpts: dict[str, Path], *names: str, **options: Any) -> Engine:
    return Engine.from_pretrained(ckpts["target"], plugins=[DIST], logits_processors=list(names), tokens_per_block=4,
                                  **options)


def params(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)


def token_ids(engine: Engine, ps: list[SamplingParams]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in engine.generate([{"prompt_token_ids": p} for p in PROMPTS], ps)]


@pytest.fixture(scope="module")
def plain(ckpts: dict[str, Path], env: PluginEnv) -> list[list[int]]:
    """The prompts' greedy tokens without any processor."""
    with Engine.from_pretrained(ckpts["target"], tokens_per_block=4, max_batch_size=2) as e:
        return token_ids(e, [params(n) for n in MAX_TOKENS])


# -- the rows ---------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 11), unique=True, max_size=8), st.lists(st.integers(0, 11), unique=True, max_size=8))
def test_an_update_applied_in_order_leaves_every_request_in_its_new_row(previous: list[int], current: list[int]) -> None:
    removed, added, moved = batch_update(previous, current)
    rows = dict(enumerate(previous))
    for row in removed:
        del rows[row]
    for row, key in added:
        assert row not in rows
        rows[row] = key
    for a, b in moved:
        x, y = rows.pop(a, None), rows.pop(b, None)
        if x is not None:
            rows[b] = x
        if y is not None:
            rows[a] = y
    assert rows == dict(enumerate(current))
    assert len(added) == len(set(current) - set(previous))  # a request that stays is not added again


def test_a_batch_update_is_frozen_with_tuples() -> None:
    update = BatchUpdate(2, [1], [(0, None, [1], [2])], [[0, 1]])
    assert update.removed == (1,) and update.moved == ((0, 1),) and update.added[0][0] == 0


# -- through the Python API ------------------------------------------------------------------------


def test_per_request_arguments_change_only_their_own_rows_in_a_concurrent_batch(
    ckpts: dict[str, Path], plain: list[list[int]]
) -> None:
    """Five requests through two batch slots (rows leave, join and move): rows without
    arguments are token for token the run without the processor; a banned token (the one the
    request would have written first) is the run with logit_bias -100 on it; "fresh" never
    repeats a token."""
    ban = plain[0][0]
    ps = [params(MAX_TOKENS[0], ban=ban), params(MAX_TOKENS[1]), params(MAX_TOKENS[2], fresh=True),
          params(MAX_TOKENS[3]), params(MAX_TOKENS[4], ban=plain[4][0], fresh=False)]
    with engine(ckpts, "steer", max_batch_size=2) as e:
        got = token_ids(e, ps)
        updates = e.logits_processors.processors[0][1].updates  # type: ignore[union-attr,attr-defined]
    assert got[1] == plain[1] and got[3] == plain[3]
    assert got[0] != plain[0] and ban not in got[0]
    assert len(set(got[2])) == len(got[2]) and got[2] != plain[2]
    assert updates > 2  # the batch changed several times
    with Engine.from_pretrained(ckpts["target"], tokens_per_block=4) as e:
        biased = [SamplingParams(max_tokens=n, ignore_eos=True, logit_bias={t: -100.0})
                  for n, t in ((MAX_TOKENS[0], ban), (MAX_TOKENS[4], plain[4][0]))]
        outs = e.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[4]}], biased)
    assert [list(o.outputs[0].token_ids) for o in outs] == [got[0], got[4]]


def test_preempted_requests_come_back_with_their_output_and_keep_it(ckpts: dict[str, Path]) -> None:
    """With KV memory for about one 40-token sequence, requests are preempted and recomputed: each
    comes back as an added row whose output_ids hold what it generated, so a processor reading the
    whole output gives the tokens it gives without memory pressure."""
    ps = [params(n, fresh=True) for n in MAX_TOKENS]
    with engine(ckpts, "steer", max_batch_size=2) as e:
        reference = token_ids(e, ps)
        block_bytes = sum(spec.block_bytes for spec in e.kv_cache_specs)
    with engine(ckpts, "steer", kv_cache_memory=10 * block_bytes, max_model_len=40) as e:
        assert token_ids(e, ps) == reference
        assert e.stats().preemptions_total > 0


def test_a_bad_argument_is_refused_naming_extra_args_before_anything_runs(ckpts: dict[str, Path]) -> None:
    with engine(ckpts, "steer") as e:
        with pytest.raises(InvalidRequestError) as excinfo:
            e.generate([{"prompt_token_ids": [1, 2]}] * 2, [params(4), params(4, ban="x")])
        assert excinfo.value.field == "extra_args"
        assert "logits processor 'steer'" in str(excinfo.value) and "'ban' must be a token id" in str(excinfo.value)
        assert e.stats().steps_total == 0
    with pytest.raises(InvalidRequestError, match="extra_args keys must be strings"):
        SamplingParams(extra_args={1: 2})


@pytest.mark.parametrize("draft", ["same", "other"])
def test_with_a_draft_the_output_is_the_one_without_it(ckpts: dict[str, Path], plain: list[list[int]], draft: str) -> None:
    """The processor reads every token of the output: each verified position must see the
    proposals before it, or the greedy output would differ from decoding without the draft."""
    ps = [params(n, fresh=i % 2 == 0) for i, n in enumerate(MAX_TOKENS)]
    with engine(ckpts, "steer", max_batch_size=3) as e:
        reference = token_ids(e, ps)
    assert reference[0] != plain[0] and reference[1] == plain[1]
    with engine(ckpts, "steer", max_batch_size=3, draft_model=ckpts[draft], num_speculative_tokens=3) as e:
        assert token_ids(e, ps) == reference
        assert e.speculative_stats.proposed > 0
        assert e.stats().speculative_accepted_total > (0 if draft == "same" else -1)


def test_a_processor_that_raises_fails_its_requests_naming_it_and_the_engine_goes_on(ckpts: dict[str, Path]) -> None:
    """The step runs again apart: the request that makes the processor raise ends with a
    RequestFailedError naming it; the others get their tokens; the engine serves the next call."""
    outputs: dict[str, list[RequestOutput]] = {}
    with engine(ckpts, "boom") as e:
        reference = e.generate(PROMPTS[:3], max_new_tokens=6, stop_token_ids=[])
        for i, prompt in enumerate(PROMPTS[:3]):
            p = SamplingParams(max_tokens=6, ignore_eos=True, extra_args={"boom": i == 1})
            e.core.add_request(prompt, p, outputs.setdefault(f"r{i}", []).append, request_id=f"r{i}")
        while e.core.has_work:
            e.step()
        failed = outputs["r1"][-1].error
        assert isinstance(failed, RequestFailedError) and failed.reason == "logits_processor"
        assert "logits processor 'boom'" in str(failed) and "boom on row" in str(failed)
        assert isinstance(failed.__cause__, LogitsProcessorError) and failed.__cause__.processor == "boom"
        assert DIST in str(failed)  # who registered it
        for i in (0, 2):
            assert [t for o in outputs[f"r{i}"] for t in o.token_ids] == reference[i]
        assert e.generate(PROMPTS[:3], max_new_tokens=6, stop_token_ids=[]) == reference  # still up


def test_an_unknown_name_is_refused_naming_the_option_and_the_known_ones(ckpts: dict[str, Path]) -> None:
    with pytest.raises(LogitsProcessorError) as excinfo:
        engine(ckpts, "steer", "nope")
    assert excinfo.value.processor == "nope" and excinfo.value.known == ("boom", "fresh_all", "steer")
    assert "logits_processors=['steer', 'nope']: 'nope' is not a known logits processor; known: boom, fresh_all, steer" \
        in str(excinfo.value)
    with pytest.raises(LogitsProcessorError, match="known: none"):
        Engine.from_pretrained(ckpts["target"], logits_processors=["steer"])  # its plugin not loaded
    with pytest.raises(Exception, match="logits_processors must be a list of names"):
        Engine.from_pretrained(ckpts["target"], logits_processors="steer")


@pytest.mark.parametrize(("version", "rule"), [("2.0", "another major"), ("1.9", "upgrade rtpcore")])
def test_a_processor_written_for_another_seam_version_is_incompatible(plugin_env: PluginEnv, version: str,
                                                                     rule: str) -> None:
    source = ("from rtpcore import hookimpl\nfrom rtpcore.logits import LogitsProcessor\n"
              f"class P(LogitsProcessor):\n    name = 'p'\n    api_version = {version!r}\n"
              "    def update_state(self, update):\n        pass\n    def apply(self, logits):\n        return logits\n"
              "@hookimpl\ndef rtpcore_register_logits_processors(registry):\n    registry.register_logits_processor(P)\n")
    plugin_env.add_dist("lp-future", plugins={"lp_future": "lp_future"}, modules={"lp_future.py": source})
    report = load_report(Allowlist.from_cli(plugins=["lp-future"]).resolve())
    (outcome,) = report.outcomes
    assert outcome.state == "incompatible" and isinstance(outcome.error, PluginIncompatibleError)
    assert f"logits_processors API {version}" in str(outcome.error) and rule in str(outcome.error)
    assert report.registry.seam_names("logits_processors") == []


def test_a_processor_that_is_not_one_is_an_invalid_plugin(plugin_env: PluginEnv) -> None:
    source = ("from rtpcore import hookimpl\nfrom rtpcore.logits import LogitsProcessor\n"
              "class P(LogitsProcessor):\n    name = 'lazy'\n"
              "@hookimpl\ndef rtpcore_register_logits_processors(registry):\n    registry.register_logits_processor(P)\n")
    plugin_env.add_dist("lp-lazy", plugins={"lp_lazy": "lp_lazy"}, modules={"lp_lazy.py": source})
    (outcome,) = load_report(Allowlist.from_cli(plugins=["lp-lazy"]).resolve()).outcomes
    assert outcome.state == "invalid" and "does not implement apply, update_state" in str(outcome.error)
    assert issubclass(LogitsProcessor, object)


# -- the command line --------------------------------------------------------------------------------


def child_env(env: PluginEnv) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(env.site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def generate_cli(ckpt: Path, env: PluginEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "5,9,33",
                           "--max-new-tokens", "20", "--json", "--plugins", DIST, *args],
                          capture_output=True, text=True, env=child_env(env), timeout=300)


def test_rtpcore_generate_runs_a_plugins_processor(ckpts: dict[str, Path], env: PluginEnv,
                                                   plain: list[list[int]]) -> None:
    out = generate_cli(ckpts["target"], env, "--logits-processors", "fresh_all")
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)["output_ids"]
    with engine(ckpts, "fresh_all") as e:
        assert ids == e.generate([[5, 9, 33]], max_new_tokens=20)[0]
    assert len(set(ids)) == len(ids) and ids != plain[0][: len(ids)]


def test_rtpcore_generate_with_an_unknown_name_exits_2_listing_the_known_ones(ckpts: dict[str, Path],
                                                                             env: PluginEnv) -> None:
    out = generate_cli(ckpts["target"], env, "--logits-processors", "steer,nope")
    assert out.returncode == 2, out.stderr
    assert "--logits-processors 'nope' is not a known logits processor; known: boom, fresh_all, steer" in out.stderr
    help_text = subprocess.run([sys.executable, "-m", "rtpcore", "serve", "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    assert "--logits-processors NAME[,NAME]" in help_text and "(default: none)" in " ".join(help_text.split())


# -- over HTTP -----------------------------------------------------------------------------------------


def test_vllm_xargs_reach_the_processor_and_a_bad_value_is_a_400(ckpts: dict[str, Path], plain: list[list[int]]) -> None:
    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app
    from rtpcore.serving.protocol import ChatCompletionRequest

    ban = plain[0][0]

    async def main() -> list[httpx.Response]:
        engine = AsyncEngine.from_pretrained(ckpts["target"], plugins=[DIST], logits_processors=["steer"],
                                             tokens_per_block=4)
        try:
            app = build_app(engine, model_name="tiny", skip_tokenizer=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS[0], "temperature": 0,
                        "ignore_eos": True}
                return [await client.post("/v1/completions", json={**body, **extra}) for extra in (
                    {"vllm_xargs": {"ban": ban}}, {}, {"vllm_xargs": 5}, {"vllm_xargs": {"ban": "x"}},
                    {"vllm_xargs": None})]
        finally:
            await engine.aclose()

    banned, unbanned, not_object, refused, null = asyncio.run(main())
    for r in (banned, unbanned, null):
        assert r.status_code == 200, r.text
    assert banned.json()["choices"][0]["token_ids"] != plain[0] and ban not in banned.json()["choices"][0]["token_ids"]
    assert unbanned.json()["choices"][0]["token_ids"] == plain[0] == null.json()["choices"][0]["token_ids"]
    for r in (not_object, refused):
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs", r.text
    assert "'ban' must be a token id" in refused.json()["error"]["message"]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "vllm_xargs": {"fresh": True}})
    assert chat.to_sampling_params(3, max_model_len=64).extra_args == {"fresh": True}


def test_the_base_class_states_the_seams_version() -> None:
    from rtpcore.logits import API_VERSION
    from rtpcore.plugins import SEAM_API_VERSIONS

    assert LogitsProcessor.api_version == API_VERSION == SEAM_API_VERSIONS["logits_processors"]
