"""A request's grammar: `response_format` and a forced `tool_choice` (chat), SGLang's `json_schema`
and `regex` (every generation endpoint), or vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`structured_outputs` (completions and chat), as llguidance grammar text. One constraint a request.

`json_object` is any JSON object; `json_schema` is its schema (checked as a JSON Schema first, so a
bad one is a 400 naming `response_format`); `tool_choice` `required` (any of the tools) or a named
function forces one DSML `<｜DSML｜tool_calls>` block (server/tool_parser.py) whose invokes carry their
arguments as one JSON object valid against the function's `parameters` (DeepSeek-V4's direct-JSON
invoke form, which its parsers read beside the parameter-tag form). With thinking on, the grammar
lets the model think first, freely, and constrains what follows `</think>` (vLLM's and SGLang's
reasoning-aware structured output): the reasoning is any text without `</think>`, the answer is the
constrained content.
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
        grammar = after_thinking(grammar, controls)
    err = check_grammar(grammar)
    if err:
        raise bad_request(f"this schema cannot be enforced: {err}", param)
    return grammar


# The reasoning: any text that does not spell `</think>` (the tokens of the text exclude the control
# token too, which llguidance only matches as `<[id]>`).
_REASONING = "THOUGHT: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/\n"


def after_thinking(grammar: str, controls: Controls) -> str:
    """`grammar` as the answer after a free reasoning block closed by `</think>` (the chat template
    already opened it). `%json` must be a rule's whole body: the old start becomes a rule of its own."""
    answer = grammar.replace("start: ", "answer: ", 1)
    return f"start: THOUGHT {_lit(END_THINK, controls)} answer\n{_REASONING}{answer}"


def choice_grammar(choices: list[str]) -> str:
    """The output is exactly one of `choices` (vLLM's guided_choice)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + "\n"


def _schema_grammar(value: dict[str, Any] | str, param: str) -> str:
    """A JSON Schema, as an object or as its JSON text, to a grammar; 400 naming `param` if it is none."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"not JSON: {exc}", param) from exc
    if not isinstance(value, dict):
        raise bad_request("a JSON Schema must be an object", param)
    _check_schema(value, param)
    return json_grammar(value)


def _regex_grammar(pattern: str) -> str:
    """The output matches `pattern` whole: llguidance's own Lark for it (it escapes the pattern)."""
    from llguidance import LLMatcher

    return json.loads(LLMatcher.grammar_from_regex(pattern))["grammars"][0]["lark_grammar"] + "\n"


def constraint_grammar(fields: Any, prefix: str = "") -> str | None:
    """The one output constraint of a request's fields, whichever server's spelling it uses:
    SGLang's `json_schema` (a JSON Schema as JSON text) and `regex`; on the OpenAI bodies also vLLM's
    `guided_json`, `guided_regex`, `guided_choice` and `structured_outputs.{json, regex, choice,
    json_object}`. Two constraints are a 400 naming the second; so is one llguidance refuses."""
    given: list[tuple[str, Any]] = []
    for name in ("json_schema", "regex", "guided_json", "guided_regex", "guided_choice"):
        value = getattr(fields, name, None)
        if value is not None:
            given.append((f"{prefix}{name}", value))
    so = getattr(fields, "structured_outputs", None)
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice)):
            if value is not None:
                given.append((f"{prefix}structured_outputs.{name}", value))
        if so.json_object:
            given.append((f"{prefix}structured_outputs.json_object", {"type": "object"}))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {given[0][0]} and {given[1][0]}", given[1][0])
    param, value = given[0]
    kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind in ("json_schema", "json", "json_object"):
        grammar = _schema_grammar(value, param)
    elif kind == "regex":
        grammar = _regex_grammar(value)
    else:
        grammar = choice_grammar(value)
    err = check_grammar(grammar)
    if err:
        raise bad_request(f"this constraint cannot be enforced: {err}", param)
    return grammar
