"""What evaluation and benchmark clients send: vendor fields (ignored, logged once, listed in a header),
OpenAI fields the server cannot honour (400 naming them), null message content, /tokenize and
/detokenize in vLLM's shapes. Served by the scriptable engine: token i is prompt[-1] + 1 + i."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dsv4_engine.server.app import create_app
from dsv4_engine.server.args import ServerSettings
from dsv4_engine.server.middleware import IGNORED_FIELDS_HEADER, MAX_LISTED_FIELDS, field_list

NAME = "compat"
MAX_MODEL_LEN = 256  # the fake engine's
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a page?"}]
VENDOR = {"nvext": {"ignore_eos": True}, "return_routed_experts": False}


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Any, tokenizer: Any, fake_engine_cls: Any, serve: Any) -> Iterator[str]:
    engine = fake_engine_cls(tokenizer, max_model_len=MAX_MODEL_LEN)
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _ignored_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dsv4.server"
        and r.levelno == logging.WARNING
        and "ignored request fields" in r.getMessage()
    ]


def test_vendor_fields_are_ignored_with_one_warning_and_a_header(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dsv4.server")
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt="Hello", max_tokens=3, temperature=0, extra_body=VENDOR
    )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "nvext,return_routed_experts"
    assert raw.parse().usage.completion_tokens == 3  # served as if the fields were absent
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=CHAT, max_tokens=2, extra_body=VENDOR
    )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "nvext,return_routed_experts"
    assert raw.parse().choices[0].finish_reason == "length"
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt="Hello", max_tokens=3, stream=True, extra_body={"nvext": {}}
    )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "nvext"
    assert sum(1 for chunk in raw.parse() if chunk.choices and chunk.choices[0].finish_reason) == 1
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=CHAT, max_tokens=2, stream=True, extra_body={"nvext": {}}
    )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "nvext"
    assert [c.choices[0].finish_reason for c in raw.parse() if c.choices][-1] == "length"
    plain = client.completions.with_raw_response.create(model=NAME, prompt="Hello", max_tokens=1)
    assert IGNORED_FIELDS_HEADER not in plain.headers
    warnings = _ignored_warnings(caplog)
    assert len(warnings) == 4  # exactly one per request that carried unknown fields
    assert all("nvext" in w for w in warnings)
    assert sum("return_routed_experts" in w for w in warnings) == 2


def test_generate_takes_what_sglang_bench_serving_sends(base: str) -> None:
    # sglang 0.5's bench_serving --backend sglang request, verbatim in its field names.
    body = {
        "text": "Hello",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": False,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "return_routed_experts": False,
    }
    r = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_FIELDS_HEADER] == "return_routed_experts"
    assert r.json()["meta_info"]["completion_tokens"] == 4
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True}, timeout=60) as s:
        assert s.headers[IGNORED_FIELDS_HEADER] == "return_routed_experts"
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert httpx.Response(200, content=events[-2]).json()["meta_info"]["completion_tokens"] == 4


def test_error_answers_carry_the_header_too(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "x", "nvext": 1})
    assert r.status_code == 404 and r.headers[IGNORED_FIELDS_HEADER] == "nvext"


def test_odd_field_names_are_percent_encoded(base: str) -> None:
    names = ["a,b", "x\r\nSet-Cookie: y", "é", ""]
    assert field_list(names) == 'a%2Cb,x%0D%0ASet-Cookie%3A%20y,%C3%A9,""'
    many = [f"f{i}" for i in range(MAX_LISTED_FIELDS + 3)]
    assert field_list(many).endswith(f"f{MAX_LISTED_FIELDS - 1},...(3 more)")
    body = {"prompt": "x", "max_tokens": 1, **dict.fromkeys(names, 1)}
    r = httpx.post(f"{base}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_FIELDS_HEADER] == field_list(names)


@pytest.mark.parametrize(
    ("kind", "kwargs", "param"),
    [
        ("chat", {"extra_body": {"no_stop_trim": True}}, "no_stop_trim"),
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"suffix": "end"}, "suffix"),
    ],
)
def test_unhonoured_fields_are_still_refused(
    client: openai.OpenAI, kind: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, **kwargs)
        else:
            client.completions.create(model=NAME, prompt="x", max_tokens=1, **kwargs)
    body = info.value.body
    assert (body["param"], body["code"]) == (param, "unsupported_parameter")
    assert param in body["message"]


def test_null_content_is_refused_for_a_user_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": None}]
        )
    assert info.value.body["param"] == "messages[1].content"
    assert "null" in info.value.body["message"]


def test_tokenize_a_prompt_as_completions_encodes_it(
    base: str, client: openai.OpenAI, tokenizer: Any
) -> None:
    r = httpx.post(f"{base}/tokenize", json={"model": NAME, "prompt": "Hello there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello there")
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), MAX_MODEL_LEN)
    usage = client.completions.create(model=NAME, prompt="Hello there", max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    bare = httpx.post(f"{base}/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False)
    assert bare["count"] == body["count"] - 1  # the BOS the tokenizer adds
    strs = httpx.post(f"{base}/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])


def test_tokenize_messages_as_chat_encodes_them(base: str, client: openai.OpenAI, tokenizer: Any) -> None:
    body = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()
    expected = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True, sanitize_control_tokens=True
    )["input_ids"]
    assert body["tokens"] == list(expected)
    usage = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    no_prompt = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]
    assert body["tokens"][: no_prompt["count"]] == no_prompt["tokens"]


def test_detokenize_inverts_tokenize(base: str, tokenizer: Any) -> None:
    text = "Hello, 你好 🙂"
    ids = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = httpx.post(f"{base}/detokenize", json={"model": NAME, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    with_bos = httpx.post(f"{base}/detokenize", json={"tokens": tokenizer.encode("Hi")}).json()["prompt"]
    assert with_bos == tokenizer.bos_token + "Hi"  # vLLM's: special tokens are not skipped
    # ...and tokenizing that text again gives the same ids: its BOS is not doubled (lm-eval's
    # tokenized_requests=False decodes its own ids, BOS included, and counts positions in them)
    again = httpx.post(f"{base}/tokenize", json={"prompt": with_bos}).json()["tokens"]
    assert again == tokenizer.encode("Hi") and again.count(tokenizer.bos_token_id) == 1
    assert httpx.post(f"{base}/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "messages"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenizer_routes_name_the_bad_field(base: str, path: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(base + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and {"message", "type", "code"} <= set(err)


def test_tokenizer_routes_check_the_model(base: str) -> None:
    r = httpx.post(f"{base}/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenizer_routes_need_the_api_key(
    tiny_checkpoint: Any, tokenizer: Any, fake_engine_cls: Any, serve: Any
) -> None:
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME, api_key="s3cret")
    with serve(create_app(settings, lambda: fake_engine_cls(tokenizer))) as url:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            denied = httpx.post(url + path, json=body)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            ok = httpx.post(url + path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200, ok.text


def test_chat_template_flag_replaces_the_checkpoints(
    tiny_checkpoint: Any, tokenizer: Any, fake_engine_cls: Any, serve: Any, tmp_path: Any
) -> None:
    """`--chat-template FILE` is the template /v1/chat/completions, /v1/responses and /tokenize use."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME, chat_template=str(template))
    want = len(tokenizer.encode("[system] Be brief.\n[user] What is a page?\n"))  # BOS from the encoding
    with serve(create_app(settings, lambda: fake_engine_cls(tokenizer))) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        assert c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1).usage.prompt_tokens == want
        assert httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["count"] == want
        r = c.responses.create(
            model=NAME, instructions="Be brief.", input="What is a page?", max_output_tokens=1
        )
        assert r.usage.input_tokens == want
