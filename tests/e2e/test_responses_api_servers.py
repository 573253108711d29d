"""/v1/responses with --api-server-count 2: a response stored by one API process is read, continued, deleted
and cancelled through the other (the shared store, server/families/responses/store.py).

Each client holds one kept-alive connection, and which process accepted it is read from /proc (the kernel hands
a new connection to whichever process accepts first): every answer is checked to come from the process meant.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.families.responses.store import DB_NAME
from tests.e2e.conftest import API_PROCESS, Server, start_server
from tests.helpers.processes import children, connection_owner, wait_until

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _owner(srv: Server, r: httpx.Response) -> int | None:
    """The API process holding the server side of the connection `r` came over."""
    sock = r.extensions["network_stream"].get_extra_info("socket")
    return connection_owner(srv.port, sock.getsockname()[1], children(srv.proc.pid, API_PROCESS))


class Pinned:
    """Requests to API process `pid`, each over a kept-alive connection it accepted and checked to be its own.

    A connection idle past the server's keep-alive (a slow request on the other process, on a busy machine) is
    closed; `sdk` and `call` first make sure of one to `pid` (new connections until one lands there)."""

    def __init__(self, srv: Server, http: httpx.Client, pid: int) -> None:
        self.srv, self.http, self.pid = srv, http, pid

    def _pinned(self) -> httpx.Client:
        def landed() -> bool:
            if _owner(self.srv, self.http.get(f"{self.srv.url}/health")) == self.pid:
                return True
            self.http.close()
            self.http = httpx.Client(timeout=120)
            return False

        wait_until(landed, 60, f"a connection to API process {self.pid}")
        return self.http

    @property
    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.srv.url}/v1", api_key="none", max_retries=0, http_client=self._pinned())

    def check(self, r: httpx.Response) -> httpx.Response:
        assert _owner(self.srv, r) == self.pid, "answered by another process"
        return r

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.check(self._pinned().request(method, f"{self.srv.url}/v1/responses{path}", **kw))


def pin_both(srv: Server) -> list[Pinned]:
    """One client on each API process (new connections until both have one, each answering /health 200)."""
    apis = children(srv.proc.pid, API_PROCESS)
    assert len(apis) == 2, apis
    pinned: dict[int, Pinned] = {}

    def one_more() -> bool:
        http = httpx.Client(timeout=120)
        r = http.get(f"{srv.url}/health")
        owner = _owner(srv, r)
        if r.status_code == 200 and owner is not None and owner not in pinned:
            pinned[owner] = Pinned(srv, http, owner)
        else:
            http.close()
        return len(pinned) == 2

    wait_until(one_more, 120, "a connection to each API process")
    return list(pinned.values())


def store_files(srv: Server) -> set[Path]:
    """The store's database files the API processes hold open."""
    held = set()
    for pid in children(srv.proc.pid, API_PROCESS):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = Path(os.readlink(fd))
            if target.name == DB_NAME:
                held.add(target)
    return held


@pytest.fixture(scope="module")
def srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen25_ckpt,
        tmp_path_factory.mktemp("responses-2"),
        "--api-server-count",
        "2",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--responses-store-size",
        "4",
        env={"SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "60"},
    )
    for p in pin_both(s):  # each process opens the store on first use: one file for both, in the launcher's dir
        assert p.call("GET", "/resp_none").status_code == 404
    files = store_files(s)
    assert len(files) == 1 and oct(next(iter(files)).parent.stat().st_mode)[-3:] == "700", files
    yield s
    assert s.stop() == 0
    assert not next(iter(files)).parent.exists()  # removed when the launcher exits


def test_stored_on_one_process_read_continued_and_deleted_on_the_other(srv: Server) -> None:
    a, b = pin_both(srv)
    kw: Any = dict(model="tiny", tools=[WEATHER], max_output_tokens=60, temperature=0)
    raw = a.sdk.responses.with_raw_response.create(input="Weather in Paris?", tool_choice="required", **kw)
    a.check(raw.http_response)
    r = raw.parse()
    got = b.call("GET", f"/{r.id}")
    assert got.status_code == 200 and got.json() == json.loads(raw.http_response.text)
    call = next(o for o in r.output if o.type == "function_call")
    follow = b.call(
        "POST",
        "",
        json={
            **kw,
            "previous_response_id": r.id,
            "tool_choice": "none",
            "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "22C, sunny"}],
        },
    )
    assert follow.status_code == 200, follow.text
    fid = follow.json()["id"]
    whole = a.sdk.responses.create(
        tool_choice="none",
        store=False,
        **kw,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "22C, sunny"},
        ],
    )
    assert whole.usage is not None and whole.usage.input_tokens == follow.json()["usage"]["input_tokens"]
    # an item of the response stored by b, referred to through a
    ref = a.call(
        "POST",
        "",
        json={
            **kw,
            "store": False,
            "tool_choice": "none",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "item_reference", "id": call.id},
                {"type": "function_call_output", "call_id": call.call_id, "output": "22C, sunny"},
            ],
        },
    )
    assert ref.status_code == 200 and ref.json()["output_text"] == whole.output_text
    assert a.call("DELETE", f"/{fid}").json() == {"id": fid, "object": "response.deleted", "deleted": True}
    for p in (a, b):
        gone = p.call("GET", f"/{fid}")
        assert gone.status_code == 404 and gone.json()["error"]["message"] == f"Response with id '{fid}' not found."
    assert b.call("DELETE", f"/{fid}").status_code == 404


def test_lru_bound_holds_over_both_processes(srv: Server) -> None:
    a, b = pin_both(srv)
    ids = [p.sdk.responses.create(model="tiny", input="hi", max_output_tokens=2).id for p in (a, b, a, b, a)]
    assert b.call("GET", f"/{ids[0]}").status_code == 404  # --responses-store-size 4: 5 stored, the first went
    for rid in ids[1:]:
        assert a.call("GET", f"/{rid}").status_code == 200
    cont = b.call("POST", "", json={"model": "tiny", "input": "hi", "previous_response_id": ids[0]})
    assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"


def test_background_on_one_process_cancelled_from_the_other(srv: Server) -> None:
    a, b = pin_both(srv)
    aborted = 'finished_reason="abort"'
    before = srv.metric("spindle_request_success_total", aborted)
    engine = srv.engine_pid()
    os.kill(engine, signal.SIGSTOP)  # the generation cannot end before the cancel
    try:
        queued = a.call(
            "POST", "", json={"model": "tiny", "input": "hi", "max_output_tokens": 50, "background": True}
        ).json()
        assert queued["status"] == "queued"
        assert b.call("GET", f"/{queued['id']}").json()["status"] == "queued"
        cancelled = b.call("POST", f"/{queued['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        # a (which runs it) sees the mark and aborts its engine request: counted as aborted
        wait_until(
            lambda: srv.metric("spindle_request_success_total", aborted) == before + 1,
            30,
            "the cancelled background request aborted",
        )
    finally:
        os.kill(engine, signal.SIGCONT)
    for p in (a, b):
        assert p.call("GET", f"/{queued['id']}").json()["status"] == "cancelled"
    done = a.sdk.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    wait_until(lambda: b.call("GET", f"/{done.id}").json()["status"] != "queued", 60, "the background response")
    again = b.call("POST", f"/{done.id}/cancel")  # finished: nothing to cancel, answered as it stands
    assert again.status_code == 200 and again.json()["status"] == "incomplete"
