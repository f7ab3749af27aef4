"""A request's grammar: `response_format` and a forced `tool_choice` (chat), or SGLang's `json_schema`
and `regex` (every generation endpoint), as llguidance grammar text.

`json_object` is any JSON object; `json_schema` is its schema (checked as a JSON Schema first, so a
bad one is a 400 naming `response_format`); `tool_choice` `required` (any of the tools) or a named
function forces one DSML `<｜DSML｜tool_calls>` block (server/tool_parser.py) whose invokes carry their
arguments as one JSON object valid against the function's `parameters` (DeepSeek-V4's direct-JSON
invoke form, which its parsers read beside the parameter-tag form). With thinking on, the grammar
first closes the thinking block, so the constrained answer is the content, not the reasoning.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from dsv4_engine.grammar import check_grammar, json_grammar, json_rule
from dsv4_engine.server.errors import bad_request
from dsv4_engine.server.protocol import ChatCompletionRequest, Tool, ToolChoiceFunction
from dsv4_engine.server.tool_parser import BLOCK_END, BLOCK_START, INVOKE_END, invoke_start
from dsv4_engine.tokenizer import DSML, END_THINK

MAX_FORCED_CALLS = 8  # `required` with parallel calls: a bound, so even a random model ends the block


# llguidance matches the tokenizer's added tokens (`</think>`, `｜DSML｜`) only as tokens, written
# `<[id]>` in Lark; text around them is a string literal.
Controls = Mapping[str, int]
_CONTROLS = re.compile(f"({re.escape(END_THINK)}|{re.escape(DSML)})")


def _lit(text: str, controls: Controls) -> str:
    """Lark items matching `text`, its control tokens as the tokens (spelt out where absent)."""
    items = []
    for part in _CONTROLS.split(text):
        if part in controls:
            items.append(f"<[{controls[part]}]>")
        elif part:
            items.append(json.dumps(part, ensure_ascii=False))
    return " ".join(items)


def control_tokens(tokenizer: Any) -> dict[str, int]:
    """The ids of the control tokens this tokenizer has as single tokens."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (END_THINK, DSML)}
    return {t: i for t, i in ids.items() if isinstance(i, int) and i != tokenizer.unk_token_id}


def _check_schema(schema: dict[str, Any], param: str) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise bad_request(f"invalid JSON Schema: {exc.message}", param) from exc


def forced_tools(req: ChatCompletionRequest) -> list[Tool]:
    """The tools the grammar must call one of: all for `required`, one for a named choice, none else."""
    choice, tools = req.tool_choice, req.tools or []
    if choice == "required":
        return tools
    if isinstance(choice, ToolChoiceFunction):
        return [t for t in tools if t.function.name == choice.function.name]
    return []


def tool_grammar(tools: list[Tool], parallel: bool, controls: Controls) -> str:
    rules = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters or {"type": "object"}
        _check_schema(params, "tools")
        head, tail = _lit(invoke_start(tool.function.name), controls), _lit(f"\n{INVOKE_END}\n", controls)
        rules.append(f"call_{i}: {head} args_{i} {tail}\nargs_{i}: {json_rule(params)}")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    count = f"{{1,{MAX_FORCED_CALLS}}}" if parallel else ""
    start = f"start: {_lit(BLOCK_START + chr(10), controls)} call{count} {_lit(BLOCK_END, controls)}\n"
    start += f"call: {calls}\n"
    return start + "\n".join(rules) + "\n"


def chat_grammar(req: ChatCompletionRequest, controls: Controls) -> str | None:
    """The request's grammar, or None when its output is free; 400 for a schema llguidance refuses."""
    forced = forced_tools(req)
    param = "tool_choice" if forced else "response_format"
    rf = req.response_format
    if forced:
        grammar = tool_grammar(forced, req.parallel_tool_calls is not False, controls)
    elif rf is None or rf.type == "text":
        return None
    elif rf.type == "json_object":
        grammar = json_grammar({"type": "object"})
    else:
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_ or {}
        _check_schema(schema, param)
        grammar = json_grammar(schema)
    if req.thinking():
        # `%json` must be a rule's whole body: the old start becomes a rule of its own
        grammar = f"start: {_lit(END_THINK, controls)} answer\n" + grammar.replace("start: ", "answer: ", 1)
    err = check_grammar(grammar)
    if err:
        raise bad_request(f"this schema cannot be enforced: {err}", param)
    return grammar


def sglang_grammar(json_schema: str | None, regex: str | None, prefix: str = "") -> str | None:
    """SGLang's constraint fields: `json_schema` (a JSON Schema as a JSON string) or `regex`."""
    from llguidance import LLMatcher

    if json_schema is not None and regex is not None:
        raise bad_request("give one of json_schema and regex", f"{prefix}regex")
    if json_schema is not None:
        param = f"{prefix}json_schema"
        try:
            schema = json.loads(json_schema)
        except ValueError as exc:
            raise bad_request(f"not JSON: {exc}", param) from exc
        if not isinstance(schema, dict):
            raise bad_request("a JSON Schema must be an object", param)
        _check_schema(schema, param)
        grammar = json_grammar(schema)
    elif regex is not None:
        param = f"{prefix}regex"
        grammar = LLMatcher.grammar_from_regex(regex)
    else:
        return None
    err = check_grammar(grammar)
    if err:
        raise bad_request(f"this constraint cannot be enforced: {err}", param)
    return grammar
