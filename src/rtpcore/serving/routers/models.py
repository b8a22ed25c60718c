"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served (``--served-model-name``)
and its context length; another id is a 404 in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from rtpcore.serving.requests import check_model
from rtpcore.serving.state import Served, ServedDep

__all__ = ["router"]

router = APIRouter()


def _model(served: Served) -> dict[str, Any]:
    return {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "rtpcore",
            "max_model_len": served.max_model_len}


@router.get("/v1/models")
async def models(served: ServedDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model(served)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, served: ServedDep) -> dict[str, Any]:
    check_model(served, model_id)
    return _model(served)
