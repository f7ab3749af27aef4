"""OpenAI's request bodies: /v1/completions and /v1/chat/completions, with the SGLang and vLLM
extensions the server honours.

Every field OpenAI defines for an endpoint is declared (`OPENAI_*_FIELDS` below): honoured, or
accepted only as "off", so none of them is ever silently ignored. How bodies are validated (strict
types, unknown top-level fields dropped and reported) is validation.py's; the chat messages and
tools are messages.py's; SGLang's /generate and vLLM's /tokenize bodies are native_protocol.py's.
"""

from typing import Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dsv4_engine.server.messages import ChatMessage, ResponseFormat, Tool, ToolChoiceFunction, check_continue
from dsv4_engine.server.reasoning import ReasoningEffort, thinking_kwargs
from dsv4_engine.server.validation import (
    I64,
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    RequestBody,
    Strict,
    TokenIds,
    off,
    valid_logit_bias,
    valid_stop,
    valid_token_ids,
    valid_top_k,
)

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


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one constraint of json / regex / choice / json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    json_object: bool | None = None
    grammar: off(None) = None
    structural_tag: off(None) = None
    whitespace_pattern: off(None) = None
    disable_fallback: bool | None = None  # one backend here: nothing to fall back from
    disable_any_whitespace: off(None, True) = None  # JSON is always compact here
    disable_additional_properties: off(None, False) = None


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    seed: int | None = Field(None, ge=0, lt=I64)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # SGLang/vLLM extensions that the engine honours.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=I64)
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
    # vLLM's: the same constraints under its names (one constraint per request, any spelling), the
    # stop string kept in the text, words never generated, the only tokens generated.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    guided_grammar: off(None) = None
    guided_decoding_backend: off(None) = None
    guided_whitespace_pattern: off(None) = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    # Accepted only as "off".
    best_of: off(None, 1) = None
    no_stop_trim: off(None, False) = None
    ebnf: off(None) = None
    lora_path: off(None) = None
    session_params: off(None) = None
    return_hidden_states: off(None, False) = None
    data_parallel_rank: off(None, 0) = None
    service_tier: off(None, "auto", "default") = None
    # Accepted, and change nothing here (docs/server.md): nothing is stored (there is no route that
    # reads a stored completion back), metadata is the client's own label, and a prompt-cache key
    # only steers OpenAI's cache routing (this engine keeps no prefix cache across requests).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None

    _top_k = field_validator("top_k")(classmethod(lambda cls, v: valid_top_k(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: valid_stop(v)))
    _ids = field_validator("stop_token_ids", "allowed_token_ids")(
        classmethod(lambda cls, v: valid_token_ids(v))
    )
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: valid_logit_bias(v)))

    @field_validator("bad_words")
    @classmethod
    def _words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad words must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
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


class ChatCompletionRequest(SamplingRequest):
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
    # DeepSeek-V4's thinking levels (server/reasoning.py): none = off, minimal..high = high, xhigh/max = max
    reasoning_effort: ReasoningEffort | None = None
    verbosity: off(None) = None
    web_search_options: off(None) = None
    moderation: off(None) = None
    prompt_cache_options: off(None) = None
    prompt_cache_retention: off(None) = None

    @model_validator(mode="after")
    def _continue_needs_assistant(self) -> Self:
        check_continue(self.messages, self.continue_final_message, self.add_generation_prompt)
        return self

    @field_validator("reasoning_effort")
    @classmethod
    def _effort_agrees_with_thinking(cls, v: str | None, info: ValidationInfo) -> str | None:
        thinking_kwargs(info.data.get("chat_template_kwargs"), v)
        return v

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
        """chat_template_kwargs with `reasoning_effort` applied (server/reasoning.py)."""
        return thinking_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def thinking(self) -> bool:
        """Whether the chat template opens a thinking block (SGLang's `thinking`, vLLM's
        `enable_thinking`, in chat_template_kwargs, or a `reasoning_effort` other than none)."""
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
