"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the server's own encoding -- a prompt as
/v1/completions encodes it, messages as /v1/chat/completions renders them -- and its decoding,
in a worker thread."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter

from rtpcore.serving.errors import ApiError
from rtpcore.serving.protocol import DetokenizeRequest, TokenizeRequest
from rtpcore.serving.requests import check_model, render_messages
from rtpcore.serving.state import Served, ServedDep, body_openapi, json_body

__all__ = ["router"]

router = APIRouter()


@router.post("/tokenize", openapi_extra=body_openapi(TokenizeRequest))
async def tokenize(body: Annotated[TokenizeRequest, json_body(TokenizeRequest)], served: ServedDep) -> dict[str, Any]:
    if body.model is not None:
        check_model(served, body.model)
    tokens = await asyncio.to_thread(_encode, served, body)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": served.max_model_len}


def _encode(served: Served, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        tok = served.require_tokenizer("tokenize", "prompt")
        return list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False))
    served.require_tokenizer("tokenize", "messages")
    assert body.messages is not None
    kwargs = body.chat_template_kwargs or {}
    prompt = render_messages(served, body.messages, add_generation_prompt=body.add_generation_prompt is not False,
                             template_kwargs=dict(kwargs), reserved_in=kwargs,
                             check_length=False)  # counted, not run: over max_model_len is counted too
    return list(prompt.token_ids)


@router.post("/detokenize", openapi_extra=body_openapi(DetokenizeRequest))
async def detokenize(body: Annotated[DetokenizeRequest, json_body(DetokenizeRequest)], served: ServedDep) -> dict[str, Any]:
    if body.model is not None:
        check_model(served, body.model)
    tok = served.require_tokenizer("detokenize", "tokens")
    size = max(served.vocab_size or 0, tok.vocab_size)
    if body.tokens and max(body.tokens) >= size:
        raise ApiError(400, f"tokens: token id {max(body.tokens)} is not below the vocabulary size {size}",
                       param="tokens")
    text = await asyncio.to_thread(tok.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}
