"""`--api-server-count N` against a FAKE engine that is never the bottleneck: output tok/s and API CPU per token.

    python -m bench.api_scaling [--counts 1,2,4] [--concurrency 64] [--num-requests 2048] [--output-len 128]
        [--worker-class trio|asyncio|uvloop]

For each N the real server is started (`python -m server --api-server-count N`, the demo checkpoint's
tokenizer) with SPINDLE_ENGINE_COMMAND pointing at `bench/fake_engine_process.py`: the real frame protocol
(one pipe for N = 1, one socketpair per API process above), but no model, so tokens come as fast as the API
processes take them. The client is this process, one thread of raw keep-alive sockets (bench/raw_streams.py)
streaming /v1/completions with token-id prompts. Reported per N: output tok/s, and the CPU seconds (user +
sys, /proc/PID/stat) per output token of the API processes together (not the launcher, which only waits,
nor the fake engine), of the fake engine, and of the client; how busy the machine's cores were with these
("cores busy"), with interrupts ("irq": loopback TCP's softirq, which no process is charged for) and with
any other process ("others": other people's work on a shared box; a run with others above a few % is busy).
The client and the fake engine run on the same cores as the API processes: on a small machine they take a
share that the API processes then do not get, so read the tok/s with the CPU columns.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.raw_streams import run_raw_streams
from bench.serve import cpu_seconds


@dataclass
class Row:
    n: int
    tok_s: float
    api_us: float  # API processes' CPU µs per output token
    engine_us: float
    client_us: float
    busy: float  # all three's CPU over (cores x wall time)
    irq: float  # interrupts' CPU (the loopback network's softirq) over (cores x wall time)
    others: float  # every other process's CPU over (cores x wall time): neighbours make the run "busy"
    split: list[int]  # requests served by each API process


def _request(port: int, out_len: int, i: int) -> bytes:
    body = json.dumps(
        {
            "model": "fake",
            "prompt": [100 + i % 1000, 200, 300, 400],
            "max_tokens": out_len,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (port, len(body))
    ) + body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of `pid`'s children."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for kid in map(int, kids):
            try:
                cmd = open(f"/proc/{kid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append((kid, cmd))
    return out


def _healthy(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            return b" 200 " in s.recv(100)
    except OSError:
        return False


def measure(n: int, model: str, args: argparse.Namespace) -> Row:
    port = _free_port()
    env = {
        **os.environ,
        "SPINDLE_ENGINE_COMMAND": f"{shlex.quote(sys.executable)} -m bench.fake_engine_process",
        "SPINDLE_LOG_LEVEL": "WARNING",
    }
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        model,
        "--served-model-name",
        "fake",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-server-count",
        str(n),
        "--worker-class",
        args.worker_class,
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server (N={n}) did not start")
            time.sleep(0.2)
        kids = _children(server.pid)
        engine = [pid for pid, c in kids if "fake_engine_process" in c]
        apis = [pid for pid, c in kids if "server.runtime.api_process" in c] if n > 1 else [server.pid]
        if len(engine) != 1 or len(apis) != n:
            raise SystemExit(f"N={n}: expected one fake engine and {n} API processes, found {kids}")
        _warm_up(port, n)
        served0 = _served(port)
        api0 = sum(map(cpu_seconds, apis))
        eng0 = cpu_seconds(engine[0])
        me0 = sum(os.times()[:2])
        machine0 = _machine_busy()
        ok, secs = _load(port, args.concurrency, args.num_requests, args.output_len)
        api = sum(map(cpu_seconds, apis)) - api0
        eng = cpu_seconds(engine[0]) - eng0
        me = sum(os.times()[:2]) - me0
        machine, irq = (b - a for a, b in zip(machine0, _machine_busy()))
        served = _served(port)
        split = [int(served[k] - served0.get(k, 0.0)) for k in sorted(served, key=int)]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    tokens = ok * args.output_len
    cores = os.cpu_count() or 1
    wall = cores * secs
    return Row(
        n,
        tokens / secs,
        api / tokens * 1e6,
        eng / tokens * 1e6,
        me / tokens * 1e6,
        (api + eng + me) / wall,
        irq / wall,
        max(machine - api - eng - me, 0.0) / wall,
        split or [ok],
    )


def _machine_busy() -> tuple[float, float]:
    """CPU seconds all cores have spent since boot busy in processes, and in interrupts (/proc/stat: irq and
    softirq, which is where loopback TCP delivers packets; no process's /proc/PID/stat counts it)."""
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    irq = ticks[5] + ticks[6]
    return (sum(ticks) - ticks[3] - ticks[4] - irq) / hz, irq / hz


def _served(port: int) -> dict[str, float]:
    """spindle_api_server_requests_total per API process (/metrics; empty for a single server)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nhost: x\r\n\r\n")  # 1.0: an unchunked body
        text = b"".join(iter(lambda: s.recv(1 << 16), b"")).decode()
    return {
        line.split('api_server="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("spindle_api_server_requests_total")
    }


def _warm_up(port: int, n: int) -> None:
    """Stream short requests until every API process has served some (each starts on its own)."""
    deadline = time.monotonic() + 120
    while True:
        _load(port, 4 * n, 16 * n, 16)
        if n == 1 or sum(v > 0 for v in _served(port).values()) >= n:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"N={n}: not every API process served a request: {_served(port)}")
        time.sleep(0.5)


def _load(port: int, concurrency: int, num_requests: int, out_len: int) -> tuple[int, float]:
    return run_raw_streams(port, concurrency, num_requests, lambda i: _request(port, out_len, i), lambda _: None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1,2,4", help="--api-server-count values, comma-separated")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--worker-class", default="trio", choices=["trio", "asyncio", "uvloop"])
    args = ap.parse_args()
    from demo.checkpoints import demo_checkpoint_path

    model = str(demo_checkpoint_path())
    rows = [measure(int(n), model, args) for n in args.counts.split(",")]
    print(
        f"fake engine, {args.worker_class}, {args.concurrency} streams, {args.num_requests} requests x "
        f"{args.output_len} tokens, {os.cpu_count()} cores (client and fake engine on the same cores)"
    )
    print(
        "   N   output tok/s   API CPU µs/tok   engine µs/tok   client µs/tok   cores busy   irq   others"
        "   requests per process"
    )
    for r in rows:
        print(
            f"{r.n:4d} {r.tok_s:14.0f} {r.api_us:16.1f} {r.engine_us:15.1f} {r.client_us:15.1f} {r.busy:11.0%}"
            f" {r.irq:5.0%} {r.others:8.0%}"
            f"   {'/'.join(map(str, r.split))}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
