"""`--models-dir`: a client that leaves while its model loads (streamed or not) leaves nothing behind: the load
completes, the model goes idle (the idle timeout unloads it, which it would not do for a request still counted),
no error is logged, and the next request is served."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio
import anyio.lowlevel
import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_models_dir import complete, start
from tests.helpers.processes import children

pytestmark = pytest.mark.anyio
BODY = {"model": "only", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


async def until(condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
    """Poll another process's state (nothing to wait on) until `condition()` holds (a load on a busy machine may
    take a minute)."""
    with anyio.move_on_after(timeout):
        while not condition():
            await anyio.sleep(0.05)
    assert condition(), f"not within {timeout} s: {what}"


def counted(server: Server, name: str) -> float:
    return server.metric(name, 'model_name="only"') if f'{name}{{model_name="only"}}' in metrics(server) else 0.0


def metrics(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


async def left_then_served(server: Server, loads: int) -> None:
    """The load the client left completes, the idle timeout unloads the model, and the next request is served."""
    await until(lambda: counted(server, "spindle_model_loads_total") == loads, "the load completed")
    await until(lambda: counted(server, "spindle_model_unloads_total") == loads, "the idle model unloaded")
    assert complete(server, "only").status_code == 200


async def test_a_client_leaving_while_its_model_loads(qwen2_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "dir"
    root.mkdir()
    (root / "only").symlink_to(qwen2_ckpt)
    server = start(root, tmp_path, "--model-idle-timeout", "1")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            # streamed: it leaves after the first keep-alive comment
            with anyio.CancelScope() as scope:
                async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                    lines = r.aiter_lines()
                    assert await lines.__anext__() == ": loading model"
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
            assert scope.cancelled_caught
            await left_then_served(server, 1)
            await until(lambda: counted(server, "spindle_model_unloads_total") == 2, "the idle model unloaded")
            # not streamed: it leaves once the engine process is starting
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(client.post, "/v1/completions", json=BODY))
                    await until(lambda: bool(children(server.proc.pid, "engine")), "the engine started")
                    scope.cancel()
            assert scope.cancelled_caught
            await left_then_served(server, 3)
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
