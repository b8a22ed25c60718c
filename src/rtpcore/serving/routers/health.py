"""``GET /health``: 200 ``{"status": "ok"}`` while the engine can serve, 503 naming its failure
once it cannot (closed, its loop broke, a rank failed). No API key needed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rtpcore.serving.state import ServedDep

__all__ = ["router"]

router = APIRouter()


@router.get("/health", response_model=None)
async def health(served: ServedDep) -> Any:
    failure = served.engine.failure
    if failure is not None:  # closed, its loop broke or a rank failed: every request would fail now
        return JSONResponse({"status": "error", "message": str(failure)}, status_code=503)
    return {"status": "ok"}
