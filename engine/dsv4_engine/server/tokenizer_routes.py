"""POST /tokenize and /detokenize in vLLM's shapes, with the tokenizer the generation routes use.

`/tokenize` with `prompt` gives the ids /v1/completions would feed the engine for that text (with
the tokenizer's special tokens, BOS, unless `add_special_tokens` is false); with `messages`, the ids
/v1/chat/completions would (the chat template already writes the special tokens). Either way
`count` equals the `usage.prompt_tokens` the generation route reports for the same input.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from dsv4_engine.server.call import context, report_ignored
from dsv4_engine.server.errors import bad_request, unavailable
from dsv4_engine.server.generation import check_token_ids
from dsv4_engine.server.messages import check_continue
from dsv4_engine.server.native_protocol import DetokenizeRequest, TokenizeRequest
from dsv4_engine.server.prompts import encode_messages, template_tools, tokenize_text
from dsv4_engine.server.state import ServerContext

router = APIRouter()

_INLINE_TOKENS = 4096  # decoding more than this inline would hold the event loop too long
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


def _ctx(request: Request) -> ServerContext:
    ctx = context(request)
    if ctx.tokenizer is None or ctx.facts is None:
        raise unavailable("the model is still loading", retry_after=5, code="server_loading")
    return ctx


async def _chat_ids(ctx: ServerContext, req: TokenizeRequest) -> list[int]:
    assert req.messages is not None
    if req.add_special_tokens:
        raise bad_request(
            "add_special_tokens=true is not supported with messages: the chat template already "
            "writes the special tokens",
            "add_special_tokens",
            "unsupported_parameter",
        )
    try:
        check_continue(req.messages, req.continue_final_message, req.add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), "continue_final_message") from exc
    return await encode_messages(
        ctx,
        req.messages,
        template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=template_tools(req.tools),
    )


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    report_ignored(request, req)
    ctx = _ctx(request)
    ctx.require_model(req.model)
    if req.prompt is not None and req.messages is not None:
        raise bad_request("give either prompt or messages, not both", "messages")
    if req.prompt is None and req.messages is None:
        raise bad_request("one of prompt or messages is required", "prompt", "missing_required_parameter")
    if req.prompt is not None:
        chat_only = next((f for f in _CHAT_ONLY if getattr(req, f) is not None), None)
        if chat_only is not None:
            raise bad_request(f"'{chat_only}' applies to messages, not to a prompt", chat_only)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await tokenize_text(ctx, req.prompt, add_special_tokens=add_special)
    else:
        ids = await _chat_ids(ctx, req)
    assert ctx.facts is not None
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.facts.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, str]:
    report_ignored(request, req)
    ctx = _ctx(request)
    ctx.require_model(req.model)
    check_token_ids(ctx, req.tokens, "tokens")
    if len(req.tokens) <= _INLINE_TOKENS:
        text = ctx.tokenizer.decode(req.tokens)
    else:
        text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens)
    return {"prompt": text}
