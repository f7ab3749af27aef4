"""Request models with OpenAI (and SGLang `/generate`, vLLM `/tokenize`) field names.

Every field a model declares is either honoured or rejected with a 400 that names it: fields we
cannot honour accept only the value that means "feature off" (sglang-router 0.3.2 re-serialises
requests and always sends some of those, e.g. `no_stop_trim: false`, `skip_special_tokens: true`).
Every field OpenAI defines for an endpoint is declared (`OPENAI_*_FIELDS` below), so none of them is
ever silently ignored. A top-level field the model does not declare is some other server's extension
(`nvext`, `return_routed_experts`): it is dropped and reported (`_Request.ignored_fields`; the routes
log it once and answer with an `x-dsv4-ignored-fields` header), as vLLM does. Nested objects
(`messages[i]`, `stream_options`, `sampling_params`) stay strict. Types are strict: `"16"` is not an
integer, `1` is not a boolean.
"""

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from dsv4_engine.server.errors import UNSUPPORTED_MARK

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_N = 128  # OpenAI's limit on choices per request
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5
LOGIT_BIAS_LIMIT = 100.0
_I64 = 2**63


# Every body field OpenAI's API reference defines (as openai-python 3.57's `CompletionCreateParams`
# types list them, plus `stream`). Each is declared on the model below: honoured, or refused unless
# "off". If one is ever left undeclared it is still refused (400 `unsupported_parameter`), not ignored.
OPENAI_COMPLETION_FIELDS: frozenset[str] = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
        "temperature", "top_p", "user",
    }
)  # fmt: skip
OPENAI_CHAT_FIELDS: frozenset[str] = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
        "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
        "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "response_format",
        "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options",
        "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options",
    }
)  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Request(_Strict):
    """A whole request body: undeclared top-level fields are dropped and listed in `ignored_fields`,
    except the ones OpenAI defines (`openai_fields`), which stay and fail as unsupported."""

    openai_fields: ClassVar[frozenset[str]] = frozenset()
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _drop_unknown(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        ignored: list[str] = []
        if isinstance(data, dict):
            known = cls.model_fields.keys() | cls.openai_fields
            ignored = [k for k in data if k not in known]
            if ignored:
                data = {k: v for k, v in data.items() if k in known}
        model = handler(data)
        model._ignored = ignored
        return model

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields of the request that this server does not know and did not use."""
        return list(self._ignored)


def _same(value: Any, ok: Any) -> bool:
    if isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    if isinstance(ok, float) and isinstance(value, int | float):
        return value == ok
    return type(value) is type(ok) and value == ok


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def off(*allowed: Any) -> Any:
    """Type of a field we cannot honour: only the listed 'feature off' values pass."""

    def check(value: Any) -> Any:
        if any(_same(value, ok) for ok in allowed):
            return value
        raise ValueError(f"is {UNSUPPORTED_MARK} (accepted: {', '.join(map(_show, allowed))})")

    return Annotated[Any, BeforeValidator(check)]


def _check_top_k(v: int | None) -> int | None:
    if v == 0:
        raise ValueError("top_k must be -1 (disabled) or at least 1")
    return v


def _check_stop(v: str | list[str] | None) -> str | list[str] | None:
    items = [v] if isinstance(v, str) else v or []
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise ValueError(f"stop sequences must be 1 to {MAX_STOP_LEN} characters")
    return v


def _check_token_ids(v: list[int] | None) -> list[int] | None:
    if v is not None and any(t < 0 or t >= _I64 for t in v):
        raise ValueError("token ids must be non-negative")
    return v


def _check_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    for key, bias in (v or {}).items():
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"bias values must be in [-100, 100], got {bias} for token {key}")
    return v


def logit_bias_ids(v: dict[str, float] | None) -> dict[int, float] | None:
    """The checked `logit_bias` with integer keys (JSON object keys are strings)."""
    return {int(k): float(b) for k, b in v.items()} if v else None


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk


class _Sampling(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    seed: int | None = Field(None, ge=0, lt=_I64)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # SGLang/vLLM extensions that the engine honours.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=_I64)
    # PD fields injected by sglang-router; the server's role decides whether they are accepted.
    # Arrays for a batched prompt (one room per prompt); server/pd.py checks values and lengths.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_pair_key: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    # vLLM's extensions, with its meanings.
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, lt=2**31)
    # SGLang's constraints (server/structured.py): a JSON Schema as a JSON string, or a regex.
    json_schema: str | None = None
    regex: str | None = None
    # Accepted only as "off".
    best_of: off(None, 1) = None
    no_stop_trim: off(None, False) = None
    ebnf: off(None) = None
    lora_path: off(None) = None
    session_params: off(None) = None
    return_hidden_states: off(None, False) = None
    data_parallel_rank: off(None, 0) = None
    service_tier: off(None, "auto", "default") = None
    store: off(None, False) = None
    metadata: off(None) = None
    prompt_cache_key: off(None) = None

    _top_k = field_validator("top_k")(classmethod(lambda cls, v: _check_top_k(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: _check_stop(v)))
    _ids = field_validator("stop_token_ids")(classmethod(lambda cls, v: _check_token_ids(v)))
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: _check_logit_bias(v)))

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


TokenIds = list[int]


class CompletionRequest(_Sampling):
    openai_fields = OPENAI_COMPLETION_FIELDS

    prompt: str | list[str] | TokenIds | list[TokenIds]
    # 0 only with echo (the prompt and, with logprobs, its logprobs; the route checks it).
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: off(None, "") = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def _text_only(value: Any) -> Any:
    if value != "text":
        raise ValueError(f"{value!r} is {UNSUPPORTED_MARK} (accepted: 'text')")
    return value


class TextPart(_Strict):
    type: Annotated[str, BeforeValidator(_text_only)]
    text: str


_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: `text`, `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only then")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # before `content`, whose check reads it
    content: str | list[TextPart] | None  # required, as in OpenAI's API; null only as below
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    # What the openai SDK's assistant message carries when a client sends it back as it came.
    refusal: off(None) = None
    annotations: off(None, []) = None

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


class ChatCompletionRequest(_Sampling):
    openai_fields = OPENAI_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # SGLang's: with thinking on (chat_template_kwargs), the reasoning goes to `reasoning_content`
    # unless separate_reasoning is false; stream_reasoning false sends it in one delta once it ends.
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    functions: off(None, []) = None
    function_call: off(None, "none") = None
    modalities: off(None, ["text"]) = None
    audio: off(None) = None
    prediction: off(None) = None
    reasoning_effort: off(None) = None
    verbosity: off(None) = None
    web_search_options: off(None) = None
    moderation: off(None) = None
    prompt_cache_options: off(None) = None
    prompt_cache_retention: off(None) = None

    @model_validator(mode="after")
    def _continue_needs_assistant(self) -> Self:
        check_continue(self.messages, self.continue_final_message, self.add_generation_prompt)
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if v == "required" and not names:
            raise ValueError("'required' needs tools")
        if isinstance(v, ToolChoiceFunction) and v.function.name not in names:
            raise ValueError(f"names function {v.function.name!r}, which is not in tools")
        return v

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})

    def thinking(self) -> bool:
        """Whether the chat template opens a thinking block (SGLang's `thinking`, vLLM's
        `enable_thinking`, in chat_template_kwargs)."""
        kw = self.template_kwargs()
        return bool(kw.get("thinking", kw.get("enable_thinking", False)))

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # 0 asks for nothing: tolerated without logprobs (routers may fill it in)
        if v and info.data.get("logprobs") is not True:
            raise ValueError("logprobs must be true when top_logprobs is given")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateSamplingParams(_Strict):
    """SGLang's `sampling_params` for `/generate`."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)  # SGLang sets no upper bound
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=_I64)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_new_tokens: int | None = Field(None, ge=0, lt=2**31)
    logit_bias: dict[str, float] | None = None
    spaces_between_special_tokens: off(None, True) = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    no_stop_trim: off(None, False) = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: off(None) = None
    custom_params: off(None) = None
    stream_interval: off(None, 1) = None

    _top_k = field_validator("top_k")(classmethod(lambda cls, v: _check_top_k(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: _check_stop(v)))
    _ids = field_validator("stop_token_ids")(classmethod(lambda cls, v: _check_token_ids(v)))
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: _check_logit_bias(v)))


class GenerateRequest(_Request):
    """SGLang's native `/generate` request (what sglang-router forwards to `/generate`)."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    model: str | None = None  # sglang-router adds `"model": null`
    sampling_params: GenerateSamplingParams | None = None
    stream: bool | None = None
    rid: str | list[str] | None = None
    log_metrics: bool | None = None
    no_logs: bool | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_pair_key: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = Field(None, ge=-1)  # -1 (SGLang's default): output tokens only
    top_logprobs_num: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    token_ids_logprob: off(None) = None
    return_text_in_logprobs: bool | None = None
    return_hidden_states: off(None, False) = None
    input_embeds: off(None) = None
    image_data: off(None) = None
    video_data: off(None) = None
    audio_data: off(None) = None
    modalities: off(None) = None
    session_params: off(None) = None
    lora_path: off(None) = None
    lora_id: off(None) = None
    custom_logit_processor: off(None) = None
    data_parallel_rank: off(None, 0) = None
    background: off(None, False) = None
    conversation_id: off(None) = None
    priority: off(None) = None
    extra_key: off(None) = None
    custom_labels: off(None) = None
    return_bytes: off(None, False) = None
    return_entropy: off(None, False) = None

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text must not be an empty list")
        ids = self.input_ids
        if ids is not None and (not ids or (isinstance(ids[0], list) and any(not p for p in ids))):
            raise ValueError("input_ids must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else list(self.text)
        ids = self.input_ids or []
        return [list(ids)] if isinstance(ids[0], int) else list(ids)  # type: ignore[arg-type]

    def is_batch(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))


class TokenizeRequest(_Request):
    """vLLM's `POST /tokenize`: `prompt` (text, as /v1/completions encodes it) or `messages` (through
    the chat template, as /v1/chat/completions does); exactly one of them (checked by the route)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None
    chat_template: off(None) = None
    tools: list[Tool] | None = None  # rendered by the chat template, as /v1/chat/completions does


class DetokenizeRequest(_Request):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: TokenIds
