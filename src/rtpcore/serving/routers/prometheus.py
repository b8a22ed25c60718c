"""``GET /metrics``: the server's metrics (``serving.metrics.ServerMetrics``) in Prometheus'
text format. No API key needed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rtpcore.serving.state import ServedDep

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics")
async def metrics(served: ServedDep) -> Response:
    return Response(served.metrics.render(), media_type="text/plain; version=0.0.4")
