"""Chat messages and tools, as OpenAI's chat completions body carries them (also /tokenize's)."""

from typing import Annotated, Any, Literal, Self

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from dsv4_engine.server.errors import UNSUPPORTED_MARK
from dsv4_engine.server.validation import Strict, off


def _text_only(value: Any) -> Any:
    if value != "text":
        raise ValueError(f"{value!r} is {UNSUPPORTED_MARK} (accepted: 'text')")
    return value


# Anthropic-style prompt-caching marks (`{"type": "ephemeral"}`) that LiteLLM and agent frameworks put
# on messages and parts: accepted and ignored, harmlessly (this engine keeps no prefix cache).
CacheControl = dict[str, Any] | None


class TextPart(Strict):
    type: Annotated[str, BeforeValidator(_text_only)]
    text: str
    cache_control: CacheControl = None


_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's `response_format`: `text`, `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only then")
        return self


class FunctionDef(Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(Strict):
    index: int | None = None  # what a client that joined stream deltas sends back
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # before `content`, whose check reads it
    content: str | list[TextPart] | None  # required, as in OpenAI's API; null only as below
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    # What the openai SDK's assistant message carries when a client sends it back as it came.
    refusal: off(None) = None
    annotations: off(None, []) = None
    audio: off(None) = None
    function_call: off(None) = None  # the deprecated form of tool_calls: only its null
    cache_control: CacheControl = None

    @model_validator(mode="before")
    @classmethod
    def _content_optional_with_tool_calls(cls, data: Any) -> Any:
        # OpenAI lets an assistant message with tool_calls leave content out.
        if isinstance(data, dict) and "content" not in data and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _tool_fields(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content")
    @classmethod
    def _null_only_with_tool_calls(cls, v: Any, info: ValidationInfo) -> Any:
        # OpenAI refuses a null content except in an assistant message that carries tool_calls.
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError(
                "must be a string or a list of content parts; null is allowed only in an assistant "
                "message with tool_calls"
            )
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


def check_continue(messages: list[ChatMessage], cont: bool | None, add_prompt: bool | None) -> None:
    """`continue_final_message` continues the last message, which must be the assistant's."""
    if cont and messages[-1].role != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    if cont and add_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
