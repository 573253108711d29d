"""--models-dir with --api-server-count 2 against real engine subprocesses (server/fleet/owner.py): both models
through both API processes, one load for concurrent first requests from both, a failed load is a 503 in each and is
tried again, an LRU unload waits for the other process's stream, /v1/models agrees, a stored response is read through
the other process, an engine's death unloads its model everywhere, Ollama's keep_alive sets the owner's idle
unload, SIGTERM drains every process, a SIGKILLed launcher takes every process.

Which process answers is forced: each client holds one kept-alive connection, and /proc says which API process
accepted it (tests/helpers/processes.py connection_owner)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import API_PROCESS, Server
from tests.e2e.test_models_dir import start
from tests.helpers.processes import children, connection_owner, process_tree, wait_gone, wait_until

BODY = {"prompt": "Hello", "max_tokens": 4}


def models_dir(root: Path, ckpt: Path) -> Path:
    """alpha and beta (symlinks to one tiny checkpoint) and a broken one."""
    root.mkdir()
    for name in ("alpha", "beta"):
        (root / name).symlink_to(ckpt)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "qwen2"}')  # no weights, no tokenizer
    return root


@pytest.fixture(scope="module")
def served(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("models_api")
    server = start(models_dir(tmp / "dir", qwen2_ckpt), tmp, "--api-server-count", "2", "--max-loaded-models", "1")
    yield server
    server.stop()


def _owner(server: Server, client: httpx.Client, response: httpx.Response, apis: list[int]) -> int | None:
    port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return connection_owner(server.port, port, apis)


def pinned(server: Server, per_process: int = 1) -> list[list[httpx.Client]]:
    """`per_process` clients for each API process, each on a connection that process accepted (a client sends one
    request at a time: a second one at once would open a connection any process may accept)."""
    apis = children(server.proc.pid, API_PROCESS)
    assert len(apis) == 2, apis
    found: dict[int, list[httpx.Client]] = {pid: [] for pid in apis}
    for _ in range(200):
        if all(len(c) == per_process for c in found.values()):
            return [found[pid] for pid in apis]
        client = httpx.Client(base_url=server.url, timeout=180)
        owner = _owner(server, client, client.get("/health"), apis)
        if owner is not None and len(found[owner]) < per_process:
            found[owner].append(client)
        else:
            client.close()
    raise AssertionError("could not get a connection to each API process")


def answered_by(server: Server, client: httpx.Client, response: httpx.Response) -> int | None:
    return _owner(server, client, response, children(server.proc.pid, API_PROCESS))


def loaded(client: httpx.Client) -> dict[str, bool]:
    return {card["id"]: card["loaded"] for card in client.get("/v1/models").json()["data"]}


def loads_logged(server: Server, model: str) -> int:
    """Engines the owner started for `model` (its log line per load)."""
    return server.log.read_text().count(f"loading model {model} for 2 API processes")


def test_one_load_for_first_requests_from_both_processes(served: Server) -> None:
    clients = pinned(served, per_process=2)
    flat = [c for per in clients for c in per]
    assert [loaded(per[0]) for per in clients] == [{"alpha": False, "beta": False, "broken": False}] * 2
    with ThreadPoolExecutor(len(flat)) as pool:
        answers = list(pool.map(lambda c: c.post("/v1/completions", json={"model": "alpha", **BODY}), flat))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert {answered_by(served, c, r) for c, r in zip(flat, answers, strict=True)} == set(
        children(served.proc.pid, API_PROCESS)
    )
    assert loads_logged(served, "alpha") == 1
    assert [loaded(per[0]) for per in clients] == [{"alpha": True, "beta": False, "broken": False}] * 2
    for per in clients:  # each process's own side of it opened once
        text = per[0].get("/metrics").text
        assert 'spindle_model_loads_total{model_name="alpha"} 1.0' in text


def test_a_failed_load_is_503_in_each_process_and_tried_again(served: Server) -> None:
    for i, per in enumerate(pinned(served)):
        r = per[0].post("/v1/completions", json={"model": "broken", **BODY})
        assert r.status_code == 503 and "`broken` could not be loaded" in r.json()["error"]["message"], r.text
        assert loads_logged(served, "broken") == i + 1  # the second process's request tried again
    clients = pinned(served)  # alpha was unloaded to make room for it (as in one process)
    assert [loaded(per[0]) for per in clients] == [{"alpha": False, "beta": False, "broken": False}] * 2


def test_the_lru_unload_waits_for_the_other_processes_stream(served: Server) -> None:
    """--max-loaded-models 1: beta's first request (process B) needs alpha unloaded while alpha streams in process A;
    the unload waits for that stream, which ends whole."""
    a, b = (per[0] for per in pinned(served))
    body = {"model": "alpha", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    after_beta_sent: list[str] = []
    with a.stream("POST", "/v1/completions", json=body) as r, ThreadPoolExecutor(1) as pool:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        beta = pool.submit(b.post, "/v1/completions", json={"model": "beta", **BODY})
        after_beta_sent = list(lines)
        assert not beta.done()  # beta needs alpha's place: it waited for the stream's end, and loads now
        assert beta.result().status_code == 200
    assert len(after_beta_sent) > 100, len(after_beta_sent)  # the stream was well in flight when beta was asked for
    events = [json.loads(line[6:]) for line in [first, *after_beta_sent] if line != "data: [DONE]"]
    assert after_beta_sent[-1] == "data: [DONE]"
    assert not [e for e in events if "error" in e]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert [loaded(per[0]) for per in pinned(served)] == [{"alpha": False, "beta": True, "broken": False}] * 2
    assert loads_logged(served, "beta") == 1


def test_a_stored_response_is_read_through_the_other_process(served: Server) -> None:
    a, b = (per[0] for per in pinned(served))
    r = a.post("/v1/responses", json={"model": "beta", "input": "Hello", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    stored = b.get(f"/v1/responses/{r.json()['id']}")
    assert stored.status_code == 200 and stored.json()["id"] == r.json()["id"]
    assert answered_by(served, a, r) != answered_by(served, b, stored)


def test_an_engine_death_unloads_it_everywhere_and_the_next_request_loads_it(served: Server) -> None:
    engines = [e for api in children(served.proc.pid, API_PROCESS) for e in children(api, "engine")]
    assert len(engines) == 1, engines
    os.kill(engines[0], signal.SIGKILL)
    clients = [per[0] for per in pinned(served)]
    every = {"alpha": False, "beta": False, "broken": False}
    wait_until(lambda: [loaded(c) for c in clients] == [every] * 2, 30, "beta unloaded in both processes")
    assert clients[1].post("/v1/completions", json={"model": "beta", **BODY}).status_code == 200
    assert loads_logged(served, "beta") == 2
    assert [loaded(c) for c in clients] == [{**every, "beta": True}] * 2


def test_keep_alive_through_one_process_sets_the_owners_idle_unload(served: Server) -> None:
    """Ollama's keep_alive reaches the owner, which holds the idle unloads: beta goes 1.5 s after its request,
    in both processes; a request without one leaves the flag's rule (here: no idle unload)."""
    (a,), (b,) = pinned(served)
    body = {"model": "beta", "prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
    r = a.post("/api/generate", json={**body, "keep_alive": "1.5s"})
    assert r.status_code == 200, r.text
    wait_until(lambda: not loaded(b)["beta"], 60, "beta unloaded 1.5 s after its request")
    assert not loaded(a)["beta"]
    r = b.post("/api/generate", json=body)
    assert r.status_code == 200 and r.json()["load_duration"] > 0, r.text  # reloaded: the first request reports it
    assert loaded(a)["beta"]


def test_sigterm_drains_every_process(served: Server) -> None:
    """A beta stream in each process when SIGTERM comes: both finish whole, then every process and engine exits."""
    clients = [per[0] for per in pinned(served)]
    engines = [e for api in children(served.proc.pid, API_PROCESS) for e in children(api, "engine")]
    assert len(engines) == 1, engines  # beta's, a child of API process 0
    body = {"model": "beta", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = [threading.Event() for _ in clients]
    results: list[list[str]] = [[] for _ in clients]

    def stream(i: int) -> None:
        with clients[i].stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[i].append(line)
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    served.proc.send_signal(signal.SIGTERM)
    assert all(len(lines) < 400 for lines in results)  # both in flight
    for t in threads:
        t.join(60)
    assert served.proc.wait(60) == 0
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    wait_gone(engines, 30)


def test_a_killed_launcher_takes_every_process_and_engine(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """No engine hangs on the launcher's lifeline here: the API processes watch a pipe of its own."""
    root = tmp_path / "dir"
    root.mkdir()
    (root / "only").symlink_to(qwen2_ckpt)
    server = start(root, tmp_path, "--api-server-count", "2")
    try:
        assert (
            httpx.post(f"{server.url}/v1/completions", json={"model": "only", **BODY}, timeout=180).status_code == 200
        )
        tree = process_tree(server.proc.pid)
        assert len([p for p in tree if p in children(server.proc.pid, API_PROCESS)]) == 2
        assert any(children(api, "engine") for api in children(server.proc.pid, API_PROCESS))
        server.proc.kill()
        server.proc.wait()
        wait_gone(tree, 30)
    finally:
        server.stop()
