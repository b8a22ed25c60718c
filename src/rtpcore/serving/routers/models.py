"""``GET /v1/models``: the one model served (``--served-model-name``) and its context length."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from rtpcore.serving.state import ServedDep

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models")
async def models(served: ServedDep) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "rtpcore",
         "max_model_len": served.max_model_len}
    ]}
