"""Tool calling and reasoning through the official openai SDK against the real server and engine.

A Qwen2.5-tokenized tiny checkpoint (its `<tool_call>` tokens and tool-calling template). The random model never
calls a tool on its own, so `auto` is covered by the parser unit tests (tests/server/tools/); here `required` and
named calls, which the engine enforces with the hermes grammar, the round trip and the 400s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import TINY
from tests.e2e.conftest import Server, start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: Any = [WEATHER, TIME]
MSGS: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def qwen25_ckpt(checkpoints_root: Path) -> Path:
    from demo.checkpoints import write_random_checkpoint

    path = checkpoints_root / "qwen25"
    if path.exists():
        return path
    return write_random_checkpoint(
        path,
        "qwen2",
        **TINY,
        vocab_size=151_936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        tokenizer_family="qwen2.5",
    )


@pytest.fixture(scope="module")
def tools_srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen25_ckpt,
        tmp_path_factory.mktemp("tools"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tools_srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def check_args(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "celsius"} and args["city"] in ("Paris", "Rome")
        assert isinstance(args["celsius"], bool)
    else:
        assert args == {"zone": "UTC"} or args == {"zone": "CET"}


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason), assembled from the deltas as the SDK documents."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, ["", "", ""])
                if tc.id:
                    assert not call[0], "the id comes once"
                    call[0] = tc.id
                if tc.function and tc.function.name:
                    assert not call[1], "the name comes once"
                    call[1] = tc.function.name
                if tc.function and tc.function.arguments:
                    call[2] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------- 400s


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(tool_choice="required"), "`tools` must be set"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "does not match"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be"),
    ],
)
def test_400s(client: openai.OpenAI, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, **kwargs)
    assert needle in str(e.value)
    err = e.value.response.json()["error"]  # OpenAI's envelope on the wire; the SDK's `body` is what it holds
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400, err
    assert err["param"] == "tool_choice" and needle in err["message"], err
    assert e.value.body == err


def test_auto_without_the_flag_is_a_400_as_in_vllm(reasoning_srv: Server) -> None:
    r = httpx.post(
        f"{reasoning_srv.url}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSGS, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 4},
    )
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"]
        == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    # tools without a tool_choice on such a server: rendered, not parsed
    r = httpx.post(
        f"{reasoning_srv.url}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSGS, "tools": TOOLS, "max_tokens": 4},
    )
    assert r.status_code == 200


def test_auto_with_the_flag_answers(client: openai.OpenAI) -> None:
    """The random model writes no call; the answer is text (the parser paths: tests/server/tools/)."""
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ------------------------------------------------------------------------- enforcement (needs the engine)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_forced_calls_streamed_equal_non_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs: Any = dict(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=7, temperature=0.8
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert calls and not choice.message.content
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_args(call.function.name, call.function.arguments)
    if tool_choice is NAMED:
        assert [c.function.name for c in calls] == ["get_weather"]
    content, streamed, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and not content
    assert [(name, args) for _, name, args in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(i.startswith("call_") for i, _, _ in streamed)


SEARCH: Any = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query", "limit"],
            },
        },
    }
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_free_form_arguments_still_end_as_a_call(client: openai.OpenAI, tool_choice: Any) -> None:
    """An unbounded string and integer: the random model would never close them; the engine finishes the call
    inside max_tokens, so it parses, validates and ends with "tool_calls", streamed as not."""
    import jsonschema

    kwargs: Any = dict(
        model="tiny", messages=MSGS, tools=SEARCH, tool_choice=tool_choice, max_tokens=80, temperature=0.0
    )
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["search"]
    jsonschema.validate(json.loads(calls[0].function.arguments), SEARCH[0]["function"]["parameters"])
    content, streamed, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and not content
    assert [(name, args) for _, name, args in streamed] == [("search", calls[0].function.arguments)]


def test_round_trip(client: openai.OpenAI, tools_srv: Server) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice=NAMED, max_tokens=200, seed=3
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: Any = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    rendered = httpx.post(
        f"{tools_srv.url}/v1/chat/completions/render",
        timeout=60,
        json={"model": "tiny", "messages": history, "tools": TOOLS},
    ).json()
    text = httpx.post(
        f"{tools_srv.url}/detokenize", timeout=60, json={"model": "tiny", "tokens": rendered["token_ids"]}
    ).json()["prompt"]
    args = json.dumps(json.loads(call.function.arguments))  # the template's tojson of the parsed arguments
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text
    assert '"name": "get_time"' in text  # the tools in the system prompt
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length")


def test_bad_arguments_json_in_history_is_a_400(client: openai.OpenAI) -> None:
    history: Any = [
        *MSGS,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}
            ],
        },
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2)
    assert "arguments is not valid JSON" in str(e.value)


# ----------------------------------------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def reasoning_srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen25_ckpt, tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "deepseek_r1")
    yield s
    s.stop()


def test_reasoning_fields_streamed_and_not(reasoning_srv: Server) -> None:
    """deepseek_r1: the output starts inside reasoning; a random model never closes it, so all is reasoning."""
    client = openai.OpenAI(base_url=f"{reasoning_srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    kwargs: Any = dict(model="tiny", messages=MSGS, max_tokens=12, seed=5, temperature=0.7)
    r = client.chat.completions.create(**kwargs)
    message: Any = r.choices[0].message
    text = message.reasoning
    assert message.reasoning_content == text
    streamed_reasoning, streamed_alias, streamed_content = "", "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta: Any = choice.delta
            streamed_reasoning += getattr(delta, "reasoning", None) or ""
            streamed_alias += getattr(delta, "reasoning_content", None) or ""
            streamed_content += delta.content or ""
    assert streamed_reasoning == streamed_alias == (text or "")
    assert streamed_content == (message.content or "")
    assert (text or "") + (message.content or "") != ""
    # usage: reasoning never closed, so every completion token was reasoning; streamed, the same in the last chunk
    assert r.usage is not None and r.usage.completion_tokens_details is not None and message.content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens > 0
    last = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))[-1]
    assert last.usage is not None and last.usage.completion_tokens_details == r.usage.completion_tokens_details


# ------------------------------------------------------------------------ the same through the anthropic SDK

ANTHROPIC_TOOLS: Any = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def anthropic_client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "tool", "name": "get_weather"}, {"type": "any"}, {"type": "any", "disable_parallel_tool_use": True}],
)
def test_anthropic_forced_tool_use_streamed_equals_non_streamed(tools_srv: Server, tool_choice: Any) -> None:
    client = anthropic_client(tools_srv)
    kwargs: Any = dict(
        model="tiny",
        max_tokens=200,
        messages=MSGS,
        tools=ANTHROPIC_TOOLS,
        tool_choice=tool_choice,
        extra_body={"temperature": 0.0},
    )  # Anthropic has no seed: greedy
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(b.type == "tool_use" for b in message.content)
    for block in uses:
        assert block.id.startswith("toolu_")
        check_args(block.name, json.dumps(block.input))
    if tool_choice["type"] == "tool" or tool_choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1
    if tool_choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]


def test_anthropic_tool_round_trip(tools_srv: Server) -> None:
    client = anthropic_client(tools_srv)
    first = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=MSGS,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    use = next(b for b in first.content if b.type == "tool_use")
    history: Any = [
        *MSGS,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"}]},
    ]
    second = client.messages.create(model="tiny", max_tokens=5, messages=history, tools=ANTHROPIC_TOOLS)
    assert second.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model="tiny", messages=history, tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == second.usage.input_tokens


def test_anthropic_output_config_json_schema(tools_srv: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    message = anthropic_client(tools_srv).messages.create(
        model="tiny",
        max_tokens=64,
        messages=MSGS,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert message.stop_reason == "end_turn"
    value = json.loads(message.content[0].text)  # type: ignore[union-attr]
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_anthropic_forced_tool_use_with_an_unknown_name_is_a_400(tools_srv: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(tools_srv).messages.create(
            model="tiny",
            max_tokens=5,
            messages=MSGS,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):  # thinking needs --reasoning-parser
        anthropic_client(tools_srv).messages.create(
            model="tiny", max_tokens=2048, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 1024}
        )


def test_anthropic_thinking_blocks_streamed_and_not(reasoning_srv: Server) -> None:
    """deepseek_r1 on a random model: the answer never leaves its reasoning, so it is one thinking block."""
    client = anthropic_client(reasoning_srv)
    kwargs: Any = dict(
        model="tiny", max_tokens=12, messages=MSGS, thinking={"type": "adaptive"}, extra_body={"temperature": 0.0}
    )  # adaptive: no budget, so max_tokens can be small
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking"]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"]
    assert final.content[0].thinking == message.content[0].thinking  # type: ignore[union-attr]
