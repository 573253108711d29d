"""The official anthropic SDK, sync and async, unmodified, against the real server's /v1/messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import pytest

from tests.e2e.conftest import Server, start_server

# Newer SDKs dropped temperature/top_p/top_k from create() (newer Claude models refuse them); the wire field
# stands, so the tests send it as an extra body field, which every SDK version passes through.
GREEDY = {"temperature": 0}
MSGS: list[Any] = [{"role": "user", "content": "Say hi 你好"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_TURNS: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "22C, sunny"},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


def client(server: Server, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def test_create_stream_and_messages_stream_agree(server: Server) -> None:
    c = client(server)
    msg = c.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, system="be brief", messages=MSGS)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == "tiny"
    assert len(msg.content) == 1 and msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and 1 <= msg.usage.output_tokens <= 8
    text = msg.content[0].text

    events = list(
        c.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, system="be brief", messages=MSGS, stream=True)
    )
    kinds = [e.type for e in events]  # the SDK drops pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert (
        "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
        == text
    )
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == msg.usage.input_tokens
    delta = events[-2]
    assert delta.type == "message_delta" and delta.delta.stop_reason == msg.stop_reason
    assert delta.usage.output_tokens == msg.usage.output_tokens

    with c.messages.stream(model="tiny", max_tokens=8, extra_body=GREEDY, system="be brief", messages=MSGS) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.content[0].type == "text" and final.content[0].text == text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        msg.stop_reason,
        msg.usage.input_tokens,
        msg.usage.output_tokens,
    )


def test_max_tokens_and_stop_sequences(server: Server) -> None:
    c = client(server)
    short = c.messages.create(model="tiny", max_tokens=3, extra_body=GREEDY, messages=MSGS)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3

    found = 0
    for prompt in ("Say hi 你好", "Tell me a story", "count to ten", "hello"):
        msgs: Any = [{"role": "user", "content": prompt}]
        full = c.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, messages=msgs)
        text = full.content[0].text  # type: ignore[union-attr]
        # a stop string from the greedy output itself, found first where it is taken
        starts = [
            i for i in range(1, len(text) - 2) if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2]
        ]
        if not starts:
            continue
        stop = text[starts[0] : starts[0] + 2]
        cut = c.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, messages=msgs, stop_sequences=[stop])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert cut.content[0].text == text[: starts[0]]  # type: ignore[union-attr]
        with c.messages.stream(
            model="tiny", max_tokens=24, extra_body=GREEDY, messages=msgs, stop_sequences=[stop]
        ) as s:
            assert "".join(s.text_stream) == text[: starts[0]]
            final = s.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
        found += 1
    assert found


def test_count_tokens_and_system_prompts(server: Server) -> None:
    c = client(server)
    for system in ("be brief", [{"type": "text", "text": "be brief"}]):
        counted = c.messages.count_tokens(model="tiny", system=system, messages=MSGS)  # type: ignore[arg-type]
        msg = c.messages.create(
            model="tiny",
            max_tokens=4,
            extra_body=GREEDY,
            system=system,  # type: ignore[arg-type]
            messages=MSGS,
        )
        assert counted.input_tokens == msg.usage.input_tokens
    no_system = c.messages.count_tokens(model="tiny", messages=MSGS)
    assert no_system.input_tokens != counted.input_tokens  # the system prompt is in the prompt
    as_string = c.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, system="be brief", messages=MSGS)
    as_blocks = c.messages.create(
        model="tiny", max_tokens=6, extra_body=GREEDY, messages=MSGS, system=[{"type": "text", "text": "be brief"}]
    )
    assert as_string.content == as_blocks.content


def test_tool_use_and_tool_result_round_trip(server: Server) -> None:
    c = client(server)
    counted = c.messages.count_tokens(model="tiny", tools=[WEATHER], messages=TOOL_TURNS)
    msg = c.messages.create(
        model="tiny",
        max_tokens=6,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        messages=TOOL_TURNS,
        metadata={"user_id": "u-1"},
    )
    assert msg.usage.input_tokens == counted.input_tokens and msg.content[0].type == "text"
    failed: Any = [
        *TOOL_TURNS[:2],
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "22C, sunny", "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    assert c.messages.count_tokens(model="tiny", tools=[WEATHER], messages=failed).input_tokens > counted.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="does not match any"):  # forced use of an unknown tool
        c.messages.create(
            model="tiny", max_tokens=6, tools=[WEATHER], tool_choice={"type": "tool", "name": "x"}, messages=MSGS
        )


def test_unpaired_tool_use_and_tool_result_are_400s_as_anthropic_answers(server: Server) -> None:
    c = client(server)
    orphan: Any = [TOOL_TURNS[0], {"role": "assistant", "content": "No tool."}, TOOL_TURNS[2]]
    unanswered: Any = [*TOOL_TURNS[:2], {"role": "user", "content": "Never mind."}]
    for messages, words in (
        (orphan, "unexpected `tool_use_id` found in `tool_result` blocks: toolu_01"),
        (unanswered, "`tool_use` ids were found without `tool_result` blocks immediately after"),
    ):
        with pytest.raises(anthropic.BadRequestError) as bad:
            c.messages.create(model="tiny", max_tokens=4, tools=[WEATHER], messages=messages)
        assert isinstance(bad.value.body, dict) and bad.value.body["error"]["type"] == "invalid_request_error"
        assert words in bad.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match=words.split(":")[0][:40]):
            c.messages.count_tokens(model="tiny", tools=[WEATHER], messages=messages)
    assert c.messages.count_tokens(model="tiny", tools=[WEATHER], messages=TOOL_TURNS).input_tokens > 0


def test_error_shapes(server: Server) -> None:
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="tiny", max_tokens=4, messages=MSGS, extra_body={"temperature": "hot"})
    assert isinstance(bad.value.body, dict) and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "temperature" in bad.value.message
    with pytest.raises(anthropic.BadRequestError, match="images are not supported yet"):
        c.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        )
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=4, messages=MSGS)
    assert isinstance(missing.value.body, dict) and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="no-such-model", messages=MSGS)
    raw = httpx.post(
        f"{server.url}/v1/messages",
        timeout=30,
        json={"model": "tiny", "max_tokens": 4, "messages": MSGS, "stream": True, **GREEDY},
    )
    assert raw.text.count("event: ping") >= 1 and "[DONE]" not in raw.text
    assert raw.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_client(server: Server, anyio_backend: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0) as c:
        streamed: dict[int, str] = {}

        async def one(i: int) -> None:
            msgs: Any = [{"role": "user", "content": f"count {i}"}]
            async with c.messages.stream(model="tiny", max_tokens=8, extra_body=GREEDY, messages=msgs) as s:
                streamed[i] = "".join([t async for t in s.text_stream])
                final = await s.get_final_message()
            assert final.content[0].text == streamed[i]  # type: ignore[union-attr]

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        for i in range(6):
            ref = await c.messages.create(
                model="tiny", max_tokens=8, extra_body=GREEDY, messages=[{"role": "user", "content": f"count {i}"}]
            )
            assert ref.content[0].text == streamed[i]  # type: ignore[union-attr]
            raw = [
                e
                async for e in await c.messages.create(
                    model="tiny",
                    max_tokens=8,
                    extra_body=GREEDY,
                    stream=True,
                    messages=[{"role": "user", "content": f"count {i}"}],
                )
            ]
            assert (
                "".join(e.delta.text for e in raw if e.type == "content_block_delta" and e.delta.type == "text_delta")
                == streamed[i]
            )


def test_x_api_key_on_a_keyed_server(qwen2_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(qwen2_ckpt, tmp_path, "--api-key", "sekrit")
    try:
        msg = client(s, api_key="sekrit").messages.create(model="tiny", max_tokens=3, messages=MSGS)
        assert msg.usage.output_tokens >= 1
        bearer = anthropic.Anthropic(base_url=s.url, auth_token="sekrit", max_retries=0)  # Authorization: Bearer
        assert bearer.messages.count_tokens(model="tiny", messages=MSGS).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as denied:
            client(s, api_key="wrong").messages.create(model="tiny", max_tokens=3, messages=MSGS)
        assert isinstance(denied.value.body, dict) and denied.value.body["error"]["type"] == "authentication_error"
    finally:
        assert s.stop() == 0
