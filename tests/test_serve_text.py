"""The server's text side is the engine's own (``Engine.text``): ``build_app`` loads no tokenizer
or chat template of its own, renders and encodes off the event loop, serves completions only
when the checkpoint has no chat template, and a checkpoint without a tokenizer is refused --
by ``rtpcore serve`` before the engine loads."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from test_llama import make_checkpoint  # noqa: E402
from test_serve import write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=64)
    return path


def serve_in_process(checkpoint: Path, requests: Any) -> Any:
    """Build the app over a fresh AsyncEngine of ``checkpoint`` and run ``requests(app, client)``."""
    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app

    async def main() -> Any:
        engine = AsyncEngine.from_pretrained(checkpoint)
        try:
            app = build_app(engine, model_name="tiny")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                return await requests(app, client)
        finally:
            await engine.aclose()

    return asyncio.run(main())


def test_the_app_holds_the_engines_text_side_and_renders_off_the_event_loop(checkpoint: Path) -> None:
    """The app's tokenizer is the engine's object; a chat is rendered, and a text prompt encoded, by
    the engine's TextSide in a worker thread, never on the event loop's."""
    seen: dict[str, str] = {}

    async def requests(app: Any, client: Any) -> None:
        served = app.state.served
        text = served.engine.engine.text
        assert served.text is text and served.tokenizer is text.tokenizer
        loop_thread = threading.current_thread().name
        render, encode = text.render_conversation, text.encode

        def recording(name: str, call: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                seen[name] = threading.current_thread().name
                return call(*args, **kwargs)
            return run

        text.render_conversation = recording("render", render)
        text.encode = recording("encode", encode)
        try:
            chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2})
            completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        finally:
            del text.render_conversation, text.encode
        assert chat.status_code == completion.status_code == 200, (chat.text, completion.text)
        assert seen.keys() == {"render", "encode"} and loop_thread not in seen.values(), (loop_thread, seen)

    serve_in_process(checkpoint, requests)


def test_without_a_chat_template_completions_are_served_and_chat_is_a_400(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint whose tokenizer_config.json has no chat_template: completions answer, chat is
    the 400 naming messages and pointing at /v1/completions."""
    for name in os.listdir(checkpoint):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    async def requests(app: Any, client: Any) -> tuple[Any, Any]:
        completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
        return completion, chat

    completion, chat = serve_in_process(tmp_path, requests)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    assert chat.status_code == 400 and chat.json()["error"] == {
        "message": "this model has no chat template (chat_template.jinja or tokenizer_config.json's chat_template); "
                   "use /v1/completions",
        "type": "invalid_request_error", "param": "messages", "code": None,
    }


def test_build_app_serves_token_ids_for_an_engine_whose_checkpoint_has_no_tokenizer(tmp_path: Path) -> None:
    """A token-id engine (no tokenizer.json) is served without text: the app says why there is
    no tokenizer, naming the missing file (tests/test_startup.py runs such a server)."""
    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app

    make_checkpoint(tmp_path, vocab_size=64, max_position_embeddings=64)

    async def main() -> None:
        engine = AsyncEngine.from_pretrained(tmp_path)
        try:
            served = build_app(engine, model_name="tiny").state.served
            assert served.tokenizer is None and served.text.tokenizer is None
            assert served.no_tokenizer == f"the checkpoint has no tokenizer ({str(tmp_path / 'tokenizer.json')!r} is missing)"
        finally:
            await engine.aclose()

    asyncio.run(main())
