"""OpenAI's Responses API (/v1/responses) through the official openai SDK against the real server and engine.

A Qwen2.5-tokenized tiny checkpoint (its tool-calling template) with the hermes tool parser: the random model
writes random text, so function calls come from `required` / named tool choices, which the engine enforces.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


MAX_LEN = 1024


@pytest.fixture(scope="module")
def srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen25_ckpt,
        tmp_path_factory.mktemp("responses"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--responses-store-size",
        "2",
        "--max-model-len",
        str(MAX_LEN),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def plain(resp: Any) -> dict[str, Any]:
    """A response without what differs between two requests for the same answer (ids, time)."""
    d = resp.model_dump()
    d.pop("id"), d.pop("created_at")
    d["usage"]["input_tokens_details"].pop("cached_tokens")  # the prefix cache warms between requests
    for item in d["output"]:  # the SDK's stream helper adds its client-side parse (None here)
        item.pop("id"), item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return d


def tokens(resp: Any) -> tuple[int, int]:
    return resp.usage.input_tokens, resp.usage.output_tokens


def test_create_text(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="tiny", input="Say hi", instructions="be brief", max_output_tokens=6, temperature=0, store=False
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant"
    part = r.output[0].content[0]
    assert part.type == "output_text" and r.output_text == part.text
    assert r.usage is not None and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    items = client.responses.create(
        model="tiny",
        max_output_tokens=6,
        temperature=0,
        store=False,
        instructions="be brief",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
    )
    assert items.output_text == r.output_text and items.usage is not None
    assert (items.usage.input_tokens, items.usage.output_tokens) == (r.usage.input_tokens, 6)
    assert items.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: from the prefix cache


def test_stop_and_seed(client: openai.OpenAI) -> None:
    full = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=16, temperature=0)
    text = full.output_text
    cut_at = next((i for i in range(1, len(text) - 2) if text.find(text[i : i + 2]) == i), None)
    if cut_at is not None:
        stop = text[cut_at : cut_at + 2]
        cut = client.responses.create(
            model="tiny", input="Tell me a story", max_output_tokens=16, temperature=0, extra_body={"stop": [stop]}
        )
        assert cut.status == "completed" and cut.output_text == text[:cut_at]
    a, b = (
        client.responses.create(
            model="tiny", input="hi", max_output_tokens=8, temperature=1.0, extra_body={"seed": 7}, top_p=0.9
        )
        for _ in range(2)
    )
    assert a.output_text == b.output_text


def test_stream_events_build_the_response(client: openai.OpenAI) -> None:
    kw: Any = dict(model="tiny", input="Say hi 你好", max_output_tokens=10, temperature=0)
    want = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    last = events[-1]
    assert last.type == "response.incomplete" and plain(last.response) == plain(want)


def test_sdk_stream_helper_and_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    kw: Any = dict(
        model="tiny",
        input="yes or no?",
        max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    want = client.responses.create(**kw)
    assert want.status == "completed" and json.loads(want.output_text)["a"] in ("yes", "no")
    with client.responses.stream(**kw) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert text == want.output_text and plain(final) == plain(want)
    obj = client.responses.create(
        model="tiny", input="json", max_output_tokens=30, temperature=0, text={"format": {"type": "json_object"}}
    )
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_logprobs_include(client: openai.OpenAI) -> None:
    kw: Any = dict(
        model="tiny",
        input="Say hi",
        max_output_tokens=5,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    r = client.responses.create(**kw)
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == 5
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    streamed = [
        lp
        for e in client.responses.create(stream=True, **kw)
        if e.type == "response.output_text.delta"
        for lp in e.logprobs
    ]
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [
        (lp.token, round(lp.logprob, 4)) for lp in part.logprobs
    ]
    with pytest.raises(openai.BadRequestError) as e:  # a parser at work: not yet
        client.responses.create(tools=[WEATHER], **kw)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "include"


def test_function_call_round_trip_and_state(client: openai.OpenAI, srv: Server) -> None:
    kw: Any = dict(model="tiny", tools=[WEATHER], max_output_tokens=60, temperature=0)
    r = client.responses.create(input="Weather in Paris?", tool_choice="required", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome") and calls[0].call_id.startswith("call_")
    assert not any(o.type == "message" and "<tool_call>" in o.content[0].text for o in r.output)
    with client.responses.stream(
        input="Weather in Paris?", tool_choice={"type": "function", "name": "get_weather"}, **kw
    ) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    assert [o.type for o in streamed.output] == ["function_call"]
    assert streamed.output[0].arguments == json.loads(json.dumps(streamed.output[0].arguments))
    # the tool's answer continues the stored response: its function call is part of the conversation
    follow = client.responses.create(
        previous_response_id=r.id,
        tool_choice="none",
        **kw,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "22C, sunny"}],
    )
    assert follow.previous_response_id == r.id and follow.output[0].type == "message"
    # the same turn sent whole (no state) renders the same prompt
    whole = client.responses.create(
        tool_choice="none",
        store=False,
        **kw,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22C, sunny"},
        ],
    )
    assert whole.usage is not None and follow.usage is not None
    assert whole.usage.input_tokens == follow.usage.input_tokens and whole.output_text == follow.output_text
    got = client.responses.retrieve(follow.id)
    assert got.id == follow.id and got.output_text == follow.output_text
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)


def test_store_is_a_bounded_lru(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="tiny", input="hi", max_output_tokens=2).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 2: the oldest went
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[2]).id == ids[2]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id=ids[0])
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "previous_response_id"
    nostore = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(nostore.id)


def test_background_and_cancel(client: openai.OpenAI, srv: Server) -> None:
    queued = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    deadline = time.monotonic() + 60
    got = client.responses.retrieve(queued.id)
    while got.status == "queued" and time.monotonic() < deadline:  # waits for the state, bounded
        time.sleep(0.05)
        got = client.responses.retrieve(queued.id)
    want = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, store=False)
    assert got.status == "incomplete" and got.output_text == want.output_text and got.background is True
    foreground = client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(foreground.id)
    long = client.responses.create(model="tiny", input="hi", max_output_tokens=900, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as e:  # nothing to continue
        client.responses.create(model="tiny", input="hi", previous_response_id=long.id)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "item_reference"}]}, "input[0].id"),
        ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        ({"input": "hi", "truncation": "middle"}, "truncation"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({}, "input"),
        ({"input": "hi", "max_output_tokens": MAX_LEN}, "max_output_tokens"),  # over the context: truncation disabled
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_400s_name_the_field(srv: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def reasoning_client(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    s = start_server(qwen25_ckpt, tmp_path_factory.mktemp("responses-reasoning"), "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
    s.stop()


def test_reasoning_items_streamed_and_not(reasoning_client: openai.OpenAI) -> None:
    kw: Any = dict(model="tiny", input="Think first", max_output_tokens=8, temperature=0, reasoning={"effort": "low"})
    want = reasoning_client.responses.create(**kw)
    assert want.output[0].type == "reasoning" and want.output[0].content  # R1: the answer opens in reasoning
    events = list(reasoning_client.responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "".join(c.text for c in want.output[0].content)
    last = events[-1]
    assert last.type == "response.incomplete" and plain(last.response) == plain(want)
    usage = want.usage
    assert usage is not None and usage.output_tokens == 8
    assert usage.output_tokens_details.reasoning_tokens == 8  # reasoning never closed: every token was reasoning


def test_truncation_auto_drops_the_oldest_turns_at_under_and_over_the_limit(client: openai.OpenAI) -> None:
    def conversation(pad: int) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "first" + " hello" * pad},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "second" + " hello" * 20},
            {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "and now?"},
        ]

    def create(items: list[dict[str, Any]], max_out: int, truncation: str = "auto") -> Any:
        return client.responses.create(
            model="tiny", input=items, max_output_tokens=max_out, temperature=0, store=False, truncation=truncation
        )  # type: ignore[arg-type]

    def input_tokens(items: list[dict[str, Any]]) -> int:
        r = create(items, 1, "disabled")
        assert r.usage is not None
        return r.usage.input_tokens

    base = input_tokens(conversation(0))
    items = conversation(MAX_LEN - 12 - base)  # about 12 tokens left for the output
    full = input_tokens(items)
    room = MAX_LEN - full
    assert 1 < room < 40, room
    for max_out in (room - 1, room):  # under and at the limit: nothing dropped, either way
        for truncation in ("auto", "disabled"):
            r = create(items, max_out, truncation)
            assert r.usage is not None and r.usage.input_tokens == full and r.truncation == truncation
    with pytest.raises(openai.BadRequestError) as e:  # over it, disabled: a 400
        create(items, room + 1, "disabled")
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "max_output_tokens"
    cut = create(items, room + 1)  # over it, auto: the first turn (and its answer) dropped
    assert cut.usage is not None and cut.usage.input_tokens == input_tokens(items[2:]) < full
    with pytest.raises(openai.BadRequestError):  # even the last turn alone cannot leave that much room
        create(items, MAX_LEN - 5)


def test_item_reference_and_input_file(client: openai.OpenAI, srv: Server) -> None:
    kw: Any = dict(model="tiny", tools=[WEATHER], max_output_tokens=20, temperature=0)
    r = client.responses.create(input="Weather in Paris?", tool_choice="required", **kw)
    call = next(o for o in r.output if o.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "22C"}
    whole = client.responses.create(
        tool_choice="none",
        store=False,
        **kw,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), output],
    )
    ref = client.responses.create(
        tool_choice="none",
        store=False,
        **kw,
        input=[{"role": "user", "content": "Weather in Paris?"}, {"type": "item_reference", "id": call.id}, output],
    )
    assert ref.output_text == whole.output_text and tokens(ref) == tokens(whole)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:  # no stored response holds it now
        client.responses.create(store=False, **kw, input=[{"type": "item_reference", "id": call.id}])
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "input[0].id"

    notes = "Meeting notes\n- ship 1.0 on Friday\n- 東京 office 🦊\n"
    as_text = client.responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Summarize"},
                    {"type": "input_text", "text": f"notes.txt:\n{notes}"},
                ],
            }
        ],
        max_output_tokens=4,
        temperature=0,
        store=False,
    )
    b64 = base64.b64encode(notes.encode()).decode()
    for data in (f"data:text/plain;base64,{b64}", b64):
        as_file = client.responses.create(
            model="tiny",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Summarize"},
                        {"type": "input_file", "filename": "notes.txt", "file_data": data},
                    ],
                }
            ],
            max_output_tokens=4,
            temperature=0,
            store=False,
        )
        assert as_file.output_text == as_text.output_text and tokens(as_file) == tokens(as_text)
    bad = [
        ("data:application/pdf;base64," + base64.b64encode(b"%PDF-1.7 x").decode(), "PDF"),
        (base64.b64encode(b"\xff\xfe\x00").decode(), "UTF-8"),
        ("not base64!", "base64"),
        ("data:text/plain,hello", "base64"),
    ]
    for data, needle in bad:
        got = httpx.post(
            f"{srv.url}/v1/responses",
            timeout=60,
            json={"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file", "file_data": data}]}]},
        )
        assert got.status_code == 400 and needle in got.json()["error"]["message"], got.text
        assert got.json()["error"]["param"] == "input[0].content[0].file_data"
