"""`--models-dir` routes every route family by the request's model, against real engine subprocesses: Anthropic's
/v1/messages (and count_tokens), the Responses API (GET and DELETE of a stored response find the model whose store
holds it, loaded or not), embeddings on a pooling model, /tokenize and /detokenize; the chat page, whose picker
lists every model of the folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.browser import launch
from tests.e2e.conftest import Server
from tests.e2e.test_models_dir import loaded, start
from tests.e2e.test_ui import Page

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """chat (generation) and embed (the same checkpoint as a pooling model), one loaded at a time."""
    tmp = tmp_path_factory.mktemp("routes")
    root = tmp / "dir"
    root.mkdir()
    for name in ("chat", "embed"):
        (root / name).symlink_to(qwen2_ckpt)
    (root / "models.yaml").write_text("embed:\n  runner: pooling\n  max-model-len: 128\n")
    server = start(root, tmp)
    yield server
    server.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=180)


def test_anthropic_messages_and_count_tokens(served: Server) -> None:
    r = post(served, "/v1/messages", {"model": "chat", "max_tokens": 4, "messages": MSGS})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["model"] == "chat"
    counted = post(served, "/v1/messages/count_tokens", {"model": "chat", "messages": MSGS})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    streamed = post(served, "/v1/messages", {"model": "chat", "max_tokens": 4, "messages": MSGS, "stream": True})
    assert streamed.status_code == 200
    assert streamed.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    missing = post(served, "/v1/messages", {"model": "nope", "max_tokens": 4, "messages": MSGS})
    assert missing.status_code == 404
    assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "not_found_error"


def test_a_stored_response_is_found_by_id_loaded_or_not(served: Server) -> None:
    r = post(served, "/v1/responses", {"model": "chat", "input": "hi", "max_output_tokens": 4, "store": True})
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    got = httpx.get(f"{served.url}/v1/responses/{response_id}", timeout=30)
    assert got.status_code == 200 and got.json()["id"] == response_id and got.json()["model"] == "chat"
    # embed's load unloads chat (one loaded at a time): chat's stored responses stay
    assert post(served, "/v1/embeddings", {"model": "embed", "input": "hi"}).status_code == 200
    assert loaded(served) == {"chat": False, "embed": True}
    got = httpx.get(f"{served.url}/v1/responses/{response_id}", timeout=30)
    assert got.status_code == 200 and got.json()["id"] == response_id
    assert loaded(served) == {"chat": False, "embed": True}  # read from the store: no load
    # continued after chat loads again: the conversation is chat's
    body = {"model": "chat", "input": "more", "max_output_tokens": 4, "previous_response_id": response_id}
    assert post(served, "/v1/responses", body).status_code == 200
    deleted = httpx.delete(f"{served.url}/v1/responses/{response_id}", timeout=30)
    assert deleted.json() == {"id": response_id, "object": "response.deleted", "deleted": True}
    for gone in (response_id, "resp_unknown"):
        r = httpx.get(f"{served.url}/v1/responses/{gone}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"Response with id '{gone}' not found."
    assert httpx.delete(f"{served.url}/v1/responses/{response_id}", timeout=30).status_code == 404
    cancel = httpx.post(f"{served.url}/v1/responses/resp_unknown/cancel", timeout=30)
    assert cancel.status_code == 404 and cancel.json()["error"]["code"] == 404


def test_embeddings_on_the_pooling_model_only(served: Server) -> None:
    r = post(served, "/v1/embeddings", {"model": "embed", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == [0, 1] and r.json()["model"] == "embed"
    assert len(r.json()["data"][0]["embedding"]) > 1
    refused = post(served, "/v1/embeddings", {"model": "chat", "input": "a"})  # a generation model: its own 400
    assert refused.status_code == 400 and "pooling" in refused.json()["error"]["message"]


def test_tokenize_and_detokenize_by_model(served: Server) -> None:
    ids = {}
    for model in ("chat", "embed"):
        r = post(served, "/tokenize", {"model": model, "prompt": "Hello world"})
        assert r.status_code == 200, r.text
        ids[model] = r.json()["tokens"]
        back = post(served, "/detokenize", {"model": model, "tokens": ids[model]})
        assert back.status_code == 200 and back.json()["prompt"] == "Hello world"
    assert ids["chat"] == ids["embed"]  # one tokenizer behind both names
    r = post(served, "/tokenize", {"prompt": "Hello"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_background_responses_cancel_through_the_front_and_keep_their_model_busy(served: Server) -> None:
    body = {"model": "chat", "input": "hi", "max_output_tokens": 900, "background": True}
    long = post(served, "/v1/responses", body).json()
    cancelled = httpx.post(f"{served.url}/v1/responses/{long['id']}/cancel", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    running = post(served, "/v1/responses", {**body, "max_output_tokens": 600}).json()
    assert running["status"] in ("queued", "in_progress")
    # embed's load waits for chat's background work (its HTTP request long over), and goes on when that ends
    assert post(served, "/v1/embeddings", {"model": "embed", "input": "hi"}).status_code == 200
    assert loaded(served) == {"chat": False, "embed": True}
    got = httpx.get(f"{served.url}/v1/responses/{running['id']}", timeout=30).json()
    assert got["status"] in ("completed", "incomplete") and got["output"]


def test_the_chat_page_lists_every_model_and_chats_with_the_chosen_one(served: Server) -> None:
    page = httpx.get(f"{served.url}/", timeout=30)
    assert page.status_code == 200 and 'data-testid="model-select"' in page.text
    assert httpx.get(f"{served.url}/ui/app.js", timeout=30).status_code == 200
    # embed loaded, chat not (whatever ran before): the page lists both, and its reply must load chat
    assert post(served, "/v1/embeddings", {"model": "embed", "input": "hi"}).status_code == 200
    assert loaded(served) == {"chat": False, "embed": True}
    with launch() as browser:
        tab = Page(browser, served)
        try:
            tab.open("/", key=None)
            tab.page.wait_for_function("document.querySelectorAll('[data-testid=model-select] option').length > 0")
            picker = tab.page.eval_on_selector_all("[data-testid=model-select] option", "os => os.map(o => o.value)")
            assert picker == ["chat", "embed"]  # every model of the folder, loaded or not
            tab.page.select_option("[data-testid=model-select]", "chat")
            tab.settings(temperature="0", max_tokens="8")
            tab.send("hi")
            raw = tab.reply(0).get_attribute("data-raw")
            assert tab.page.get_by_test_id("error").is_hidden()
        finally:
            tab.close()
    assert tab.errors == [], "the page threw or opened a dialog"
    assert loaded(served) == {"chat": True, "embed": False}  # the page's reply loaded the model it chose
    body = {"model": "chat", "messages": MSGS, "temperature": 0, "top_p": 1, "max_tokens": 8}
    assert raw == post(served, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
