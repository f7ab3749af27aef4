"""Request bodies of the routes beyond OpenAI's: SGLang's native `/generate`, vLLM's `/tokenize` and
`/detokenize`. Validated as the OpenAI ones are (validation.py)."""

from typing import Any, Self

from pydantic import Field, field_validator, model_validator

from dsv4_engine.server.messages import ChatMessage, Tool
from dsv4_engine.server.validation import (
    I64,
    MAX_CHAT_TOP_LOGPROBS,
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


class GenerateSamplingParams(Strict):
    """SGLang's `sampling_params` for `/generate`."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)  # SGLang sets no upper bound
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=I64)
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

    _top_k = field_validator("top_k")(classmethod(lambda cls, v: valid_top_k(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: valid_stop(v)))
    _ids = field_validator("stop_token_ids")(classmethod(lambda cls, v: valid_token_ids(v)))
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: valid_logit_bias(v)))


class GenerateRequest(RequestBody):
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


class TokenizeRequest(RequestBody):
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


class DetokenizeRequest(RequestBody):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: TokenIds
