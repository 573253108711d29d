"""Acceptance 1: the official openai SDK, sync and async, against the real server."""

from __future__ import annotations

from pathlib import Path

import anyio
import openai
import pytest

from tests.e2e.conftest import Server, start_server

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi 你好"}]


def test_sync_client(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.usage is not None and 1 <= c.usage.completion_tokens <= 5
    assert c.choices[0].finish_reason in ("stop", "length")

    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens <= 6

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=6,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [chat.choices[0].finish_reason]

    streamed = list(
        client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(s.choices[0].text for s in streamed if s.choices) == c.choices[0].text
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == c.usage.completion_tokens


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_client(server: Server, anyio_backend: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
    async with client:
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"count {i}"}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            results[i] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        for i in range(8):
            ref = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"count {i}"}], max_tokens=8, temperature=0
            )
            assert results[i] == ref.choices[0].message.content


def test_uvloop_worker_streams(qwen2_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(qwen2_ckpt, tmp_path, "--worker-class", "uvloop")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
        full = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
        parts = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    finally:
        assert s.stop() == 0
