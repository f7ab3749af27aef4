"""The DSML tool-call parser and the reasoning splitter on hand-written model outputs: complete,
truncated, several calls, and the same outputs streamed in every awkward chunking."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dsv4_engine.server.chat_output import ChatOutput
from dsv4_engine.server.protocol import ChatCompletionRequest
from dsv4_engine.server.reasoning import ReasoningSplitter
from dsv4_engine.server.tool_parser import ToolCallParser, parse_all

D = "｜DSML｜"
TWO_CALLS = (
    "Let me check.\n\n"
    f"<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">San Francisco</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="get_time">\n{{"zone": -8, "fmt": "24h"}}\n</{D}invoke>\n'
    f"</{D}tool_calls>"
)
WANT = [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {"zone": -8, "fmt": "24h"})]


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_complete_output_with_two_calls() -> None:
    content, calls = parse_all(TWO_CALLS)
    assert content == "Let me check."
    assert _calls(calls) == WANT
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_plain_text_and_lookalikes_stay_content() -> None:
    for text in ["just text", "a < b and <｜DSML｜ is only a marker", f"<{D}tool_callz> no", "ends with <"]:
        assert parse_all(text) == (text, [])


def test_a_truncated_call_keeps_its_name_and_raw_arguments() -> None:
    cut = TWO_CALLS[: TWO_CALLS.index('"zone": -8') + 6]
    content, calls = parse_all(cut)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == WANT[0][1]
    assert calls[1]["function"]["arguments"] == '{"zone"'


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, Any]], int]:
    parser = ToolCallParser()
    content, names, args = "", {}, {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = 0
    for parsed in [*(parser.push(p) for p in pieces), parser.finish()]:
        content += parsed.content
        for d in parsed.calls:
            deltas += 1
            if d.name is not None:
                names[d.index] = d.name
                args[d.index] = ""
            else:
                args[d.index] += d.arguments or ""
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)], deltas


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
def test_streamed_in_any_chunking_gives_the_same_calls(size: int) -> None:
    cuts = list(range(size, len(TWO_CALLS), size))
    content, calls, deltas = _stream(TWO_CALLS, cuts)
    assert (content, calls) == ("Let me check.", WANT)
    # each call's name, then its arguments as they are written: in several deltas, not one per call
    assert deltas > 4 + 4 * (size < 5), deltas


def test_cuts_at_every_marker_boundary() -> None:
    marks = [i for i in range(len(TWO_CALLS)) if TWO_CALLS[i] in '<｜">\n']
    for cut in marks:
        assert _stream(TWO_CALLS, [cut])[:2] == ("Let me check.", WANT), cut


@pytest.mark.parametrize("size", [1, 3, 8])
def test_reasoning_split_in_any_chunking(size: int) -> None:
    text = "<think>two plus two</think>The answer is 4."
    splitter = ReasoningSplitter()
    reasoning = content = ""
    for a in range(0, len(text), size):
        r, c = splitter.push(text[a : a + size])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == ("two plus two", "The answer is 4.")
    held = ReasoningSplitter(stream=False)
    assert held.push("half way</thi") == ("", "")  # nothing until the block ends
    assert held.push("nk>done") == ("half way", "done")
    cut = ReasoningSplitter()
    assert cut.push("never ends</th") == ("never ends", "")
    assert cut.finish() == ("</th", "")  # truncated: the held tail is reasoning too


def test_reasoning_then_tool_calls_through_one_choice() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "chat_template_kwargs": {"thinking": True},
        }
    )
    out = ChatOutput(req)
    msg = out.message("I should call tools.</think>" + TWO_CALLS)
    assert msg["reasoning_content"] == "I should call tools."
    assert msg["content"] == "Let me check."
    assert _calls(msg["tool_calls"]) == WANT and "index" not in msg["tool_calls"][0]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_control_tokens_survive_a_tokenizer_that_marks_them_special(
    tiny_checkpoint: Any, tmp_path: Any
) -> None:
    """A tokenizer whose `｜DSML｜`, `<think>`, `</think>` are special tokens (as some DeepSeek
    tokenizer files mark them): `skip_special_tokens` (every request's default) still keeps them in
    the text, so the reasoning and tool-call parsers see them; BOS/EOS are still dropped."""
    import shutil

    from transformers import AutoTokenizer

    from dsv4_engine.server.detokenizer import IncrementalDetokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_checkpoint / name).exists():
            shutil.copy(tiny_checkpoint / name, tmp_path / name)
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    for tok in doc["added_tokens"]:
        tok["special"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "I should call tools.</think>" + TWO_CALLS
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    assert D not in tok.decode(ids, skip_special_tokens=True)  # what a plain decode would lose
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    streamed = "".join(detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert streamed == text  # the control tokens kept, EOS dropped
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")],
            "reasoning_effort": "high",
        }
    )
    msg = ChatOutput(req).message(streamed)
    assert msg["reasoning_content"] == "I should call tools." and _calls(msg["tool_calls"]) == WANT
