"""SPINDLE_ENGINE_COMMAND and bench/fake_engine_process.py: the fake engine core speaks the real protocol, on the
single server's pipes and on `--api-server-count`'s channels (bench/api_scaling.py relies on both)."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server
from tests.helpers.processes import children, wait_until

FAKE = f"{shlex.quote(sys.executable)} -m bench.fake_engine_process"


@pytest.mark.parametrize("count", [1, 2])
def test_the_fake_engine_streams_a_request(count: int, qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", str(count), env={"SPINDLE_ENGINE_COMMAND": FAKE})
    try:
        fakes = subprocess.run(
            ["pgrep", "-P", str(srv.proc.pid), "-f", "bench.fake_engine_process"], capture_output=True, text=True
        ).stdout.split()
        assert len(fakes) == 1  # the fake, not the real engine
        body = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        choices = [e["choices"][0] for e in events if e.get("choices")]
        assert "".join(c["text"] for c in choices)
        assert choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 8
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_stop_while_the_api_processes_start_is_a_clean_stop(sigint: str, qwen2_ckpt: Path, tmp_path: Path) -> None:
    """SIGINT to the launcher while its API processes still import (long before the first /health 200): each
    stops once it can, and the launcher exits 0, as it does for a stop once they serve. (A process killed by
    the signal during its start-up made the launcher exit 1: test_the_fake_engine_streams_a_request[2]'s race,
    where /health answered 200 from one process while the other still started.) "ignored": the launcher
    inherits SIGINT ignored, as from a script's `cmd &` (CI's own runs); its API processes must not, or the
    SIGINT they hold pending is discarded when trio re-sets the disposition, and they never stop."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    try:  # the disposition the launcher inherits (a handler becomes the default action across exec)
        srv = start_server(
            qwen2_ckpt, tmp_path, "--api-server-count", "2", wait=False, env={"SPINDLE_ENGINE_COMMAND": FAKE}
        )
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        wait_until(
            lambda: len(children(srv.proc.pid, "[-]m server.runtime.api_process")) == 2,
            60,
            "the launcher started its 2 API processes",
        )
        srv.proc.send_signal(signal.SIGINT)  # within milliseconds of their exec: Python has barely started
        try:
            code = srv.proc.wait(60)
        except subprocess.TimeoutExpired:  # say where it stands: the log has each process's last step
            pytest.fail(f"the launcher still runs 60 s after SIGINT:\n{srv.log.read_text()[-3000:]}")
        assert code == 0, srv.log.read_text()[-3000:]
    finally:
        srv.stop()
