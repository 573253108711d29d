"""The llama3_json, pythonic and qwen3_coder tool-call parsers through the official openai SDK against the real
server: a Qwen2.5-tokenized tiny checkpoint served with a chat template that teaches each format (tools in the
system turn, assistant calls written in the format). `required` and named calls are enforced by the parser's
grammar, streamed equal non-streamed, the arguments validate, and the template's rendering of a call reads back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.tools.parser_names import get_tool_parser
from tests.e2e.conftest import Server, start_server
from tests.e2e.test_tools_reasoning import MSGS, NAMED, TOOLS, check_args, streamed_calls

_HEAD = """{%- if tools %}<|im_start|>system
You may call these functions.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
INSTRUCTIONS<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
CALLS<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
_PY = "{% if v is boolean %}{{ 'True' if v else 'False' }}{% else %}{{ v | tojson }}{% endif %}"
FORMATS = {  # parser -> (how the system turn asks for calls, how an assistant turn writes them)
    "llama3_json": (
        'Answer a call as {"name": function name, "parameters": its arguments}, several joined by "; ".',
        '{% for tc in m.tool_calls %}{% if not loop.first %}; {% endif %}{"name": "{{ tc.function.name }}"'
        ', "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}',
    ),
    "pythonic": (
        "Answer calls as a Python list: [func_name1(param1=value1, param2=value2), func_name2(...)]",
        "[{% for tc in m.tool_calls %}{% if not loop.first %}, {% endif %}{{ tc.function.name }}("
        "{%- for k, v in tc.function.arguments.items() %}{% if not loop.first %}, {% endif %}{{ k }}="
        + _PY
        + "{% endfor %}){% endfor %}]",
    ),
    "qwen3_coder": (
        "Call as <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>",
        "{% for tc in m.tool_calls %}{% if not loop.first %}\n{% endif %}<tool_call>\n<function="
        "{{ tc.function.name }}>\n{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
        "{% endfor %}",
    ),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt_srv(
    request: pytest.FixtureRequest, qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    instructions, calls = FORMATS[name]
    template = tmp / "template.jinja"
    template.write_text(_HEAD.replace("INSTRUCTIONS", instructions).replace("CALLS", calls))
    s = start_server(
        qwen25_ckpt,
        tmp,
        "--chat-template",
        str(template),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        name,
        env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1"},
    )
    yield name, s
    s.stop()


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_forced_calls_streamed_equal_non_streamed(fmt_srv: tuple[str, Server], tool_choice: Any) -> None:
    name, srv = fmt_srv
    client = _client(srv)
    kwargs: Any = dict(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=7, temperature=0.8
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (name, choice)
    calls = choice.message.tool_calls or []
    assert calls and not choice.message.content
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_args(call.function.name, call.function.arguments)
    if tool_choice is NAMED:
        assert [c.function.name for c in calls] == ["get_weather"]
    content, streamed, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and not content
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert "tool-call markers" not in srv.log.read_text()  # the template fits the parser: no warning


def test_the_template_writes_what_the_parser_reads(fmt_srv: tuple[str, Server]) -> None:
    name, srv = fmt_srv
    args = {"city": "Rome", "celsius": True}
    history: Any = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    rendered = httpx.post(
        f"{srv.url}/v1/chat/completions/render", timeout=60, json={"model": "tiny", "messages": history, "tools": TOOLS}
    ).json()
    text = httpx.post(
        f"{srv.url}/detokenize", timeout=60, json={"model": "tiny", "tokens": rendered["token_ids"]}
    ).json()["prompt"]
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    parser = get_tool_parser(name).factory(functions)()
    out = parser.feed(turn, final=True)
    got = {}
    for d in out.calls:
        got.setdefault(d.index, ["", ""])
        got[d.index][0] += d.name or ""
        got[d.index][1] += d.arguments
    assert [(n, json.loads(a)) for n, a in got.values()] == [("get_weather", args), ("get_time", {"zone": "UTC"})]
    assert not out.content
    second = _client(srv).chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
