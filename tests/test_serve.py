"""``rtpcore serve`` as a real process on 127.0.0.1, driven by the real ``openai`` client and
``httpx``: answers equal the engine's, streams equal non-streams, concurrency changes nothing,
disconnects leak no KV block, bad requests are 400s naming the field, SIGTERM drains and exits 0.

Every loop is bounded in count and time; every server is stopped by its fixture.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rtpcore import Engine  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4: bos 1, eos 2 as config.json
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 emoji and accents.",
] * 20


def write_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer.json (BOS added to encoded text) and a tokenizer_config.json
    with a ChatML template; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return int(tok.get_vocab_size())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``rtpcore serve`` process (``launcher``: what python runs instead of ``-m rtpcore``); ``url``
    once /health answers."""

    def __init__(self, checkpoint: Path, *extra: str, name: str = "tiny", env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = ("-m", "rtpcore")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        # The server's log goes to a file, not a pipe: a pipe nobody reads fills up (access lines,
        # one per request) and stalls the server.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 -- closed by stop(), which every user calls
        if env is None:  # a key in the test run's own environment would guard every server
            env = {k: v for k, v in os.environ.items() if k != "RTPCORE_API_KEY"}
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "serve", str(checkpoint), "--port", str(self.port),
             "--served-model-name", name, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
        )
        deadline = time.monotonic() + 300  # a bound against hanging, not a speed requirement
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output()
                self.log.close()
                raise AssertionError(f"server exited {self.proc.returncode}: {out}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError("server did not answer /health within 300 s")

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["rtpcore_requests_running"] == 0 and m["rtpcore_requests_waiting"] == 0
            if (idle and m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"]) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def output(self) -> str:
        """Everything the server printed so far."""
        if self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log.closed:
            return self.proc.returncode, ""
        out = self.output()
        self.log.close()
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("served")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--max-batch-size", "8", "--kv-cache-memory", "8MiB")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(checkpoint) as e:
        yield e


def encode(checkpoint: Path, text: str) -> list[int]:
    from rtpcore.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(checkpoint).encode(text)


def test_greedy_completion_equals_engine_generate(server: Server, engine: Engine, checkpoint: Path) -> None:
    """A greedy completion of token ids returns the text of Engine.generate's tokens, and usage counts them."""
    from rtpcore.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    for prompt in ([1, 40, 41, 42], encode(checkpoint, "The capital of France is")):
        want = engine.generate([prompt], max_new_tokens=12, temperature=0.0)[0]
        got = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        ids = want[:-1] if want and want[-1] in engine.eos_token_ids else want
        assert got.choices[0].text == tok.decode(ids)
        assert got.usage.completion_tokens == len(want) and got.usage.prompt_tokens == len(prompt)
        assert got.choices[0].finish_reason == ("stop" if len(want) < 12 else "length")


def test_return_token_ids_adds_each_choices_ids_whole_and_streamed(server: Server, engine: Engine) -> None:
    """vLLM's return_token_ids: the ids Engine.generate returns, beside the text; without it, none."""
    prompt = [1, 40, 41, 42]
    want = engine.generate([prompt], max_new_tokens=8, temperature=0.0)[0]
    client = server.client()
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    streamed = [t for c in chunks for choice in c.choices for t in (choice.model_extra or {}).get("token_ids", [])]
    assert streamed == want


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_concatenate_to_the_whole_answer(server: Server, chat: bool) -> None:
    """Streaming (completions and chat) yields deltas whose concatenation is the non-streamed text;
    include_usage adds a final usage chunk; the stream ends with [DONE]."""
    c = server.client()
    if chat:
        kw: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "Hello, world!"}],
                              "max_tokens": 24, "temperature": 0}
        whole = c.chat.completions.create(**kw).choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        kw = {"model": "tiny", "prompt": "Hello, world! How", "max_tokens": 24, "temperature": 0}
        whole = c.completions.create(**kw).choices[0].text
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])


def test_a_stop_string_cuts_the_text_across_tokens(server: Server) -> None:
    """A stop string taken from the middle of a greedy answer ends it there, trimmed, finish "stop"."""
    c = server.client()
    whole = c.completions.create(model="tiny", prompt="Caf\u00e9 na", max_tokens=32, temperature=0).choices[0].text
    assert len(whole) >= 6
    stop = whole[3:6]
    got = c.completions.create(model="tiny", prompt="Caf\u00e9 na", max_tokens=32, temperature=0, stop=[stop])
    assert got.choices[0].text == whole[: whole.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="Caf\u00e9 na", max_tokens=32, temperature=0,
                                    stop=[stop], stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == whole[: whole.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_text_completions_equal_engine_chat_and_generate(server: Server, engine: Engine, stream: bool) -> None:
    """For the same conversation (or text prompt) and params -- greedy; a stop string from the middle
    of the answer, cut or kept; special tokens kept; n=2 -- the server answers (whole or streamed) the
    text, finish reason and token count of Engine.chat (or Engine.generate): one text path."""
    from rtpcore import SamplingParams

    c = server.client()
    messages: list[Any] = [{"role": "user", "content": "Hello, world! How are you today?"}]
    prompt = "The capital of France is"
    plain = engine.chat(messages, SamplingParams(max_tokens=24))[0].outputs[0].text or ""
    assert len(plain) >= 6
    stop = plain[3:6]
    cases: list[dict[str, Any]] = [
        {}, {"stop": [stop]}, {"stop": [stop], "include_stop_str_in_output": True},
        {"skip_special_tokens": False}, {"n": 2},
    ]
    for extra in cases:
        params = SamplingParams(max_tokens=24, **extra)
        for chat in (True, False):
            want = (engine.chat(messages, params) if chat else engine.generate(prompt, params))[0]
            kw: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "temperature": 0, **extra}
            if stream:
                kw["stream"], kw["stream_options"] = True, {"include_usage": True}
            args: dict[str, Any] = {"messages": messages} if chat else {"prompt": prompt}
            extra_body = {k: kw.pop(k) for k in ("include_stop_str_in_output", "skip_special_tokens") if k in kw}
            create = c.chat.completions.create if chat else c.completions.create
            got = create(**args, **kw, extra_body=extra_body)
            texts, finishes, usage = ([""] * params.n, [None] * params.n, None)
            for chunk in (got if stream else [got]):
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    part = (choice.delta.content if stream else choice.message.content) if chat else choice.text
                    texts[choice.index] += part or ""
                    finishes[choice.index] = choice.finish_reason or finishes[choice.index]
            assert texts == [o.text for o in want.outputs], (chat, extra)
            assert finishes == [o.finish_reason for o in want.outputs], (chat, extra)
            assert usage is not None and usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
            assert usage.prompt_tokens == len(want.prompt_token_ids)


def test_64_concurrent_streams_each_equal_the_request_alone(server: Server) -> None:
    """64 streaming requests at once (different prompts and lengths) each get the text they get alone."""
    prompts = [f"Hello {i}, how are you" for i in range(64)]
    c = server.client()
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=8 + i % 9, temperature=0).choices[0].text
             for i, p in enumerate(prompts)]

    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i: int) -> str:
            stream = await ac.completions.create(model="tiny", prompt=prompts[i], max_tokens=8 + i % 9,
                                                 temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=600)
        finally:
            await ac.close()

    assert asyncio.run(run()) == alone
    m = server.wait_idle()
    assert m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"]


def test_clients_that_disconnect_leave_no_kv_block_held(server: Server) -> None:
    """Streams closed after a few chunks and non-streamed requests cut by a client timeout abort
    their requests: once idle, every KV block is free and nothing runs or waits."""
    body = {"model": "tiny", "prompt": "Hello, world!", "max_tokens": 200, "temperature": 0, "stream": True}
    for i in range(12):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= i % 4:
                    break
    for _ in range(3):
        # 240 tokens, one step each: usually more than the client's 0.05 s, after which it hangs up;
        # a fast machine may answer first (the tiny model takes 60-100 ms on a 2-vCPU EPYC), and
        # then the answer is whole. Either way nothing stays held (below): no test here waits on speed.
        try:
            r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 240,
                                                                 "ignore_eos": True}, timeout=0.05)
        except httpx.TimeoutException:
            continue
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 240, r.text
    m = server.wait_idle()
    assert m["rtpcore_kv_blocks_free"] == m["rtpcore_kv_blocks_total"] > 0
    assert m["rtpcore_requests_running"] == 0 and m["rtpcore_requests_waiting"] == 0


USER = [{"role": "user", "content": "x"}]
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 1025]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, None),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content"),
    # tools default to tool_choice "auto", which needs --tool-call-parser (this server has none)
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "code", "function": {"name": "f"}}]},
     "tools[0].type"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "continue_final_message": True}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_requests_are_400s_naming_the_field(server: Server, path: str, body: dict[str, Any], param: str | None) -> None:
    """Each malformed or out-of-range request answers 400 in OpenAI's error shape, naming the field."""
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_unparsable_json_another_model_and_metrics(server: Server) -> None:
    """Broken JSON is a 400, another model name a 404, /v1/models lists the served name, and
    /metrics carries the gauges, the token counter and both latency histograms."""
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("rtpcore_kv_blocks_total", "rtpcore_kv_blocks_free", "rtpcore_requests_running",
                 "rtpcore_requests_waiting", "rtpcore_generated_tokens_total",
                 "rtpcore_time_to_first_token_seconds_bucket", "rtpcore_time_between_tokens_seconds_bucket"):
        assert name in text


def test_logprobs_are_the_engine_distributions_top_entries(server: Server) -> None:
    """completions logprobs=3 and chat top_logprobs=2 report, per token, the chosen token's
    logprob and that many alternatives, most likely first, the chosen one among them (greedy)."""
    c = server.client()
    got = c.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    shown = got.usage.completion_tokens - (got.choices[0].finish_reason == "stop")  # a stop token is not shown
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == shown
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model with room for a request that keeps the batch busy for seconds."""
    path = tmp_path_factory.mktemp("served-long")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=8192)
    return path


def test_api_key_queue_limit_and_sigterm_drain(long_context_checkpoint: Path) -> None:
    """With --api-key, /v1/ needs the bearer key (401 otherwise) while /health and /metrics do
    not; with one request running (a long one) and --max-waiting 1 waiting, a third is a 429 at
    once; after the long one's client leaves, SIGTERM lets the admitted request finish and the
    server exits 0."""
    srv = Server(long_context_checkpoint, "--api-key", "sekret", "--max-batch-size", "1", "--max-waiting", "1",
                 "--shutdown-timeout", "60")
    try:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        r = httpx.get(srv.url + "/v1/models", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert [m.id for m in srv.client(api_key="sekret").models.list()] == ["tiny"]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 64, "temperature": 0, "stream": True}
        headers = {"Authorization": "Bearer sekret"}
        long = {**body, "max_tokens": 8000, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=long, headers=headers, timeout=300) as running:
            long_lines = running.iter_lines()  # kept: dropping the iterator would close the connection
            next(long_lines)  # the first chunk: the long request runs
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=headers, timeout=300) as waiting:
                deadline = time.monotonic() + 120
                while srv.metrics()["rtpcore_requests_waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert srv.metrics()["rtpcore_requests_waiting"] >= 1
                third = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, headers=headers,
                                   timeout=60)
                assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
                running.close()  # the long request's client leaves: it is aborted, the waiting one admitted
                lines = waiting.iter_lines()
                next(lines)
                srv.proc.send_signal(signal.SIGTERM)
                queued = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
                assert queued[-1]["choices"][0]["finish_reason"] in ("length", "stop")  # finished while draining
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_health_stays_200_after_a_requests_fault_and_is_503_once_the_device_faults(checkpoint: Path) -> None:
    """In-process app: a model fault fails its request (the stream carries an error event, never a
    hang) and /health stays 200; a device fault breaks the engine: its stream says so and /health
    answers 503 naming it."""
    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app

    async def main() -> None:
        engine = AsyncEngine.from_pretrained(checkpoint)
        app = build_app(engine, model_name="tiny")
        transport = httpx.ASGITransport(app=app)
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": True}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                assert (await client.get("/health")).status_code == 200
                real = engine.engine.model.forward
                fault: list[Exception] = [ValueError("injected fault")]

                def broken(batch: Any, caches: Any) -> Any:
                    raise fault[0]

                engine.engine.model.forward = broken
                r = await client.post("/v1/completions", json=body)
                assert "injected fault" in r.text and r.text.rstrip().endswith("data: [DONE]")
                assert (await client.get("/health")).status_code == 200
                engine.engine.model.forward = real
                r = await client.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                fault[0] = RuntimeError("CUDA error: an illegal memory access was encountered")
                engine.engine.model.forward = broken
                r = await client.post("/v1/completions", json=body)
                # not this request's fault: the client is pointed at the log, never shown the internals
                assert "the engine could not run it" in r.text and "illegal memory access" not in r.text
                assert r.text.rstrip().endswith("data: [DONE]")
                health = await client.get("/health")
                assert health.status_code == 503 and "illegal memory access" in health.json()["message"]
                # the loop thread marks the AsyncEngine broken once the failed step has returned,
                # which may be just after the stream ended: wait for it (bounded)
                deadline = time.monotonic() + 60
                while engine.broken is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert engine.broken is not None
        finally:
            await engine.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=300))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--demo", "llama", "--threads", "0"], "--threads: must be a positive integer, got '0'"),
        (["--demo", "llama", "--port", "70000"], "--port: must be a TCP port 1-65535, got '70000'"),
        (["--demo", "llama", "--shutdown-timeout", "-1"], "--shutdown-timeout: must be a number of seconds >= 0"),
        (["--max-waiting", "2"], "give exactly one of CHECKPOINT or --demo NAME"),
    ],
)
def test_serve_usage_errors_exit_2_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad serve flags are usage errors (exit status 2) naming the flag, before anything loads."""
    from rtpcore.cli import main

    with pytest.raises(SystemExit) as excinfo:
        main(["serve", *argv])
    assert excinfo.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_server_with_a_draft_answers_as_without_and_counts_proposals(server: Server, checkpoint: Path) -> None:
    """The checkpoint as its own draft (every proposal accepted): the same greedy texts, a stop
    string inside an accepted run cuts the text there, and /metrics counts the draft tokens."""
    base = server.client()
    prompt = "Caf\u00e9 na"
    whole = base.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    stop = whole[3:6]
    spec = Server(checkpoint, "--draft-model", str(checkpoint), "--num-speculative-tokens", "3")
    try:
        c = spec.client()
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0)
        assert got.choices[0].text == whole
        assert got.usage.completion_tokens == 32
        cut = c.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=[stop], stream=True)
        assert "".join(ch.choices[0].text for ch in cut if ch.choices) == whole[: whole.index(stop)]
        # usage counts the tokens up to the one completing the stop string, as one token per step does
        plain = base.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
        spec_cut = c.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
        assert spec_cut.choices[0].text == plain.choices[0].text
        assert spec_cut.usage.completion_tokens == plain.usage.completion_tokens < 32
        m = spec.wait_idle()
        assert m["rtpcore_speculative_proposed_tokens_total"] > 0
        assert m["rtpcore_speculative_accepted_tokens_total"] == m["rtpcore_speculative_proposed_tokens_total"]
    finally:
        code, out = spec.stop()
    assert code == 0, out
    assert f"draft {str(checkpoint)!r} (llama, 3 tokens per step)" in out  # the startup line says so
