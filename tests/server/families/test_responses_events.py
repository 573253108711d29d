"""The Responses API's event stream (server/families/responses/formatter.py), cut at every place: the events
come in order with increasing sequence_numbers, every item is added, built and done one at a time, and what a
client assembles from them is exactly the non-streamed response."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.families.responses.formatter import ResponsesFormatter
from server.families.responses.routes import framing
from server.http.errors import APIError
from server.reasoning.parser import get_reasoning_parser
from server.request.collector import Output
from server.request.openai_protocol import PromptTokensDetails, Usage
from server.structured.parsing import ChoiceParser
from server.tools.parser import HermesParser

ANSWER = (
    '<think>Paris is a city.</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    "\n</tool_call>"
)
BASE: dict[str, Any] = {"id": "resp_x", "object": "response", "created_at": 1, "model": "tiny"}


def formatter(tools: bool = True, reasoning: bool = True) -> ResponsesFormatter:
    def new() -> ChoiceParser | None:
        if not (tools or reasoning):
            return None
        return ChoiceParser(
            get_reasoning_parser("deepseek_r1")(None) if reasoning else None, HermesParser() if tools else None
        )

    return ResponsesFormatter(dict(BASE), 7, new)


def events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in data.decode().split("\n\n"):
        if frame:
            kind, payload = frame.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            out.append(event)
    return out


def stream(fmt: ResponsesFormatter, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    data = fmt.stream_start()
    for i, piece in enumerate(pieces):
        data += fmt.stream_chunk([Output(0, piece, [1], i + 1)], None) or b""
    data += fmt.stream_chunk([Output(0, "", [2], len(pieces) + 1, finish)], None) or b""
    return events(data)


def assemble(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from the events (as the openai SDK's accumulator), checking their order."""
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs[:2]] == ["response.created", "response.in_progress"]
    output: list[dict[str, Any]] = []
    open_index = None
    dones = [e for e in evs if e["type"] == "response.output_item.done"]
    for e in evs[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_index is None and e["output_index"] == len(output)  # one item at a time, in order
            output.append(json.loads(json.dumps(e["item"])))
            open_index = e["output_index"]
            continue
        assert e["output_index"] == open_index
        item = output[e["output_index"]]
        if kind == "response.content_part.added":
            item["content"].append(dict(e["part"]))
        elif kind == "response.output_text.delta":
            item["content"][e["content_index"]]["text"] += e["delta"]
            item["content"][e["content_index"]]["logprobs"] += e["logprobs"]
        elif kind == "response.reasoning_text.delta":
            item["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"] and e["name"] == item["name"]
        elif kind == "response.output_text.done" or kind == "response.reasoning_text.done":
            assert e["text"] == item["content"][e["content_index"]]["text"]
        elif kind == "response.output_item.done":
            cut = evs[-1]["type"] == "response.incomplete" and e is dones[-1]
            status = "incomplete" if cut else "completed"  # the item the limit cut is incomplete, as OpenAI marks it
            assert e["item"] == {**item, "status": status}
            output[e["output_index"]], open_index = e["item"], None
        else:
            assert kind == "response.content_part.done", kind
    assert open_index is None
    last = evs[-1]
    assert last["type"] in ("response.completed", "response.incomplete") and last["response"]["output"] == output
    return dict(last["response"])


def final(fmt: ResponsesFormatter, text: str, finish: str = "stop") -> dict[str, Any]:
    body = json.loads(fmt.final([Output(0, text, [1], 9, finish)], Usage(7, 9, 16, PromptTokensDetails(3))))
    assert isinstance(body, dict)
    return body


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in response.items() if k != "usage"}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return out


def test_the_final_response() -> None:
    body = final(formatter(), ANSWER)
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Paris is a city."}]
    assert body["output_text"] == "Let me check." and body["output"][1]["content"][0]["text"] == "Let me check."
    calls = body["output"][2:]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in calls)
    assert body["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 16,
    }


@pytest.mark.parametrize("cut", range(1, len(ANSWER)))
def test_every_two_piece_cut_assembles_the_final_response(cut: int) -> None:
    want = without_ids(final(formatter(), ANSWER))
    evs = stream(formatter(), [ANSWER[:cut], ANSWER[cut:]])
    assert without_ids(assemble(evs)) == want
    texts = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert texts == "Let me check."  # calls never leak as text


@pytest.mark.parametrize("seed", range(50))
def test_random_cuts_assemble_the_final_response(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 30)))
    pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)])]
    assert without_ids(assemble(stream(formatter(), pieces))) == without_ids(final(formatter(), ANSWER))


@pytest.mark.parametrize("tools, reasoning", [(False, False), (True, False), (False, True)])
def test_plain_text_and_the_length_limit(tools: bool, reasoning: bool) -> None:
    text = "Hello 你好 there"
    want = final(formatter(tools, reasoning), text, "length")
    assert want["status"] == "incomplete" and want["incomplete_details"] == {"reason": "max_output_tokens"}
    assert want["output"][-1]["status"] == "incomplete"
    assert want["output_text"] == text if not reasoning else want["output"][0]["type"] == "reasoning"
    for cut in range(1, len(text)):
        got = assemble(stream(formatter(tools, reasoning), [text[:cut], text[cut:]], "length"))
        assert without_ids(got) == without_ids(want)


def test_an_empty_answer_has_no_items() -> None:
    evs = stream(formatter(False, False), [])
    assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.completed"]
    assert evs[-1]["response"]["output"] == [] and evs[-1]["response"]["output_text"] == ""
    assert evs[-1]["response"]["usage"]["output_tokens"] == 1


def test_logprobs_follow_the_text_whichever_way_it_came() -> None:
    tokens = ["Hel", "lo", " 你", "好", ""]  # the last: an end token, which writes no text
    lp = [
        {"token": t, "logprob": -float(i), "bytes": list(t.encode()), "top_logprobs": []} for i, t in enumerate(tokens)
    ]

    def make() -> ResponsesFormatter:
        return ResponsesFormatter(
            dict(BASE), 7, lambda: None, lambda out: lp[int(out.token_ids[0]) : int(out.token_ids[-1]) + 1]
        )

    body = json.loads(make().final([Output(0, "".join(tokens), [0, 4], 5, "stop")], Usage(7, 5, 12)))
    assert body["output"][0]["content"][0]["logprobs"] == lp
    fmt = make()
    data = fmt.stream_start()
    for i, t in enumerate(tokens):
        data += fmt.stream_chunk([Output(0, t, [i], i + 1, "stop" if i == len(tokens) - 1 else None)], None) or b""
    evs = events(data)
    assert without_ids(assemble(evs)) == without_ids(body)
    assert [x for e in evs if e["type"] == "response.output_text.delta" for x in e["logprobs"]] == lp


def test_an_error_mid_stream_is_the_next_event() -> None:
    fmt = formatter(False, False)
    before = events(fmt.stream_start() + (fmt.stream_chunk([Output(0, "Hi", [1], 1)], None) or b""))
    error = events(framing(fmt).error(APIError("engine died", status=500)))
    assert error == [
        {"type": "error", "code": "500", "message": "engine died", "param": None, "sequence_number": len(before)}
    ]
