"""A schema's shortest answer against max_tokens on the real server (the random-weight model, default flags).

GitHub's webhook objects of the real-world run (bench/schemas/github-webhooks): `repository-lite`'s finish fits 384
tokens, so answers end `stop` and validate (engine/structured/finish_search.py writes the finish as the tokenizer
does); `workflow-run` needs more than 384 whatever the model writes, proved from its required members' names
(engine/structured/answer_floor.py), and is a 400 naming the tokens needed rather than JSON cut at max_tokens:
refused just under that bound, accepted at it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import Server, start_server

CORPUS = Path(__file__).resolve().parents[2] / "bench" / "schemas" / "github-webhooks"
MSGS = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def srv(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_ckpt, tmp_path_factory.mktemp("budget"), env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1"})
    yield s
    s.stop()


def schema(name: str) -> Any:
    return json.loads((CORPUS / f"{name}.json").read_text())


def ask(srv: Server, name: str, **fields: Any) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": MSGS,
        "temperature": 1.0,
        "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema(name)}},
        **fields,
    }
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)


def test_a_schema_no_answer_of_which_fits_is_refused_naming_the_tokens(srv: Server) -> None:
    r = ask(srv, "workflow-run", max_tokens=384)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "BadRequestError"
    found = re.search(r"takes at least (\d+) tokens", error["message"])
    assert found, error["message"]
    need = int(found.group(1))
    assert need > 384 and "response_format.json_schema.schema" in error["message"]
    under = ask(srv, "workflow-run", max_completion_tokens=need - 1)  # just under: refused, naming that field
    assert under.status_code == 400 and under.json()["error"]["param"] == "max_completion_tokens"
    at = ask(srv, "workflow-run", max_tokens=need, stream=True)  # at the bound: runs (its finish needs more)
    assert at.status_code == 200 and "data: [DONE]" in at.text


def test_a_schema_whose_finish_fits_ends_valid(srv: Server) -> None:
    for stream in (False, True):
        r = ask(srv, "repository-lite", max_tokens=384, n=2, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            choices = [
                c for line in r.text.splitlines() if line.startswith("data: {") for c in json.loads(line[6:])["choices"]
            ]
            texts = ["".join(c["delta"].get("content") or "" for c in choices if c["index"] == i) for i in (0, 1)]
            reasons = [c["finish_reason"] for c in choices if c["finish_reason"]]
        else:
            texts = [c["message"]["content"] for c in r.json()["choices"]]
            reasons = [c["finish_reason"] for c in r.json()["choices"]]
        assert reasons == ["stop", "stop"], texts
        check = jsonschema.Draft7Validator(
            schema("repository-lite"), format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
        )
        for text in texts:
            check.validate(json.loads(text))  # formats too, as bench/schema_coverage.py judges
