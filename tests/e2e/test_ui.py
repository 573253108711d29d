"""The chat page in a real browser (headless Chromium, Playwright) against the real server, reached under
--root-path with an API key: a streamed reply equals the API's greedy answer, stop aborts the engine request, a wrong
key shows the server's error, no request leaves the server's origin, and model output cannot run script.

One server for the module: --root-path /llm (the page is opened at /llm/, so every URL it uses is relative),
--api-key (the page is open, the API is not; /metrics stays open for the test's polling), and a 4k context so that a
reply can be long enough to stop mid-stream.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from server.http import sse, unavailable
from server.http.errors import APIError
from tests.e2e.browser import launch
from tests.e2e.conftest import Server, start_server

KEY = "ui-secret"
ROOT = "/llm"
MAX_LEN = 4096
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "chat-page.png"
SCREENSHOT_MAX_BYTES = 150_000
SYSTEM = "You are the demo model of spindle: random weights, real pipeline."
ASK = "Tell me about spindles."


@pytest.fixture(scope="module")
def long_ckpt(qwen2_4k_ckpt: Path) -> Path:
    assert MAX_LEN == 4096  # the shared checkpoint's positions
    return qwen2_4k_ckpt


@pytest.fixture(scope="module")
def ui_server(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        long_ckpt,
        tmp_path_factory.mktemp("ui"),
        "--api-key",
        KEY,
        "--metrics-public",
        "--root-path",
        ROOT,
        "--max-model-len",
        str(MAX_LEN),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch() as b:
        yield b


class Page:
    """One browser tab on the chat page, recording every URL it requests."""

    def __init__(self, browser: Any, server: Server) -> None:
        self.server = server
        # without the page's Content-Security-Policy: the page must be safe and stay on its origin by itself (CSP
        # is a second line, checked in tests/server/routes/test_ui_route.py), and Playwright's waits evaluate strings
        self.context = browser.new_context(viewport={"width": 960, "height": 600}, bypass_csp=True)
        self.page = self.context.new_page()
        self.requested: list[str] = []
        self.page.on("request", lambda r: self.requested.append(r.url))
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))

    def open(self, path: str = f"{ROOT}/", key: str | None = KEY) -> None:
        self.page.goto(self.server.url + path)
        if key is not None:
            self.set_key(key)

    def set_key(self, key: str) -> None:
        self.page.get_by_test_id("api-key").fill(key)
        self.page.get_by_test_id("api-key").dispatch_event("change")  # saved and the models reloaded

    def wait_model(self) -> None:
        self.page.wait_for_function(
            "document.querySelector('[data-testid=model-select]').value === 'tiny'", timeout=30_000
        )

    def settings(self, *, temperature: str, max_tokens: str) -> None:
        self.page.get_by_test_id("temperature").fill(temperature)
        self.page.get_by_test_id("max-tokens").fill(max_tokens)

    def send(self, text: str) -> None:
        self.page.get_by_test_id("prompt").fill(text)
        self.page.get_by_test_id("send").click()

    def reply(self, n: int, state: str = "done", timeout: float = 120_000) -> Any:
        """The n-th assistant message (0-based) once it reached `state`."""
        locator = self.page.get_by_test_id("message-assistant").nth(n)
        self.page.wait_for_function(
            "([n, s]) => document.querySelectorAll('[data-testid=message-assistant]')[n]?.dataset.state === s",
            arg=[n, state],
            timeout=timeout,
        )
        return locator

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, ui_server: Server) -> Iterator[Page]:
    p = Page(browser, ui_server)
    yield p
    p.close()
    assert p.errors == [], "the page threw or opened a dialog"


def greedy(server: Server, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        timeout=120,
        json={"model": "tiny", "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": max_tokens},
    )
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0]["message"])


def test_streamed_reply_equals_the_greedy_answer(tab: Page, ui_server: Server) -> None:
    tab.open()
    tab.wait_model()
    tab.settings(temperature="0", max_tokens="24")
    tab.page.get_by_test_id("system-prompt").fill(SYSTEM)
    assert tab.page.locator("#attachment").is_hidden() and tab.page.get_by_test_id("image").is_hidden()
    tab.send(ASK)
    first = tab.reply(0)
    raw = first.get_attribute("data-raw")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    assert raw and raw == greedy(ui_server, history, 24)["content"]
    stats = first.get_by_test_id("reply-stats").inner_text()
    assert "TTFT" in stats and "tokens/s" in stats and "24 tokens" in stats, stats
    assert first.locator(".body").inner_text().strip()  # rendered, not only stored
    # the second turn carries the first: the page sends the whole conversation
    tab.send("And then?")
    second = tab.reply(1).get_attribute("data-raw")
    history += [{"role": "assistant", "content": raw}, {"role": "user", "content": "And then?"}]
    assert second == greedy(ui_server, history, 24)["content"]
    assert tab.page.get_by_test_id("message-user").count() == 2
    assert tab.page.get_by_test_id("stop").is_disabled() and tab.page.get_by_test_id("send").is_enabled()
    assert tab.page.get_by_test_id("error").is_hidden()
    _screenshot(tab)


def _screenshot(tab: Page) -> None:
    """The README's picture of the page: rewritten with SPINDLE_UPDATE_SCREENSHOT=1, else checked to exist."""
    if os.environ.get("SPINDLE_UPDATE_SCREENSHOT") == "1":
        tab.page.screenshot(path=str(SCREENSHOT))
    png = SCREENSHOT.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) < SCREENSHOT_MAX_BYTES


def _metric_reaches(server: Server, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (seen := server.metric(name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {seen}, not {value}"
        time.sleep(0.05)  # polling /metrics: the engine reports its running set with every step and heartbeat


def test_stop_aborts_the_engine_request(tab: Page, ui_server: Server) -> None:
    aborted = ui_server.metric("spindle_request_success_total", 'finished_reason="abort"')
    tab.open()
    tab.wait_model()
    tab.settings(temperature="1", max_tokens=str(MAX_LEN - 100))  # minutes of tokens on this model: only stop ends it
    assert tab.page.get_by_test_id("stop").is_disabled()
    tab.send("Write a very long story.")
    tab.page.wait_for_function(
        "document.querySelector('[data-testid=message-assistant]')?.dataset.raw?.length > 0", timeout=60_000
    )
    _metric_reaches(ui_server, "spindle_num_requests_running", 1)
    tab.page.get_by_test_id("stop").click()
    reply = tab.reply(0, "stopped", timeout=30_000)
    _metric_reaches(ui_server, "spindle_num_requests_running", 0)
    assert ui_server.metric("spindle_request_success_total", 'finished_reason="abort"') == aborted + 1
    assert "stopped" in reply.get_by_test_id("reply-stats").inner_text()
    assert tab.page.get_by_test_id("stop").is_disabled() and tab.page.get_by_test_id("send").is_enabled()
    assert tab.page.get_by_test_id("error").is_hidden()  # a stop is not an error


def test_wrong_key_shows_the_error(tab: Page) -> None:
    tab.open(key="not-the-key")
    error = tab.page.get_by_test_id("error")
    error.wait_for(state="visible", timeout=30_000)  # /v1/models refused
    assert "401" in error.inner_text() and "API key" in error.inner_text()
    tab.send("hello")
    tab.reply(0, "error", timeout=30_000)
    assert "401" in error.inner_text() and "Invalid or missing API key" in error.inner_text()
    # the key is kept in the browser: a reload brings it back, and the right one clears the error
    tab.page.reload()
    assert tab.page.get_by_test_id("api-key").input_value() == "not-the-key"
    tab.set_key(KEY)
    tab.wait_model()
    error.wait_for(state="hidden", timeout=30_000)


def test_server_message_of_a_400_is_shown(tab: Page) -> None:
    tab.open()
    tab.wait_model()
    tab.settings(temperature="0", max_tokens=str(MAX_LEN + 1))
    tab.send("hi")
    tab.reply(0, "error", timeout=30_000)
    text = tab.page.get_by_test_id("error").inner_text()
    assert text.startswith("400") and "maximum context length is 4096 tokens" in text, text


def test_503_and_a_mid_stream_error_are_shown(tab: Page) -> None:
    """The server's words for a 503 and for an error event after streaming began (answered by the test: this server
    is neither overloaded nor dying), through the page's own fetch and SSE path."""
    died = sse.error_frame(APIError("engine core died: gone", status=500)).decode()
    replies = [
        dict(
            status=503,
            headers={"retry-after": "1"},
            content_type="application/json",
            body=unavailable.overloaded("queue_full").body(),
        ),
        dict(
            status=200,
            headers={"content-type": "text/event-stream"},
            body=_events(_delta("partial ")).replace("data: [DONE]", died + "data: [DONE]"),
        ),
    ]
    tab.page.route(f"**{ROOT}/v1/chat/completions", lambda route: route.fulfill(**replies.pop(0)))
    tab.open()
    tab.wait_model()
    error = tab.page.get_by_test_id("error")
    tab.send("first")
    tab.reply(0, "error")
    assert error.inner_text().startswith("503") and "The server is overloaded (queue_full)" in error.inner_text()
    tab.send("second")
    reply = tab.reply(1, "error")
    assert reply.get_attribute("data-raw") == "partial "  # what came before the error stays
    assert "engine core died: gone" in error.inner_text()


def test_no_request_leaves_the_origin(tab: Page, ui_server: Server) -> None:
    tab.open()
    tab.wait_model()
    tab.settings(temperature="0", max_tokens="4")
    tab.send("hi")
    tab.reply(0)
    tab.open(path="/ui")  # the other page path, without the prefix
    tab.wait_model()
    assert any(u.endswith(f"{ROOT}/v1/chat/completions") for u in tab.requested)
    assert any(u.endswith(f"{ROOT}/ui/app.js") for u in tab.requested) and any(
        u.endswith("/ui/app.css") for u in tab.requested
    )
    outside = [u for u in tab.requested if not u.startswith(ui_server.url + "/")]
    assert outside == []


CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}


def _delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {**CHUNK, "choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}


def _events(*events: dict[str, Any]) -> str:
    """An SSE body as the server frames it: `data: {json}` events, then `data: [DONE]`."""
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _sse(*deltas: str) -> str:
    return _events(*map(_delta, deltas), _delta("", "stop"))


HOSTILE = (
    "Hi <scr",
    'ipt>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2"> ',
    '[click](javascript:window.__pwned=3) <a href="javascript:window.__pwned=4">a</a> **bold** `<b>code</b>`',
    '\n\n```\n<script>window.__pwned = 5</script>\n```\n<svg onload="window.__pwned=6"></svg>',
)


def test_script_in_model_output_is_not_executed(tab: Page) -> None:
    """A reply with markup in it, served through the page's own fetch + SSE path (the request is answered by the
    test: a random model will not write <script>): shown as text, nothing runs, no element but the renderer's."""
    tab.page.route(
        f"**{ROOT}/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=_sse(*HOSTILE)),
    )
    tab.open()
    tab.wait_model()
    tab.send("say something dangerous")
    reply = tab.reply(0)
    assert reply.get_attribute("data-raw") == "".join(HOSTILE)
    assert tab.page.evaluate("window.__pwned") is None
    body = reply.locator(".body")
    tags = body.evaluate("b => [...b.querySelectorAll('*')].map(e => e.tagName.toLowerCase())")
    assert set(tags) <= {"p", "strong", "code", "pre", "br"}, tags
    text = body.inner_text()
    assert "<script>window.__pwned = 1</script>" in text and "<img src=x" in text and "<svg onload" in text
    assert body.locator("strong").inner_text() == "bold" and "<b>code</b>" in body.locator("code").first.inner_text()


ALLOWED = {
    "p",
    "br",
    "strong",
    "em",
    "code",
    "pre",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "ul",
    "ol",
    "li",
    "blockquote",
    "a",
}


def test_renderer_writes_only_its_own_tags(tab: Page) -> None:
    """markdown.js on many hostile texts in the page: only the subset's tags, only http(s) links, no handlers."""
    pieces = [
        "<",
        ">",
        '"',
        "'",
        "&",
        "*",
        "**",
        "`",
        "```",
        "[",
        "]",
        "(",
        ")",
        "https://a.example/x",
        "javascript:",
        "<script>",
        "</script>",
        "<img src=x onerror=alert(1)>",
        "# ",
        "- ",
        "1. ",
        "> ",
        "\n",
        "\n\n",
        " ",
        "a",
        "\u0000",
        "onerror=",
        '<a href="',
        "data:text/html,",
        "&lt;",
        "\r\n",
    ]
    rng = random.Random(31)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    tab.open(key=None)
    bad = tab.page.evaluate(
        """texts => {
        const bad = [];
        for (const t of texts) {
            const holder = document.createElement('template');
            holder.innerHTML = window.spindleMarkdown.render(t);  // parsed inert: nothing here can run
            for (const e of holder.content.querySelectorAll('*')) {
                const attrs = [...e.attributes].map(a => a.name);
                const tag = e.tagName.toLowerCase();
                const okAttrs = tag === 'a' ? ['href', 'target', 'rel'] : [];
                if (!attrs.every(a => okAttrs.includes(a))) bad.push([t, tag, attrs]);
                if (tag === 'a' && !/^https?:\\/\\//.test(e.getAttribute('href'))) bad.push([t, 'href']);
                if (!window.__allowed.includes(tag)) bad.push([t, tag]);
            }
        }
        return bad.slice(0, 5);
    }""".replace("window.__allowed", json.dumps(sorted(ALLOWED))),
        texts,
    )
    assert bad == []


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (56, 84, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_server(qwen2_vl_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_vl_ckpt, tmp_path_factory.mktemp("ui-vl"))
    yield s
    s.stop()


def test_image_attached_on_a_vision_model(browser: Any, vl_server: Server, ui_server: Server) -> None:
    tab = Page(browser, vl_server)
    try:
        tab.open("/", key=None)
        tab.wait_model()
        tab.settings(temperature="0", max_tokens="8")
        png = _png(3)
        tab.page.get_by_test_id("image").set_input_files({"name": "noise.png", "mimeType": "image/png", "buffer": png})
        tab.page.locator("#attachment").wait_for(state="visible", timeout=10_000)
        tab.send("What is in the picture?")
        raw = tab.reply(0).get_attribute("data-raw")
        assert tab.page.get_by_test_id("message-user").locator("img").count() == 1
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        r = httpx.post(
            f"{vl_server.url}/v1/chat/completions",
            timeout=120,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": content}],
                "temperature": 0,
                "top_p": 1,
                "max_tokens": 8,
            },
        )
        assert r.status_code == 200 and raw == r.json()["choices"][0]["message"]["content"]
        assert tab.errors == []
    finally:
        tab.close()
    text_page = Page(browser, ui_server)  # a text model's page offers no attach button
    try:
        text_page.open()
        assert text_page.page.get_by_test_id("image").is_hidden()
    finally:
        text_page.close()
