"""``rtpcore.serving.app.build_app`` holds no route of its own: every endpoint lives in its
router module under ``rtpcore.serving.routers``, and the app serves exactly those."""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_llama import make_checkpoint  # noqa: E402
from test_serve import write_tokenizer  # noqa: E402

ENDPOINTS = {
    ("/health", "GET"): "rtpcore.serving.routers.health",
    ("/metrics", "GET"): "rtpcore.serving.routers.prometheus",
    ("/v1/models", "GET"): "rtpcore.serving.routers.models",
    ("/v1/models/{model_id}", "GET"): "rtpcore.serving.routers.models",
    ("/v1/completions", "POST"): "rtpcore.serving.routers.completions",
    ("/v1/chat/completions", "POST"): "rtpcore.serving.routers.chat",
    ("/tokenize", "POST"): "rtpcore.serving.routers.tokens",
    ("/detokenize", "POST"): "rtpcore.serving.routers.tokens",
    ("/version", "GET"): "rtpcore.serving.routers.version",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("routed")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=64)
    return path


def test_each_router_module_holds_its_endpoint_and_only_it() -> None:
    """Each router module's APIRouter holds the endpoints named for it (one idea per module:
    the models, the token conversions), each defined there, and no other."""
    for name in set(ENDPOINTS.values()):
        module = importlib.import_module(name)
        routes = {(r.path.replace("{model_id:path}", "{model_id}"), method, r.endpoint.__module__)
                  for r in module.router.routes for method in r.methods}
        assert routes == {(p, m, name) for (p, m), n in ENDPOINTS.items() if n == name}, name


def test_build_app_serves_exactly_the_routers_endpoints(checkpoint: Path) -> None:
    """The app's OpenAPI lists the endpoints and nothing else; app.py registers none itself; each
    endpoint answers through the app's shared state (a GET is served, a POST validated)."""
    from fastapi.routing import APIRoute

    from rtpcore import AsyncEngine
    from rtpcore.serving.app import build_app

    async def main() -> dict[str, Any]:
        engine = AsyncEngine.from_pretrained(checkpoint)
        try:
            app = build_app(engine, model_name="tiny")
            own = [r for r in app.router.routes if isinstance(r, APIRoute) and r.endpoint.__module__ == "rtpcore.serving.app"]
            assert own == []
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                assert (await client.get("/health")).json() == {"status": "ok"}
                assert "rtpcore_kv_blocks_total" in (await client.get("/metrics")).text
                assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tiny"
                for path in ("/v1/completions", "/v1/chat/completions"):
                    r = await client.post(path, json={"model": "tiny"})
                    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "messages"), r.text
            return app.openapi()
        finally:
            await engine.aclose()

    schema = asyncio.run(main())
    served = {(path, method.upper()) for path, item in schema["paths"].items() for method in item}
    assert served == set(ENDPOINTS)
