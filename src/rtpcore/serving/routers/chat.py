"""``POST /v1/chat/completions``: the tool plan and ``response_format`` grammar, the conversation
rendered as ``Engine.chat`` renders it (in a worker thread, never on the event loop) -> SamplingParams
-> the answer, whole or streamed, with tool calls when the request has tools."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request

from rtpcore.serving.protocol import ChatCompletionRequest
from rtpcore.serving.requests import (
    body_grammar,
    check_limits,
    check_model,
    check_text_needs,
    params_for,
    render_chat,
    tool_plan,
)
from rtpcore.serving.state import ServedDep, body_openapi, json_body
from rtpcore.serving.streaming import respond

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, openapi_extra=body_openapi(ChatCompletionRequest))
async def chat_completions(body: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)], request: Request, served: ServedDep) -> Any:
    check_model(served, body.model)
    check_limits(served, body)
    check_text_needs(served, body)
    tools, grammar = await asyncio.to_thread(tool_plan, served, body)
    if grammar is None:
        grammar = await asyncio.to_thread(body_grammar, served, body)
    prompt = await asyncio.to_thread(render_chat, served, body)
    params = params_for(served, body, prompt, grammar)
    return await respond(served, request, body, prompt, params, chat=True, tools=tools)
