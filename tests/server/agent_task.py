"""The two-tool task an `openai-agents` agent runs against the server (tests/server on `dsv4 serve`,
tests/up through `dsv4 up`'s router): find the weather (tool 1), judge it (tool 2), answer in a
schema. The tiny model is random and picks no tool by itself: as the chat tool tests force calls with
`tool_choice`, each turn's `tool_choice` follows a plan (`Scripted`), so the SDK's own loop (its model
class, its calls, its tool runs, its parsing of the final answer) runs three model turns.
Loaded by file path: the test tiers import no sibling modules by name."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import openai
import pydantic

PLAN = ["get_weather", "is_warm", "none"]  # each turn's tool_choice, by the tool outputs so far


class Answer(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    warm: bool


def _scripted(model_cls: Any) -> Any:
    class Scripted(model_cls):  # type: ignore[misc,valid-type]
        """The SDK's own model class, with each turn's tool_choice taken from PLAN."""

        def _plan(self, input: Any, settings: Any) -> Any:
            done = sum(1 for i in input if isinstance(i, dict) and i.get("type") == "function_call_output")
            return dataclasses.replace(settings, tool_choice=PLAN[done])

        async def get_response(
            self, system_instructions: Any, input: Any, model_settings: Any, *a: Any, **k: Any
        ) -> Any:
            return await super().get_response(
                system_instructions, input, self._plan(input, model_settings), *a, **k
            )

        async def stream_response(
            self, system_instructions: Any, input: Any, model_settings: Any, *a: Any, **k: Any
        ) -> AsyncIterator[Any]:
            settings = self._plan(input, model_settings)
            async for event in super().stream_response(system_instructions, input, settings, *a, **k):
                yield event

    return Scripted


def run_agent(
    base_url: str, model: str, *, api: str = "responses", stream: bool = False
) -> tuple[Any, list[str]]:
    """The agent run to its final answer over `api` (responses or chat_completions): (the run's
    result, the tools it called in order)."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # nothing leaves the machine
    called: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        called.append("get_weather")
        return f"{city}: sunny, 24 C"

    @function_tool
    def is_warm(celsius: Annotated[int, pydantic.Field(ge=-40, le=50)]) -> str:
        """Whether a temperature is warm."""
        called.append("is_warm")
        return "yes" if celsius >= 20 else "no"

    async def main() -> Any:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="weather",
            instructions="Find the weather, then say whether it is warm.",
            model=_scripted(cls)(model=model, openai_client=client),
            model_settings=ModelSettings(temperature=0, max_tokens=160, parallel_tool_calls=False),
            tools=[get_weather, is_warm],
            output_type=Answer,
        )
        try:
            if not stream:
                return await Runner.run(agent, "Is it warm in Rome?", max_turns=5)
            run = Runner.run_streamed(agent, "Is it warm in Rome?", max_turns=5)
            async for _ in run.stream_events():
                pass
            return run
        finally:
            await client.close()

    return asyncio.run(main()), called


def check_run(result: Any, called: list[str]) -> None:
    """Three model turns: the two tools in the plan's order, then the schema's answer."""
    assert called == ["get_weather", "is_warm"]
    assert isinstance(result.final_output, Answer), result.final_output
    assert len(result.raw_responses) == 3
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"] * 2 + ["message_output_item"], kinds
