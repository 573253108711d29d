"""Acceptance 2: streamed text == non-streamed text == reference decode, with stop strings."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import Server, start_server
from tests.e2e.sse import events

WORDS = (
    "the cat sat on a mat while 東京 was quiet; naïve café 🙂 zebra quantum 42 ¿qué? "
    "emoji 👩‍👩‍👧 and spaces   then\nnew lines"
).split(" ")


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))


@pytest.fixture(scope="module")
def interval7(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_ckpt, tmp_path_factory.mktemp("i7"), "--stream-interval", "7")
    yield s
    s.stop()


def complete(client: httpx.Client, prompt: str, **kw: object) -> dict:  # type: ignore[type-arg]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def stream(client: httpx.Client, prompt: str, **kw: object) -> tuple[list[str], str | None, object]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True, **kw}
    chunks: list[str] = []
    finish, stop_reason = None, None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for ev in events(r):
            for c in ev["choices"]:
                chunks.append(c["text"])
                if c.get("finish_reason"):
                    finish, stop_reason = c["finish_reason"], c.get("stop_reason")
    return chunks, finish, stop_reason


def test_stream_equals_nonstream_equals_reference(server: Server, qwen2_ckpt: Path) -> None:
    """One event per token, on each worker class (the shared server's parameters)."""
    check_consistency(server, qwen2_ckpt)


def test_stream_interval_7_equals_nonstream_equals_reference(interval7: Server, qwen2_ckpt: Path) -> None:
    """Tokens sent 7 to an event (--stream-interval 7), on the default worker class."""
    check_consistency(interval7, qwen2_ckpt)


def check_consistency(srv: Server, qwen2_ckpt: Path) -> None:
    tok = Tokenizer.from_file(str(qwen2_ckpt / "tokenizer.json"))
    rng = random.Random(1234)
    cases = 50
    stops_tested = 0
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for _ in range(cases):
            prompt = random_prompt(rng)
            body = complete(client, prompt)
            choice = body["choices"][0]
            text, ids = choice["text"], choice["token_ids"]
            prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
            ref = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]
            assert text == ref
            chunks, finish, _ = stream(client, prompt)
            assert "".join(chunks) == text
            assert finish == choice["finish_reason"]

            # a stop string that straddles a token boundary, taken from the greedy output itself
            pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
            bounds = [len(p) for p in pieces if 2 <= len(p) <= len(text) - 2 and text.startswith(p)]
            if not bounds:
                continue
            b = rng.choice(bounds)
            stop = text[b - 2 : b + 2]
            if "\ufffd" in stop:
                continue
            expected = text[: text.find(stop)]
            for include in (False, True):
                want = expected + (stop if include else "")
                got = complete(client, prompt, stop=[stop], include_stop_str_in_output=include)["choices"][0]
                assert got["text"] == want and got["finish_reason"] == "stop" and got["stop_reason"] == stop
                chunks, finish, stop_reason = stream(client, prompt, stop=stop, include_stop_str_in_output=include)
                assert "".join(chunks) == want and (finish, stop_reason) == ("stop", stop)
                if not include:
                    assert all(stop not in c for c in chunks)
            stops_tested += 1
    # The stop-string half is skipped for an output without a usable token boundary (too short, or only
    # inside a character): with 24-token outputs that is rare (1 case of 50 here), and it must stay rare,
    # or this test would pass without testing stop strings.
    assert stops_tested >= cases * 4 // 5, f"only {stops_tested} of {cases} cases tested a stop string"
