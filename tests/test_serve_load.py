"""``rtpcore serve`` under load (docs/design.md §13), as a real process on 127.0.0.1 driven by the
real ``openai`` client from real threads: chunked prefill gives the unchunked tokens within the
token budget, KV blocks on demand preempt and recompute without changing any output, a request's
own fault (a model raising on its token, a degenerate temperature) fails that request only while
the server stays healthy, and a pool that cannot hold one context is refused at start.

Every loop is bounded in count and time; every server is stopped by its test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rtpcore import Engine  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

POISON = 7  # the faulty plugin's model raises on this token id at position 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("served-long")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=1024)
    return path


def histogram(metrics: dict[str, float], name: str) -> dict[str, float]:
    """``{le: cumulative count}`` of one Prometheus histogram, and ``"count"``."""
    prefix = f'{name}_bucket{{le="'
    out = {k[len(prefix) : -2]: v for k, v in metrics.items() if k.startswith(prefix)}
    out["count"] = metrics[f"{name}_count"]
    return out


def test_a_900_token_prompt_prefilled_64_tokens_a_step_gives_the_unchunked_greedy_output(checkpoint: Path) -> None:
    """With --max-num-batched-tokens 64 a 900-token prompt is prefilled in chunks: the greedy text
    equals the unchunked engine's, and rtpcore_iteration_tokens shows no step above 64 tokens."""
    from rtpcore.engine.text.tokenizer import Tokenizer

    prompt = [(13 * i + 5) % 300 + 5 for i in range(900)]
    with Engine.from_pretrained(checkpoint, max_num_batched_tokens=1024) as e:
        want = e.generate([prompt], max_new_tokens=24, stop_token_ids=[])[0]
    text = Tokenizer.from_pretrained(checkpoint).decode(want, skip_special_tokens=True)
    srv = Server(checkpoint, "--max-num-batched-tokens", "64", "--max-batch-size", "4")
    try:
        with srv.client(timeout=300) as client:
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
            )
        assert r.choices[0].text == text and r.usage.completion_tokens == 24
        steps = histogram(srv.metrics(), "rtpcore_iteration_tokens")
        assert steps["count"] >= 900 / 64 + 23  # 15 chunks, then 23 decodes
        assert steps["64.0"] == steps["count"]  # no step above the budget
        assert steps["32.0"] < steps["count"]  # and the chunks did fill it
    finally:
        code, out = srv.stop()
    assert code == 0, out


TIE = 1e-2  # nats: two log-probabilities this close are a tie for greedy decoding across batch shapes


def same_up_to_a_tie(choice: Any, want: str) -> None:
    """``choice.text`` equals ``want``, or first differs inside a token (or the two before it: a
    character can span tokens) whose two most likely alternatives were tied within TIE."""
    text = choice.text
    if text == want:
        return
    cut = next((i for i, (a, b) in enumerate(zip(text, want, strict=False)) if a != b), min(len(text), len(want)))
    lp = choice.logprobs
    at = max(i for i, offset in enumerate(lp.text_offset) if offset <= cut)
    gaps = []
    for i in range(max(0, at - 2), at + 1):
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    assert min(gaps) < TIE, f"the text departs at character {cut} (token {at}) with no tie: top-2 gaps {gaps}"


def test_twelve_long_requests_on_a_96_block_pool_run_together_preempt_and_keep_their_tokens(
    checkpoint: Path,
) -> None:
    """12 requests of 20 prompt + 700 new tokens on a 96-block pool (enough for two of them whole):
    they share steps, some are preempted and recompute, and each returns the tokens it returns with
    a pool that holds them all -- up to a near-tie: a recomputed (or cached) prefix runs in other
    batch shapes than the reference's, and where the two most likely tokens are within float error
    of each other the greedy choice may go either way.

    How many run at once depends on how fast the 12 requests arrive against how fast the running
    ones fill the pool (a slow machine spreads the arrivals over more steps), so this test asserts
    only that steps were shared; test_scheduler.py counts the batch for requests that arrive together."""
    prompts = [[(31 * r + 7 * i) % 300 + 5 for i in range(20)] for r in range(12)]
    with Engine.from_pretrained(checkpoint, max_num_batched_tokens=1024) as e:
        block_bytes = sum(s.block_bytes for s in e.kv_cache_specs)
        want = e.generate(prompts, max_new_tokens=700, stop_token_ids=[])
        assert e.stats().preemptions_total == 0
    srv = Server(checkpoint, "--kv-cache-memory", str(96 * block_bytes), "--max-model-len", "1024",
                 "--max-num-batched-tokens", "256")
    client = srv.client(timeout=600)
    try:
        assert srv.metrics()["rtpcore_kv_blocks_total"] == 96

        def one(prompt: list[int]) -> Any:
            return client.completions.create(
                model="tiny", prompt=prompt, max_tokens=700, temperature=0.0, logprobs=2,
                extra_body={"ignore_eos": True},
            )

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, prompts))
        from rtpcore.engine.text.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(checkpoint)
        for answer, tokens in zip(answers, want, strict=True):
            assert answer.usage.completion_tokens == 700
            same_up_to_a_tie(answer.choices[0], tok.decode(tokens, skip_special_tokens=True))
        m = srv.metrics()
        assert m["rtpcore_preemptions_total"] > 0
        seqs = histogram(m, "rtpcore_iteration_sequences")
        assert seqs["1.0"] < seqs["count"]  # steps of more than one sequence
        assert m["rtpcore_kv_blocks_free"] == 96
    finally:
        client.close()
        code, out = srv.stop()
    assert code == 0, out


FAULTY_PLUGIN = f"""
from rtpcore import hookimpl
from rtpcore.models.llama import LlamaPlugin

class FaultyLlama(LlamaPlugin):
    model_type = "faulty_llama"
    architectures = ("FaultyLlamaForCausalLM",)

    @classmethod
    def build_model(cls, config, weights, **options):
        model = super().build_model(config, weights, **options)
        forward = model.forward

        def faulty(batch, kv_caches):
            if bool(((batch.input_ids == {POISON}) & (batch.positions == 0)).any()):
                raise RuntimeError("this model cannot start with token {POISON}")
            return forward(batch, kv_caches)

        model.forward = faulty
        return model

@hookimpl
def rtpcore_register_models(registry):
    registry.register(FaultyLlama)
"""


def test_a_model_fault_and_a_degenerate_temperature_each_fail_or_touch_one_request_only(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A plugin whose forward raises on one request's first token fails that request alone (HTTP 500
    naming it); temperature 1e-38 is greedy; the greedy requests beside them get their own tokens and
    the server stays healthy and keeps serving."""
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file():
            (faulty / f.name).write_bytes(f.read_bytes())
    config = json.loads((faulty / "config.json").read_text())
    config["architectures"] = ["FaultyLlamaForCausalLM"]
    (faulty / "config.json").write_text(json.dumps(config))
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "faulty_llama.py").write_text(textwrap.dedent(FAULTY_PLUGIN))
    prompts = [[(11 * r + 3 * i) % 300 + 8 for i in range(5 + 9 * r)] for r in range(4)]
    with Engine.from_pretrained(checkpoint) as e:
        want = e.generate(prompts, max_new_tokens=32, stop_token_ids=[])
    from rtpcore.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    texts = [tok.decode(w, skip_special_tokens=True) for w in want]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")])}
    srv = Server(faulty, "--external-model-packages", "faulty_llama", env=env)
    client = srv.client(timeout=300)
    try:

        def greedy(prompt: list[int]) -> Any:
            return client.completions.create(
                model="tiny", prompt=prompt, max_tokens=32, temperature=0.0, extra_body={"ignore_eos": True}
            )

        def poisoned() -> Any:
            return httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": [POISON, 20, 30, 40], "max_tokens": 8, "temperature": 0.0,
            })

        def frozen() -> Any:
            return client.completions.create(
                model="tiny", prompt=prompts[0], max_tokens=32, temperature=1e-38, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(greedy, p) for p in prompts]
            bad, cold = pool.submit(poisoned), pool.submit(frozen)
            answers = [f.result() for f in futures]
            bad_answer, cold_answer = bad.result(), cold.result()
        assert [a.choices[0].text for a in answers] == texts
        assert bad_answer.status_code == 500
        message = bad_answer.json()["error"]["message"]
        assert "the request failed" in message and f"cannot start with token {POISON}" in message
        assert cold_answer.choices[0].text == texts[0]  # below 1e-5 a temperature is greedy
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        assert greedy(prompts[1]).choices[0].text == texts[1]
        m = srv.wait_idle(timeout=120)
        assert m["rtpcore_request_errors_total"] == 1
        assert m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"]
    finally:
        client.close()
        code, out = srv.stop()
    assert code == 0, out


def test_a_pool_smaller_than_one_context_is_refused_at_start_naming_the_flags(checkpoint: Path) -> None:
    """--kv-cache-memory too small for one --max-model-len sequence exits 1 at start, naming both sizes
    and the flags --max-model-len and --kv-cache-memory."""
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "serve", str(checkpoint), "--kv-cache-memory", "64KiB"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("rtpcore: error: ") and "max_model_len=1024" in err
    assert "--max-model-len" in err and "--kv-cache-memory" in err
