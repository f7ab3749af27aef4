"""Prompts to token ids: plain text, token ids, and chat messages through the tokenizer's template."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

from dsv4_engine.server.errors import bad_request
from dsv4_engine.server.generation import check_token_ids
from dsv4_engine.server.messages import ChatMessage, Tool
from dsv4_engine.server.protocol import ChatCompletionRequest
from dsv4_engine.server.state import ServerContext

# Tokenising this much text inline would hold the event loop for more than about a millisecond.
_INLINE_CHARS = 2048
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


async def tokenize_text(ctx: ServerContext, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The text's ids. A text that already starts with the BOS token (a client that decoded its own
    token ids, such as lm-eval's `tokenized_requests=False` with `add_bos_token=True`) is not given a
    second one, so its ids are the client's and its echoed logprobs line up with them."""
    if len(text) <= _INLINE_CHARS:
        ids = ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        ids = await asyncio.to_thread(ctx.tokenizer.encode, text, add_special_tokens=add_special_tokens)
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    if add_special_tokens and bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return list(ids)


async def encode_prompt(ctx: ServerContext, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, list):
        check_token_ids(ctx, prompt, param)
        return prompt
    ids = await tokenize_text(ctx, prompt)
    if not ids:
        raise bad_request("the prompt is empty after tokenisation", param)
    return ids


def _arguments(text: str, index: int) -> dict[str, Any]:
    # The template writes each argument as a DSML parameter, so it needs them as an object.
    try:
        args = json.loads(text)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad_request(
            f"messages[{index}].tool_calls: function.arguments must be a JSON object", "messages"
        )
    return args


@functools.cache
def template_text(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it is a template (it holds `{{` or
    `{%`), as vLLM reads its flag; ValueError for anything else. Read once."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{value}: {exc}") from exc
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{value}: no such file, and not a Jinja template")


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """OpenAI `tools` as the chat template reads them (HF's convention: a list of dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
) -> list[int]:
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    cont = bool(continue_final_message)
    add_prompt = (not cont) if add_generation_prompt is None else add_generation_prompt
    rendered = _messages(messages)
    if tools:
        kwargs["tools"] = tools
    try:
        encoded = tokenizer.apply_chat_template(
            rendered,
            add_generation_prompt=add_prompt,
            continue_final_message=cont,
            tokenize=True,
            return_dict=True,
            # Special tokens typed into messages stay text: users cannot forge turns or EOS.
            sanitize_control_tokens=True,
            chat_template=template,  # --chat-template's, else (None) the tokenizer's
            **kwargs,
        )
    except Exception as exc:  # jinja raise_exception(), bad kwargs: the request is at fault
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    ids = encoded["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


async def encode_messages(
    ctx: ServerContext,
    messages: list[ChatMessage],
    *,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Messages through the tokenizer's chat template, exactly as /v1/chat/completions feeds them."""
    flag = ctx.settings.chat_template
    template = template_text(flag) if flag is not None else None
    if template is None and getattr(ctx.tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    ids = await asyncio.to_thread(
        _render_chat,
        ctx.tokenizer,
        messages,
        template_kwargs,
        add_generation_prompt,
        continue_final_message,
        tools,
        template,
    )
    if not ids:
        raise bad_request("the chat template produced an empty prompt", "messages")
    return ids


async def encode_chat(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    return await encode_messages(
        ctx,
        req.messages,
        template_kwargs=req.template_kwargs(),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        # tool_choice "none": the model is not told about the tools at all
        tools=template_tools(req.tools) if req.tool_choice != "none" else None,
    )
