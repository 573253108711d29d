"""Reliability items 6 and 7 over real HTTP: the per-request work caps at, just under and just over each
(non-default flags on a module server), every integer field beyond int64 on the three generation routes
(a 400 naming the field, never a 500), and `priority` only under --scheduling-policy priority (as vLLM).

Flags: --scheduling-policy priority --max-prompts-per-request 3 --max-choices-per-request 4 --max-stop-strings 2
--max-stop-string-length 5 --max-stop-token-ids 2 --max-logit-bias 2 --max-allowed-token-ids 3.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.helpers.responses import assert_error

INT64_MAX, INT64_MIN = (1 << 63) - 1, -(1 << 63)
BEYOND_INT64 = (1 << 63, 1 << 64, INT64_MIN - 1)
CHAT = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT_ROUTE, GENERATE = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"


# session, not module: a test here also takes the trio/asyncio `server`, so pytest runs this module in three
# stretches (one per worker class, then the rest), and a module-scoped server would start in each
@pytest.fixture(scope="session")
def limited(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen2_ckpt,
        tmp_path_factory.mktemp("limited"),
        "--scheduling-policy",
        "priority",
        "--max-prompts-per-request",
        "3",
        "--max-choices-per-request",
        "4",
        "--max-stop-strings",
        "2",
        "--max-stop-string-length",
        "5",
        "--max-stop-token-ids",
        "2",
        "--max-logit-bias",
        "2",
        "--max-allowed-token-ids",
        "3",
    )
    yield s
    assert s.proc.poll() is None, "the server died"
    s.stop()


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def body_for(route: str, **fields: Any) -> dict[str, Any]:
    """A one-token request on `route` with `fields` (generate: sampling fields go under sampling_params)."""
    if route == GENERATE:
        top: dict[str, Any] = {k: fields.pop(k) for k in ("priority", "token_ids") if k in fields}
        return {"token_ids": [1000, 1001], **top, "sampling_params": {"max_tokens": 1, **fields}}
    base: dict[str, Any] = {"messages": CHAT} if route == CHAT_ROUTE else {"prompt": "Hello"}
    return {**base, "max_tokens": 1, **fields}


# ---- item 6: caps on the work of one request ----------------------------------------------------------------

CAPS = [  # (field, at the cap, just under, just over, the flag)
    ("stop", ["a", "b"], ["a"], ["a", "b", "c"], "--max-stop-strings"),
    ("stop", ["abcde"], ["abcd"], ["abcdef"], "--max-stop-string-length"),
    ("stop_token_ids", [1, 2], [1], [1, 2, 3], "--max-stop-token-ids"),
    ("allowed_token_ids", [1000, 1001, 1002], [1000, 1001], [1000, 1001, 1002, 1003], "--max-allowed-token-ids"),
    ("logit_bias", {"1": 1, "2": 1}, {"1": 1}, {"1": 1, "2": 1, "3": 1}, "--max-logit-bias"),
    ("n", 4, 3, 5, "--max-choices-per-request"),
]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT_ROUTE, GENERATE])
@pytest.mark.parametrize(("field", "at", "under", "over", "flag"), CAPS)
def test_caps_at_under_and_over(
    limited: Server, route: str, field: str, at: Any, under: Any, over: Any, flag: str
) -> None:
    for ok in (at, under):
        r = post(limited, route, body_for(route, **{field: ok}))
        assert r.status_code == 200, r.text
    assert_error(post(limited, route, body_for(route, **{field: over})), 400, flag, param=field)


@pytest.mark.parametrize("shape", ["text", "ids"])
def test_prompts_and_choices_per_completions_request(limited: Server, shape: str) -> None:
    def prompts(k: int) -> list[Any]:
        return [f"p{i}" for i in range(k)] if shape == "text" else [[1000 + i] for i in range(k)]

    for k in (2, 3):  # under, at
        r = post(limited, COMPLETIONS, {"prompt": prompts(k), "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == k, r.text
    assert_error(
        post(limited, COMPLETIONS, {"prompt": prompts(4), "max_tokens": 1}),
        400,
        "--max-prompts-per-request",
        "4",
        param="prompt",
    )
    r = post(limited, COMPLETIONS, {"prompt": prompts(2), "n": 2, "max_tokens": 1})  # 4 choices: at the cap
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    assert_error(
        post(limited, COMPLETIONS, {"prompt": prompts(3), "n": 2, "max_tokens": 1}),
        400,
        "--max-choices-per-request",
        "6 choices",
        param="n",
    )
    r = post(limited, COMPLETIONS, {"prompt": list(range(1000, 1050)), "max_tokens": 1})  # one token-id prompt
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


# ---- item 7: every integer field fits int64 ------------------------------------------------------------------

INT_FIELDS = {  # route -> its integer fields (LISTS: lists of ints)
    COMPLETIONS: [
        "max_tokens",
        "n",
        "seed",
        "top_k",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "priority",
        "truncate_prompt_tokens",
        "logprobs",
    ],
    CHAT_ROUTE: [
        "max_tokens",
        "max_completion_tokens",
        "n",
        "seed",
        "top_k",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "priority",
        "truncate_prompt_tokens",
        "top_logprobs",
    ],
    GENERATE: [
        "max_tokens",
        "n",
        "seed",
        "top_k",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "priority",
        "logprobs",
        "token_ids",
    ],
}
LISTS = {"stop_token_ids", "allowed_token_ids", "token_ids"}
# At INT64_MAX / INT64_MIN a field decodes, then its meaning decides: 200 where the value means something
# (any seed or priority; top_k past the vocabulary keeps every token; truncating to more tokens than the prompt
# has keeps it whole); every other field refuses both (past the context, n or logprobs caps, outside the
# vocabulary, below its minimum).
ACCEPTED_AT_INT64_MAX = {"seed", "priority", "top_k", "truncate_prompt_tokens"}
ACCEPTED_AT_INT64_MIN = {"seed", "priority"}


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT_ROUTE, GENERATE])
def test_int_fields_beyond_int64_are_a_400_naming_the_field(limited: Server, route: str) -> None:
    for field in INT_FIELDS[route]:
        extra = {"logprobs": True} if field == "top_logprobs" else {}
        nested = route == GENERATE and field not in ("priority", "token_ids")
        for value in BEYOND_INT64:
            sent = [1, value] if field in LISTS else value
            err = assert_error(post(limited, route, body_for(route, **extra, **{field: sent})), 400, field)
            param = f"{field}[1]" if field in LISTS else field
            assert err["param"] == (f"sampling_params.{param}" if nested else param), err
        for value, accepted in ((INT64_MAX, ACCEPTED_AT_INT64_MAX), (INT64_MIN, ACCEPTED_AT_INT64_MIN)):
            sent = [value] if field in LISTS else value
            r = post(limited, route, body_for(route, **extra, **{field: sent}))
            if field in accepted:
                assert r.status_code == 200 and len(r.json()["choices"]) == 1, (field, value, r.text)
            else:
                assert_error(r, 400)
    assert httpx.get(limited.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("value", BEYOND_INT64)
def test_ints_inside_prompts_and_logit_bias_keys(limited: Server, value: int) -> None:
    assert_error(post(limited, COMPLETIONS, {"prompt": [1000, value], "max_tokens": 1}), 400, param="prompt")
    assert_error(post(limited, COMPLETIONS, {"prompt": [[1000], [value]], "max_tokens": 1}), 400, param="prompt")
    assert_error(post(limited, COMPLETIONS, body_for(COMPLETIONS, logit_bias={str(value): 1})), 400, param="logit_bias")
    assert_error(post(limited, CHAT_ROUTE, body_for(CHAT_ROUTE, logit_bias={str(value): 1})), 400, param="logit_bias")


# ---- priority: honoured under --scheduling-policy priority, refused under fcfs (the default) ----------------


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT_ROUTE, GENERATE])
def test_priority_under_both_policies(limited: Server, server: Server, route: str) -> None:
    for value in (0, 1, -1, INT64_MAX, INT64_MIN):
        r = post(limited, route, body_for(route, priority=value))
        assert r.status_code == 200, r.text
    r = post(server, route, body_for(route, priority=0))
    assert r.status_code == 200, r.text
    for value in (1, -1, INT64_MAX):
        assert_error(
            post(server, route, body_for(route, priority=value)),
            400,
            "priority scheduling is not enabled",
            "--scheduling-policy priority",
            param="priority",
        )
