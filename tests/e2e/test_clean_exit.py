"""A clean log from start to exit on a CPU-only machine: Triton never loaded (nanobind, which Triton's
bindings use, reports their "leaks" at exit), and a start that failed is not followed by "Running on"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import Server, free_port, start_server, wait_healthy

REPO = Path(__file__).resolve().parents[2]

# The modules a CPU engine runs: the model runner and its ops, the sampler, structured outputs with
# llguidance (the warm-up builds it), a bitmask filled and applied. None may load Triton or torch._dynamo.
_CPU_PATH = """
import sys
import torch
from engine.core import engine_core
from engine.execution import model_runner
from engine.layers import ops
from engine.messages import StructuredOutputs
from engine.structured.backend import allocate_bitmask
from engine.structured.bitmask import apply_token_bitmask
from engine.structured.llguidance_backend import LLGuidanceBackend
vocab = int(sys.argv[2])
backend = LLGuidanceBackend.from_checkpoint(sys.argv[1], vocab, [0])
grammars = [backend.compile(StructuredOutputs("regex", "[0-9]+")) for _ in range(4)]  # 4 rows: the parallel fill
words = allocate_bitmask(len(grammars), vocab)
backend.fill_bitmasks([(g, i) for i, g in enumerate(grammars)], words)
grammars[0].fill_bitmask(words, 0)
logits = torch.zeros(len(grammars), vocab)
apply_token_bitmask(logits, words, list(range(len(grammars))))
assert torch.isinf(logits).any() and not torch.isinf(logits).all()
print(sorted(m for m in ("triton", "torch._dynamo") if m in sys.modules))
"""


def test_cpu_path_imports_no_triton(qwen2_ckpt: Path) -> None:
    vocab = json.loads((qwen2_ckpt / "config.json").read_text())["vocab_size"]
    out = subprocess.run(
        [sys.executable, "-c", _CPU_PATH, str(qwen2_ckpt), str(vocab)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_stop_on_cpu_leaves_no_nanobind_leak_report(qwen2_ckpt: Path, tmp_path: Path) -> None:
    server = start_server(
        qwen2_ckpt, tmp_path, env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1", "SPINDLE_LOG_LEVEL": "INFO"}
    )
    assert server.stop() == 0
    log = server.log.read_text(errors="replace")
    assert "grammar backend ready" in log  # the warm-up ran: llguidance was loaded
    assert "nanobind: leaked" not in log, log


def test_a_first_start_stopped_by_sigterm_leaves_no_nanobind_leak_report(tmp_path: Path) -> None:
    """An empty cache: the server builds the demo checkpoint (transformers' model classes import triton) before
    serving; SIGTERM then stops it with nothing from nanobind on stderr. The CPU kernels are off: their build (a
    minute or two on a busy machine) loads no nanobind extension."""
    cache = tmp_path / "cache"
    cache.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", "demo", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "SPINDLE_CACHE_DIR": str(cache), "SPINDLE_CPU_KERNELS": "0", "SPINDLE_LOG_LEVEL": "INFO"}
    log = tmp_path / "server.log"
    with log.open("wb") as out, (tmp_path / "stderr").open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=tmp_path)
    server = Server(proc, port, log)
    try:
        wait_healthy(server, timeout=600)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        server.stop()
    stderr = (tmp_path / "stderr").read_text(errors="replace")
    assert (cache / "demo-qwen2.5-v2" / "config.json").is_file(), stderr[-3000:]  # this start built the demo
    assert "SIGTERM" in stderr, stderr[-3000:]
    assert "nanobind" not in stderr, stderr[-3000:]


def test_failed_start_prints_no_running_on(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(tmp_path),  # a folder with no checkpoint in it: the load fails once the listener is up
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--log-level",
        "info",
    ]
    with log.open("wb") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=120).returncode
    text = log.read_text(errors="replace")
    assert code != 0
    failed = text.find("startup failed")
    assert failed >= 0, text
    # the listener comes up while the load runs, but "Running on" is said only once the model serves
    assert "Running on" not in text, text
