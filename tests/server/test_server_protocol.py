"""Request validation: every declared field is honoured or rejected with a 400 naming it; unknown
top-level fields are dropped and listed."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dsv4_engine.server.errors import ApiError, from_validation_errors
from dsv4_engine.server.metrics import ServerMetrics
from dsv4_engine.server.native_protocol import GenerateRequest
from dsv4_engine.server.protocol import (
    OPENAI_CHAT_FIELDS,
    OPENAI_COMPLETION_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from dsv4_engine.server.responses_protocol import OPENAI_RESPONSES_FIELDS, ResponsesRequest

USER = [{"role": "user", "content": "hi"}]


def _error(model: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return from_validation_errors(info.value.errors())


@pytest.mark.parametrize(
    ("model", "body", "param", "code"),
    [
        (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
        (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
        (
            CompletionRequest,
            {"prompt": "x", "stream_options": {"x": 1}},
            "stream_options.x",
            "unknown_parameter",
        ),
        (CompletionRequest, {"prompt": "x", "max_tokens": "16"}, "max_tokens", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "n": 0}, "n", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "logprobs": 6}, "logprobs", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"1": -101}}, "logit_bias", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens", "invalid_value"),
        (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        (
            ChatCompletionRequest,
            {"messages": USER, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "invalid_value",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "repetition_penalty": 0},
            "repetition_penalty",
            "invalid_value",
        ),
        (ChatCompletionRequest, {"messages": USER, "n": 129}, "n", "invalid_value"),
        (
            GenerateRequest,
            {"text": "x", "sampling_params": {"min_p": -0.1}},
            "sampling_params.min_p",
            "invalid_value",
        ),
        (
            GenerateRequest,
            {"text": "x", "sampling_params": {"n": 129}},
            "sampling_params.n",
            "invalid_value",
        ),
        (CompletionRequest, {"prompt": "x", "temperature": 2.5}, "temperature", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "top_k": 0}, "top_k", "invalid_value"),
        (CompletionRequest, {"prompt": "x", "stream": 1}, "stream", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "stop": ["a", ""]}, "stop", "invalid_value"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt", "invalid_type"),
        (CompletionRequest, {"prompt": []}, "prompt", "invalid_value"),
        (CompletionRequest, {}, "prompt", "missing_required_parameter"),
        (
            ChatCompletionRequest,
            {"messages": USER, "tools": [{"type": "function"}]},
            "tools[0].function",
            "missing_required_parameter",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "response_format": {"type": "json_schema"}},
            "response_format",
            "invalid_value",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "tool_choice": "required"},
            "tool_choice",
            "invalid_value",
        ),
        (ChatCompletionRequest, {"messages": []}, "messages", "invalid_value"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": None}]},
            "messages[0].content",
            "invalid_value",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": None}]},
            "messages[1].content",
            "invalid_value",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user"}]},
            "messages[0].content",
            "missing_required_parameter",
        ),
        (
            # The one null OpenAI allows (an assistant turn with tool_calls), with a malformed call.
            ChatCompletionRequest,
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0].type",
            "missing_required_parameter",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "prompt_cache_retention": "24h"},
            "prompt_cache_retention",
            "unsupported_parameter",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0]",
            "invalid_value",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            GenerateRequest,
            {"text": "x", "token_ids_logprob": [1]},
            "token_ids_logprob",
            "unsupported_parameter",
        ),
        (
            GenerateRequest,
            {"text": "x", "sampling_params": {"n": 129}},
            "sampling_params.n",
            "invalid_value",
        ),
        (
            GenerateRequest,
            {"text": "x", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
            "invalid_value",
        ),
    ],
)
def test_rejections_name_the_field(model: Any, body: dict[str, Any], param: str, code: str) -> None:
    err = _error(model, body)
    assert err.status == 400
    assert (err.param, err.code) == (param, code)
    assert param in err.message


def test_stream_options_require_stream() -> None:
    err = _error(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert err.status == 400 and "stream_options" in err.message


def test_unknown_top_level_fields_are_dropped_and_listed() -> None:
    body = {"prompt": "x", "nvext": {"ignore_eos": True}, "return_routed_experts": False, "max_tokens": 2}
    req = CompletionRequest.model_validate(body)
    assert req.ignored_fields == ["nvext", "return_routed_experts"]  # in the request's order
    assert req.max_tokens == 2 and not hasattr(req, "nvext")
    assert CompletionRequest.model_validate({"prompt": "x"}).ignored_fields == []
    chat = ChatCompletionRequest.model_validate({"messages": USER, "chat_id": 1})
    assert chat.ignored_fields == ["chat_id"]
    gen = GenerateRequest.model_validate({"text": "x", "return_routed_experts": False, "lora_path": None})
    assert gen.ignored_fields == ["return_routed_experts"]  # lora_path is declared (null = off)


def test_every_openai_field_is_declared() -> None:
    # openai-python's own lists of request fields: each must be honoured or refused, never ignored.
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    for params, ours, model in (
        (completion.CompletionCreateParamsBase, OPENAI_COMPLETION_FIELDS, CompletionRequest),
        (chat.CompletionCreateParamsBase, OPENAI_CHAT_FIELDS, ChatCompletionRequest),
        (responses.ResponseCreateParamsBase, OPENAI_RESPONSES_FIELDS, ResponsesRequest),
    ):
        assert set(params.__annotations__) | {"stream"} <= ours
        assert ours <= set(model.model_fields), sorted(ours - set(model.model_fields))
        assert model.openai_fields == ours


def test_an_undeclared_openai_field_is_refused_not_ignored() -> None:
    class Newer(CompletionRequest):  # as if OpenAI added a field the model does not declare yet
        openai_fields = OPENAI_COMPLETION_FIELDS | {"new_knob"}

    err = _error(Newer, {"prompt": "x", "new_knob": 1})
    assert (err.param, err.code) == ("new_knob", "unsupported_parameter")


def test_generate_needs_exactly_one_input() -> None:
    assert "text or input_ids" in _error(GenerateRequest, {"sampling_params": {}}).message
    assert "text or input_ids" in _error(GenerateRequest, {"text": "a", "input_ids": [1]}).message


def test_router_defaults_are_accepted() -> None:
    # sglang-router 0.3.2 re-serialises requests with these defaults filled in.
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "model": "m",
            "logprobs": False,
            "stream": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "continue_final_message": False,
            "skip_special_tokens": True,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "return_hidden_states": False,
            "bootstrap_host": "10.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": 2**63 + 5,
        }
    )
    assert chat.bootstrap_room == 2**63 + 5
    CompletionRequest.model_validate(
        {
            "prompt": "x",
            "model": "m",
            "stream": False,
            "echo": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "return_hidden_states": False,
        }
    )
    GenerateRequest.model_validate(
        {
            "text": "x",
            "stream": False,
            "log_metrics": True,
            "return_hidden_states": False,
            "background": False,
            "no_logs": False,
            "return_bytes": False,
            "return_entropy": False,
            "return_text_in_logprobs": False,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": False},
        }
    )


def test_prompt_forms() -> None:
    assert CompletionRequest.model_validate({"prompt": "a"}).prompts() == ["a"]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]


def test_metrics_render_engine_snapshot() -> None:
    snapshot = {
        "num_running": 3,
        "num_waiting": 2,
        "num_preemptions": 7,
        "prompt_tokens_total": 100,
        "generation_tokens_total": 50,
        "pool_usage/swa": 0.25,
        "pool_usage/c4": 0.5,
        "decode_batch_size": 4,
    }
    m = ServerMetrics(lambda: snapshot)
    m.ttft.observe(0.02)
    m.itl.observe(0.003)
    text = m.render().decode()
    for line in (
        "dsv4_num_requests_running 3.0",
        "dsv4_num_requests_waiting 2.0",
        "dsv4_preemptions_total 7.0",
        "dsv4_prompt_tokens_total 100.0",
        "dsv4_generation_tokens_total 50.0",
        'dsv4_pool_usage_ratio{pool="swa"} 0.25',
        'dsv4_pool_usage_ratio{pool="c4"} 0.5',
        "dsv4_engine_decode_batch_size 4.0",
        "dsv4_time_to_first_token_seconds_count 1.0",
        "dsv4_inter_token_latency_seconds_count 1.0",
    ):
        assert line in text, line
