"""``GET /version`` (vLLM's): the version of rtpcore serving. No API key needed."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter

__all__ = ["router"]

router = APIRouter()


@router.get("/version")
async def rtpcore_version() -> dict[str, str]:
    return {"version": version("rtpcore")}
