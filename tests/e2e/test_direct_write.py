"""Direct body writes (server/http/direct_body.py) put the same bytes on the wire as Hypercorn's ASGI path:
the same greedy streams from a server with them and one with SPINDLE_DIRECT_WRITE=0, compared after the
ids and timestamps that differ per request are masked."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import h11
import pytest

from tests.e2e.conftest import Server, start_server

_VARYING = re.compile(rb'"(id|created)":("[^"]*"|\d+)')  # per-request id and creation time


def stream(server: Server, path: str, body: dict[str, object]) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """(response headers less date, body) of one POST over a raw socket, de-chunked by h11."""
    data = json.dumps(body).encode()
    client = h11.Connection(h11.CLIENT)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(
            client.send(
                h11.Request(
                    method="POST",
                    target=path,
                    headers=[
                        ("host", "x"),
                        ("content-type", "application/json"),
                        ("content-length", str(len(data))),
                        ("x-request-id", "same-" + path),
                    ],
                )
            )
        )  # echoed in the headers: the same on both servers
        s.sendall(client.send(h11.Data(data=data)) + client.send(h11.EndOfMessage()))
        headers: list[tuple[bytes, bytes]] = []
        out = bytearray()
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(s.recv(1 << 16))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
                headers = [(k, v) for k, v in event.headers if k != b"date"]
            elif isinstance(event, h11.Data):
                out += event.data
            elif isinstance(event, h11.EndOfMessage):
                return headers, _VARYING.sub(rb'"\1":0', bytes(out))


REQUESTS: list[tuple[str, dict[str, object]]] = [
    (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "The same bytes",
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
]


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_direct_writes_put_the_same_bytes_on_the_wire(worker_class: str, qwen2_ckpt: Path, tmp_path: Path) -> None:
    seen: dict[str, list[tuple[list[tuple[bytes, bytes]], bytes]]] = {}
    for direct in ("1", "0"):
        server = start_server(
            qwen2_ckpt,
            tmp_path,
            "--worker-class",
            worker_class,
            env={"SPINDLE_DIRECT_WRITE": direct, "SPINDLE_LOG_LEVEL": "INFO"},
        )
        try:
            seen[direct] = [stream(server, path, body) for path, body in REQUESTS]
        finally:
            server.stop()
        log = server.log.read_text()
        assert "direct body writes turned off" not in log and "unknown layout" not in log
        assert ("SPINDLE_DIRECT_WRITE=0: streaming through ASGI only" in log) == (direct == "0")
    for (headers, body), (plain_headers, plain_body) in zip(seen["1"], seen["0"]):
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: {") > 20
        assert headers == plain_headers
        if body != plain_body:  # say where they differ: a rare CI failure needs the bytes to be diagnosed
            at = next(i for i, (a, b) in enumerate(zip(body + b"\0", plain_body + b"\1")) if a != b)
            raise AssertionError(
                f"direct and ASGI bodies differ at byte {at}:\n"
                f"direct {body[max(0, at - 300) : at + 200]!r}\nASGI   {plain_body[max(0, at - 300) : at + 200]!r}"
            )
