"""``POST /v1/completions``: a prompt (text, encoded in a worker thread by the batch encoder, which
releases the GIL, after a check of its length in characters; or token ids) and its
``response_format`` grammar -> SamplingParams -> the answer, whole or streamed."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request

from rtpcore.engine.text.prompts import Prompt
from rtpcore.errors import InvalidRequestError
from rtpcore.serving.errors import ApiError
from rtpcore.serving.protocol import CompletionRequest
from rtpcore.serving.requests import (
    body_grammar,
    check_limits,
    check_model,
    check_text_needs,
    params_for,
)
from rtpcore.serving.state import ServedDep, body_openapi, json_body
from rtpcore.serving.streaming import respond

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions", response_model=None, openapi_extra=body_openapi(CompletionRequest))
async def completions(body: Annotated[CompletionRequest, json_body(CompletionRequest)], request: Request, served: ServedDep) -> Any:
    check_model(served, body.model)
    check_limits(served, body)
    check_text_needs(served, body)
    if isinstance(body.prompt, str):  # encoded as Engine.generate encodes text (the checkpoint's BOS rule)
        try:  # a text certain to be over max_model_len tokens is refused unencoded (TextSide.check_length)
            prompt = (await asyncio.to_thread(served.text.encode, [body.prompt], field="prompt"))[0]
        except InvalidRequestError as exc:
            raise ApiError.invalid_request(exc) from None
    else:
        prompt = Prompt(None, tuple(body.prompt))
        if served.vocab_size is not None and max(prompt.token_ids) >= served.vocab_size:
            raise ApiError(400, f"prompt: token id {max(prompt.token_ids)} is not below the vocabulary size "
                                f"{served.vocab_size}", param="prompt")
    grammar = await asyncio.to_thread(body_grammar, served, body)
    params = params_for(served, body, prompt, grammar)
    return await respond(served, request, body, prompt, params, chat=False)
