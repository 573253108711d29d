"""Ollama's keep_alive and load_duration on `--models-dir`, with the official `ollama` client: the first request
after a load reports the load's time, later ones 0; keep_alive sets how long the model stays loaded once idle (a
duration string, seconds, negative: forever), /api/ps's expires_at says when; a malformed one is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import ollama
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_models_dir import loaded, start
from tests.helpers.processes import wait_until

ONE = {"num_predict": 1}


@pytest.fixture(scope="module")
def served(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("keep")
    root = tmp / "dir"
    root.mkdir()
    (root / "alpha").symlink_to(qwen2_ckpt)
    server = start(root, tmp)
    yield server
    server.stop()


def expires(client: ollama.Client) -> datetime | None:
    return next((m.expires_at for m in client.ps().models if m.model == "alpha"), None)


def test_load_duration_then_keep_alive_unloads_when_due(served: Server) -> None:
    client = ollama.Client(host=served.url, timeout=180)
    client.generate(model="alpha", prompt="", keep_alive=0)  # unloaded, whatever ran before
    wait_until(lambda: not loaded(served)["alpha"], 60, "alpha unloaded")

    first = client.generate(model="alpha", prompt="Hi", options=ONE, keep_alive="30m")
    assert first.load_duration is not None and first.load_duration > 10**6  # the load: well over a millisecond
    assert first.total_duration is not None and first.total_duration >= first.load_duration
    second = client.chat(model="alpha", messages=[{"role": "user", "content": "Hi"}], options=ONE, keep_alive="30m")
    assert second.load_duration == 0
    due = expires(client)
    assert due is not None and timedelta(minutes=29) < due - datetime.now(UTC) <= timedelta(minutes=30)

    client.generate(model="alpha", prompt="Hi", options=ONE, keep_alive=-1)
    assert expires(client) == datetime(2318, 8, 24, tzinfo=UTC)
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="alpha", prompt="Hi", options=ONE, keep_alive="1 minute")
    assert e.value.status_code == 400 and "keep_alive" in str(e.value)
    assert expires(client) == datetime(2318, 8, 24, tzinfo=UTC)  # a refused request changes nothing

    client.generate(model="alpha", prompt="Hi", options=ONE, keep_alive=1.5)  # seconds
    wait_until(lambda: not loaded(served)["alpha"], 60, "alpha unloaded 1.5 s after its last request")
    reloaded = client.generate(model="alpha", prompt="Hi", options=ONE)
    assert reloaded.load_duration is not None and reloaded.load_duration > 10**6  # a new load, reported again
