"""LiteLLM's OpenAI provider (`openai/<model>` with `api_base`) against `dsv4 serve` on the real tiny
engine: `litellm.completion` (streamed and not, a forced tool call) and `litellm.responses` (which for
the OpenAI provider calls /v1/responses), as a user of LiteLLM would call them.

LiteLLM lives in a virtualenv of its own (scripts/get-litellm.sh, which the test command runs, cached
outside the repo by version): every LiteLLM release that accepts the `openai` 3 client the project pins requires boto3,
whose botocore caps python-dateutil below 3, while the `kubernetes` client the operator uses needs
3 or later; the older releases that do without boto3 cap `openai` below 3. So it cannot share .venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsv4_engine.server.app import create_app
from suite import skips

ROOT = Path(__file__).resolve().parents[2]
NAME = "dsv4-tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# Runs in LiteLLM's venv: argv[1] is the server's /v1 URL; prints one JSON object of what it got.
CLIENT = """
import json, sys
import litellm

base, tool = sys.argv[1], json.loads(sys.argv[2])
kw = dict(model="openai/dsv4-tiny", api_base=base, api_key="unused", temperature=0, max_tokens=16)
msgs = [{"role": "user", "content": "What is a page?"}]
out = {}
r = litellm.completion(messages=msgs, **kw)
out["text"], out["finish"] = r.choices[0].message.content, r.choices[0].finish_reason
out["usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]
out["streamed"] = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=msgs, stream=True, **kw))
call = litellm.completion(messages=msgs, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                         **{**kw, "max_tokens": 80})
fn = call.choices[0].message.tool_calls[0].function
out["call"] = [fn.name, json.loads(fn.arguments), call.choices[0].finish_reason]
resp = litellm.responses(input="What is a page?", model="openai/dsv4-tiny", api_base=base, api_key="unused",
                         temperature=0, max_output_tokens=16)
out["responses"] = [resp.output[0].content[0].text, resp.usage.input_tokens]
events = list(litellm.responses(input="What is a page?", model="openai/dsv4-tiny", api_base=base,
                                api_key="unused", temperature=0, max_output_tokens=16, stream=True))
out["responses_streamed"] = "".join(getattr(e, "delta", "") or "" for e in events
                                    if getattr(e, "type", "") == "response.output_text.delta")
print(json.dumps(out))
"""


def _venv() -> Path:
    """LiteLLM's venv (scripts/get-litellm.sh, run by scripts/test.sh; installed here if absent)."""
    got = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-litellm.sh")], capture_output=True, text=True, timeout=1800
    )
    if got.returncode != 0:
        skips.missing(f"no LiteLLM venv (scripts/get-litellm.sh failed: {got.stderr.strip()[-300:]})")
    return Path(got.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def base(llm: Any, tiny_checkpoint: Any, serve: Any) -> Iterator[str]:
    from dsv4_engine.server.args import ServerSettings

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_name=NAME)
    with serve(create_app(settings, lambda: llm.engine)) as url:
        yield url


def test_litellm_openai_provider(base: str) -> None:
    import openai

    python = _venv()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # nothing fetched from the network
    done = subprocess.run(
        [str(python), "-c", CLIENT, f"{base}/v1", json.dumps(WEATHER)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    direct = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What is a page?"}]
    # LiteLLM raises max_output_tokens below 16 to 16 (OpenAI's minimum), so 16 throughout
    want = direct.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
    assert got["text"] == got["streamed"] == want.choices[0].message.content
    assert got["usage"] == [want.usage.prompt_tokens, want.usage.completion_tokens]
    name, args, finish = got["call"]
    assert (name, finish) == ("get_weather", "tool_calls") and args["city"] in ("Paris", "Rome")
    assert got["responses"] == [want.choices[0].message.content, want.usage.prompt_tokens]
    assert got["responses_streamed"] == want.choices[0].message.content
