"""OpenAI's Batch API (/v1/files, /v1/batches) through the official openai SDK against the real server and engine:
a batch's answers equal the same requests answered online (greedy), bad lines go to the error file, cancel,
list pagination and the upload limit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server
from tests.helpers.processes import wait_until

MAX_FILE = 32 << 10


@pytest.fixture(scope="module")
def srv(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("batch")
    s = start_server(
        qwen2_ckpt,
        tmp,
        "--batch-dir",
        str(tmp / "batches"),
        "--batch-max-file-bytes",
        str(MAX_FILE),
        "--batch-max-in-flight",
        "2",
        "--scheduling-policy",
        "priority",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat_body(i: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"count to {i}"}],
        "max_tokens": 6,
        "temperature": 0,
    }


def completion_body(i: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": f"Once upon a time {i}", "max_tokens": 6, "temperature": 0}


def run_batch(client: openai.OpenAI, text: str, endpoint: Any) -> Any:
    upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating" and batch.input_file_id == upload.id

    def done() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch.id)
        return batch.status in ("completed", "failed", "cancelled")

    wait_until(done, 180, lambda: f"batch {batch.id} finished (now {batch.status}, {batch.request_counts})")
    return batch


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]


def test_chat_batch_equals_online_and_bad_lines_go_to_the_error_file(client: openai.OpenAI) -> None:
    url = "/v1/chat/completions"
    good = [line(f"c{i}", url, chat_body(i)) for i in range(8)]
    bad = [
        "{not json",
        json.dumps({"method": "POST", "url": url, "body": chat_body(1)}),  # no custom_id
        line("c0", url, chat_body(0)),  # a repeated custom_id
        line("other", "/v1/embeddings", {"model": "tiny", "input": "x"}),  # not the batch's endpoint
        line("nomodel", url, {**chat_body(1), "model": "absent"}),  # the route's own 404
    ]
    batch = run_batch(client, "\n".join(good[:4] + bad + good[4:]) + "\n", url)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 8, 5)
    assert batch.errors is not None and sorted(e.line for e in batch.errors.data) == [5, 6, 7, 8]
    outputs = {item["custom_id"]: item for item in jsonl(client, batch.output_file_id)}
    assert sorted(outputs) == sorted(f"c{i}" for i in range(8))
    for i in range(8):
        item = outputs[f"c{i}"]
        assert item["error"] is None and item["response"]["status_code"] == 200
        online = client.chat.completions.with_raw_response.create(**chat_body(i)).http_response.json()
        answer = item["response"]["body"]
        assert answer["choices"] == online["choices"]
        assert answer["usage"]["completion_tokens"] == online["usage"]["completion_tokens"]
    errors = jsonl(client, batch.error_file_id)
    assert len(errors) == 5
    routed = [e for e in errors if e["custom_id"] == "nomodel"]
    assert routed[0]["response"]["status_code"] == 404 and "absent" in json.dumps(routed[0]["response"]["body"])
    codes = sorted(e["error"]["code"] for e in errors if e["error"] is not None)
    assert codes == ["duplicate_custom_id", "invalid_json_line", "invalid_url", "missing_required_parameter"]


def test_completions_batch_equals_online(client: openai.OpenAI) -> None:
    url = "/v1/completions"
    batch = run_batch(client, "\n".join(line(f"p{i}", url, completion_body(i)) for i in range(6)), url)
    assert batch.status == "completed" and batch.request_counts.completed == 6 and batch.error_file_id is None
    for item in jsonl(client, batch.output_file_id):
        online = client.completions.with_raw_response.create(**completion_body(int(item["custom_id"][1:])))
        online = online.http_response.json()
        assert item["response"]["body"]["choices"] == online["choices"]


def test_cancel_keeps_what_was_answered(client: openai.OpenAI) -> None:
    url = "/v1/completions"
    long = [line(f"l{i}", url, {**completion_body(i), "max_tokens": 64, "ignore_eos": True}) for i in range(20)]
    upload = client.files.create(file=("long.jsonl", "\n".join(long).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled", 60, "the batch cancelled")
    final = client.batches.retrieve(batch.id)
    assert final.cancelled_at is not None and final.request_counts.completed < 20
    if final.output_file_id is not None:
        assert len(jsonl(client, final.output_file_id)) == final.request_counts.completed
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        done = run_batch(client, line("x", url, completion_body(1)), url)
        client.batches.cancel(done.id)


def test_list_pagination(client: openai.OpenAI) -> None:
    upload = client.files.create(
        file=("one.jsonl", line("a", "/v1/completions", completion_body(0)).encode()), purpose="batch"
    )
    ids = [
        client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_next_page()
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK's auto-pagination follows `after`
    assert len(listed) == len(set(listed)) and set(ids) <= set(listed)
    assert [b.id for b in first.data] == listed[:2] and listed[:3] == ids[::-1]
    files = [f.id for f in client.files.list(purpose="batch")]
    assert upload.id in files


def test_files_retrieve_delete_and_refusals(client: openai.OpenAI, srv: Server) -> None:
    upload = client.files.create(file=("f.jsonl", b'{"a": 1}\n'), purpose="batch")
    got = client.files.retrieve(upload.id)
    assert (got.bytes, got.filename, got.purpose) == (9, "f.jsonl", "batch")
    assert client.files.content(upload.id).content == b'{"a": 1}\n'
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    with pytest.raises(openai.APIStatusError) as large:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
    assert large.value.status_code == 413 and "--batch-max-file-bytes" in large.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("f.jsonl", b"{}"), purpose="assistants")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id="file-x", endpoint="/v1/responses", completion_window="24h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="input_file_id|file-x"):
        client.batches.create(input_file_id="file-x", endpoint="/v1/completions", completion_window="24h")
    r = httpx.get(f"{srv.url}/v1/batches/batch_absent", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "No such Batch object: batch_absent"


def test_an_unusable_file_fails_the_batch(client: openai.OpenAI) -> None:
    upload = client.files.create(file=("empty.jsonl", b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "failed", 60, "the batch failed")
    failed = client.batches.retrieve(batch.id)
    assert failed.errors is not None and failed.errors.data[0].code == "empty_file" and failed.failed_at is not None
