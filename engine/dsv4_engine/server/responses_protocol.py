"""OpenAI's Responses API request body (`POST /v1/responses`), validated as the chat body is
(validation.py): every field OpenAI defines is declared, honoured or accepted only as "off", so none
is ever silently ignored; unknown top-level fields are dropped and reported.

Input items: `message` (roles user, system, developer, assistant; text parts), `function_call`,
`function_call_output` and `reasoning` (its text goes back as the assistant turn's reasoning). Tools:
`function` only. What the server makes of them is responses.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from dsv4_engine.server.errors import UNSUPPORTED_MARK
from dsv4_engine.server.messages import _NAME, CacheControl
from dsv4_engine.server.reasoning import ReasoningEffort
from dsv4_engine.server.validation import (
    I64,
    RequestBody,
    Strict,
    off,
    valid_logit_bias,
    valid_stop,
    valid_top_k,
)

# openai-python 3.60's `ResponseCreateParams` fields, plus `stream` (a test checks the list).
OPENAI_RESPONSES_FIELDS: frozenset[str] = frozenset(
    {
        "access_programs", "background", "background_options", "context_management", "conversation",
        "image", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata",
        "model", "moderation", "parallel_tool_calls", "previous_response_id", "prompt",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning",
        "safety_identifier", "service_tier", "store", "stream", "stream_options", "temperature", "text",
        "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
    }
)  # fmt: skip


def _only(*accepted: str) -> Any:
    """A `type` tag of which only `accepted` are served: another is a 400 naming it unsupported."""

    def check(value: Any) -> Any:
        if value not in accepted:
            raise ValueError(f"{value!r} is {UNSUPPORTED_MARK} (accepted: {', '.join(map(repr, accepted))})")
        return value

    return Annotated[str, BeforeValidator(check)]


class TextPart(Strict):
    """`input_text` (user, system, developer) or `output_text` (assistant, as a response gave it)."""

    type: _only("input_text", "output_text")
    text: str
    annotations: off(None, []) = None
    logprobs: list[Any] | None = None  # an output_text sent back as it came
    cache_control: CacheControl = None


class MessageItem(Strict):
    type: Literal["message"] | None = None  # OpenAI's "easy" input message leaves it out
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None
    status: str | None = None
    namespace: off(None) = None
    caller: off(None) = None
    async_: off(None, False) = Field(None, alias="async")


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """A reasoning item a response gave, sent back: its text is the assistant turn's reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: off(None) = None  # never issued here: reasoning comes back in `content`
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class OtherItem(Strict):
    """Any other item type (`item_reference`, hosted tools' calls, ...): refused, naming its type."""

    model_config = ConfigDict(extra="allow")
    type: _only(*_ITEMS)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    kind = kind or "message"
    return f"item:{kind if kind in _ITEMS else 'other'}"  # not an identifier: left out of `param`


InputItem = Annotated[
    Annotated[MessageItem, Tag("item:message")]
    | Annotated[FunctionCallItem, Tag("item:function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item:function_call_output")]
    | Annotated[ReasoningItem, Tag("item:reasoning")]
    | Annotated[OtherItem, Tag("item:other")],
    Discriminator(_item_kind),
]


class FunctionTool(Strict):
    type: _only("function")
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    output_schema: dict[str, Any] | None = None  # describes the tool's own output: nothing to do here
    defer_loading: off(None, False) = None
    allowed_callers: off(None) = None
    async_: off(None, False) = Field(None, alias="async")


class NamedTool(Strict):
    type: _only("function")
    name: str


class Format(Strict):
    """`text.format`: text, json_object or json_schema (flat, unlike chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Format | None = None
    verbosity: off(None, "medium") = None


class ReasoningConfig(Strict):
    effort: ReasoningEffort | None = None
    # DeepSeek writes its whole reasoning, returned as the reasoning item's `content`; there is no
    # summariser, so only "auto" (whatever is available: none) is accepted.
    summary: off(None, "auto") = None
    generate_summary: off(None) = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # padding against length side channels: none is added


class ResponsesRequest(RequestBody):
    openai_fields = OPENAI_RESPONSES_FIELDS

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # OpenAI's default: true (kept in memory, bounded: responses.py)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # Reasoning items always carry their text, which serves what encrypted content serves elsewhere.
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Extensions, as on chat (vLLM's and SGLang's Responses bodies carry the same).
    seed: int | None = Field(None, ge=0, lt=I64)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # PD fields, as on chat: a router that forwards /v1/responses to a prefill/decode pair adds them.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_pair_key: str | None = None
    # Accepted only as "off".
    background: off(None, False) = None
    conversation: off(None) = None
    context_management: off(None) = None
    max_tool_calls: off(None) = None
    prompt: off(None) = None
    prompt_cache_retention: off(None) = None
    prompt_cache_options: off(None) = None
    service_tier: off(None, "auto", "default") = None
    top_logprobs: off(None, 0) = None
    truncation: off(None, "disabled") = None
    moderation: off(None) = None
    image: off(None) = None
    access_programs: off(None) = None
    background_options: off(None) = None

    _top_k = field_validator("top_k")(classmethod(lambda cls, v: valid_top_k(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: valid_stop(v)))
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: valid_logit_bias(v)))

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if not v:
            raise ValueError("input must not be empty")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, v: Any, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        if v == "required" and not names:
            raise ValueError("'required' needs tools")
        if isinstance(v, NamedTool) and v.name not in names:
            raise ValueError(f"names function {v.name!r}, which is not in tools")
        return v

    @field_validator("tools")
    @classmethod
    def _distinct(cls, v: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [t.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        return v

    def stored(self) -> bool:
        return self.store is not False
