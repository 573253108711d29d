"""A batch survives a restart: SIGTERM while lines are pending, a new server on the same --batch-dir resumes the
batch, runs only the lines not answered yet and completes it with every line answered once."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import openai

from tests.e2e.conftest import start_server
from tests.helpers.processes import wait_until

LINES = 16


def test_a_restart_resumes_the_batch(qwen2_ckpt: Path, tmp_path: Path) -> None:
    args = ("--batch-dir", str(tmp_path / "batches"), "--batch-max-in-flight", "1")
    first = start_server(qwen2_ckpt, tmp_path, *args)
    try:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0, timeout=120)
        body = {"model": "tiny", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        text = "\n".join(
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"n{i}"}}
            )
            for i in range(LINES)
        )
        upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120, "two lines answered")
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
    finally:
        first.stop()
    stopped = json.loads((tmp_path / "batches" / "batches" / f"{batch.id}.json").read_text())
    # the results file is the truth (the count in the batch object may lag it by the line answered at the stop)
    answered_before = len((tmp_path / "batches" / "batches" / f"{batch.id}.out.jsonl").read_bytes().splitlines())
    assert stopped["status"] == "in_progress" and 2 <= answered_before < LINES

    second = start_server(qwen2_ckpt, tmp_path, *args)
    try:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0, timeout=120)
        wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 180, "the batch completed")
        done = client.batches.retrieve(batch.id)
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        assert done.output_file_id is not None
        ids = [json.loads(raw)["custom_id"] for raw in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(ids) == sorted(f"r{i}" for i in range(LINES))  # each once
        # the second server ran only what the first left: one engine request per line not answered before
        assert second.metric("spindle_request_success_total") == LINES - answered_before
    finally:
        second.stop()
