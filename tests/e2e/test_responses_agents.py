"""The OpenAI Agents SDK (`openai-agents`), unmodified, running one agent with one function tool against the
real server's /v1/responses: the model calls the tool (tool_choice "required", enforced by the engine), the
SDK runs it and sends its output back, and the next turn ends in the agent's structured output type."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anyio
import openai
import pydantic
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.e2e.conftest import Server, start_server

set_tracing_disabled(True)  # no trace upload to OpenAI from a test


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def agents_srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen25_ckpt, tmp_path_factory.mktemp("agents"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_calls_its_tool_and_answers(agents_srv: Server, stream: bool) -> None:
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return "22C, sunny"

    client = openai.AsyncOpenAI(base_url=f"{agents_srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        output_type=Verdict,
        model=OpenAIResponsesModel("tiny", client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )

    async def run() -> Verdict:
        if stream:
            result = Runner.run_streamed(agent, "Is it sunny in Paris?", max_turns=3)
            async for _ in result.stream_events():
                pass
            return result.final_output_as(Verdict)
        done = await Runner.run(agent, "Is it sunny in Paris?", max_turns=3)
        return done.final_output_as(Verdict)

    verdict = anyio.run(run)
    assert seen and seen[0] in ("Paris", "Rome")  # the SDK ran the tool with the model's arguments
    assert verdict.answer in ("yes", "no")
