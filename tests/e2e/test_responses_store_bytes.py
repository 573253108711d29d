"""The Responses store's byte cap through the real server and the openai SDK: a chain of turns continues while
each turn's items are stored once, the least recent go past the cap, and a response over the cap by itself answers
400 naming the flag."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Server, start_server

CAP = 24_000


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from demo.checkpoints import demo_checkpoint_path

    model: Path = demo_checkpoint_path()
    server: Server = start_server(model, tmp_path_factory.mktemp("store"), "--responses-store-max-bytes", str(CAP))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    server.stop()


def test_a_chain_within_the_cap_and_a_response_over_it(client: openai.OpenAI) -> None:
    turn = "one two three four five six seven eight nine ten " * 20  # 1 KB a turn
    previous, ids = None, []
    for _ in range(10):  # about 2 KB each, stored once: 20 KB fit 24 KB (a copy of the chain per turn: 60 KB)
        r = client.responses.create(
            model="tiny", input=turn, max_output_tokens=4, temperature=0, previous_response_id=previous
        )
        previous = r.id
        ids.append(r.id)
    assert client.responses.retrieve(ids[0]).id == ids[0]  # nothing evicted: the whole chain fits
    big = {f"k{i}": "v" * 500 for i in range(16)}  # 8 KB of metadata a response, kept with it
    for _ in range(3):
        client.responses.create(model="tiny", input="hi", max_output_tokens=2, temperature=0, metadata=big)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])  # the least recently used went past the cap
    with pytest.raises(openai.BadRequestError) as e:  # 30 KB of input in a few hundred tokens
        client.responses.create(model="tiny", input="=" * 30_000, max_output_tokens=2, temperature=0)
    assert "--responses-store-max-bytes" in str(e.value)
