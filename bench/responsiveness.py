"""Responsiveness under load: GET /health latency and the API process's event-loop lag, while 64 streams run and
while a ~1M-character prompt is tokenized.

    python -m bench.responsiveness [--model DIR] [--worker-class trio|asyncio|uvloop] [--streams 64]
        [--num-requests 128] [--output-len 128] [--client raw|serve] [--tokenize-chars 1000000] [--tokenize-reps 3]
        [--probe-interval-ms 10] [--child-nice N [--child-policy other|batch]] [--port 8421]
    python -m bench.responsiveness --url http://127.0.0.1:8000 --server-pid PID    (attach: no loop lag)

Without --url it starts a real server (`python -m server`, the demo checkpoint unless --model) through a thin
wrapper that adds one task to the server's event loop: a ticker that sleeps 10 ms and records how late it
wakes (the loop lag every other task on the loop sees, whether the loop was busy or its thread was waiting
for a CPU). Nothing in server/ changes for it.

Phases, each measured by a separate prober process that sends GET /health on one keep-alive connection
every --probe-interval-ms:
  idle        the server doing nothing (the floor)
  streams     --streams concurrent /v1/completions streams (token-id prompts, --output-len tokens,
              ignore_eos), --num-requests in all, from a cheap raw-socket client (--client serve: from
              bench.serve, httpx on asyncio, which itself wants about a core); reports output tok/s
  tokenize    POST /tokenize with a --tokenize-chars prompt, --tokenize-reps times, one after another
              (the probes while a request is in flight count)
Per phase: /health latency p50 / p99 / max; loop lag p50 / p99 / max, and the same less the time the loop's
thread spent runnable but waiting for a CPU (its schedstat, read by the ticker), i.e. the loop busy with
other tasks; the slowest 1% of probes and how much of them the API main thread spent waiting for a CPU (read
by the prober around each probe); and, per process, the CPUs used and the CPUs' worth of runnable-but-waiting
over the phase (/proc/<pid>/task/*/schedstat). Together they say whether a slow probe was the event loop
being busy or the OS running something else (the engine's threads, a render worker, the clients, other
tenants) on both cores. To see who ran while the API thread waited: `perf sched record -a` during a phase,
then `perf sched timehist` (bench/README.md, "Responsiveness under load").

--child-nice N [--child-policy other|batch] sets every thread of the engine and the render workers to nice N
and that scheduling policy after startup: an A/B switch against the priorities they set themselves, in one
session (going below the nice they start with needs CAP_SYS_NICE, i.e. root here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.raw_streams import run_raw_streams

_SCHED_POLICY = {0: "OTHER", 1: "FIFO", 2: "RR", 3: "BATCH", 5: "IDLE", 6: "DEADLINE"}


# ---------------------------------------------------------------------------------------------- /proc helpers


def _stat_fields(path: str) -> list[str]:
    """/proc/.../stat from field 3 (state) on: index i is field i + 3 (proc(5))."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def thread_ids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def nice_and_policy(pid: int, tid: int | None = None) -> tuple[int, str]:
    f = _stat_fields(f"/proc/{pid}/task/{tid or pid}/stat")
    return int(f[16]), _SCHED_POLICY.get(int(f[38]), f[38])


def schedstat(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for a CPU) of one thread, or of every thread when tid is None."""
    run = wait = 0
    for t in [tid] if tid is not None else thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                a, b, _ = f.read().split()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        run += int(a)
        wait += int(b)
    return run, wait


def children(pid: int) -> dict[str, list[int]]:
    """The server's engine and render-worker processes: {"engine": [pid], "worker": [pids]}."""
    out: dict[str, list[int]] = {"engine": [], "worker": []}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(_stat_fields(f"/proc/{entry}/stat")[1]) != pid:
                continue
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if b"engine" in cmd:
            out["engine"].append(int(entry))
        elif b"server.render.render_worker" in cmd:
            out["worker"].append(int(entry))
    return out


def set_priority(pid: int, nice: int, policy: str) -> None:
    """Every thread of `pid` to `nice` and SCHED_OTHER / SCHED_BATCH (Linux nice and policy are per thread)."""
    for tid in thread_ids(pid):
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ------------------------------------------------------------------------------------- the wrapped server


def _serve_with_ticker(argv: list[str]) -> int:
    """`python -m server ARGV` with a 10 ms ticker on its event loop, writing "monotonic_ns lag_us" lines."""
    import threading

    import anyio

    import server.cli
    import server.runtime.http_server

    real_serve = server.runtime.http_server.serve
    path = os.environ["BENCH_RESPONSIVENESS_LAG_FILE"]

    async def ticker() -> None:
        # this (the loop's) thread's schedstat: how much of each tick's lateness it spent runnable, not running
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        with open(path, "w", buffering=1) as out:  # line-buffered: one write per tick, read while we run
            while True:
                w0 = int(os.pread(fd, 100, 0).split()[1])
                t = time.perf_counter()
                await anyio.sleep(0.01)
                late = time.perf_counter() - t - 0.01
                w1 = int(os.pread(fd, 100, 0).split()[1])
                out.write(f"{time.monotonic_ns()} {late * 1e6:.0f} {(w1 - w0) / 1e3:.0f}\n")

    async def serve(config: Any, engine_factory: Any = None, worker: Any = None) -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            code = await real_serve(config, engine_factory, worker)
            tg.cancel_scope.cancel()
        return code

    server.runtime.http_server.serve = serve  # run_server looks it up at call time
    return server.cli.main(argv)


def read_lag(path: Path, t0: int, t1: int) -> list[tuple[float, float]]:
    """(loop lag ms, of which the loop's thread waited for a CPU ms) per tick that ended within [t0, t1]."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and t0 <= int(parts[0]) <= t1:
            out.append((int(parts[1]) / 1000, int(parts[2]) / 1000))
    return out


# ------------------------------------------------------------------------------------------------ the prober


def _probe(port: int, interval_ms: float, api_pid: int) -> int:
    """GET /health every interval until stdin closes; one line per probe on stdout:
    start_monotonic_ns latency_ns api_main_thread_wait_ns status."""
    import threading

    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    fd = os.open(f"/proc/{api_pid}/task/{api_pid}/schedstat", os.O_RDONLY) if api_pid else -1

    def wait_ns() -> int:
        return int(os.pread(fd, 100, 0).split()[1]) if fd >= 0 else 0

    req = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    sock: socket.socket | None = None
    lines = []
    nxt = time.monotonic()
    while not stop.is_set():
        nxt += interval_ms / 1000
        status = 0
        w0 = wait_ns()
        t0 = time.monotonic_ns()
        try:
            for attempt in range(2):
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    t0 = time.monotonic_ns()  # the connect is not the server's latency
                    w0 = wait_ns()
                try:
                    sock.sendall(req)
                    status = int(_read_response(sock).split(b" ", 2)[1])
                    break
                except (_Closed, ConnectionResetError, BrokenPipeError):
                    # Hypercorn closes a keep-alive connection after 1000 requests: reconnect, once
                    sock.close()
                    sock = None
                    if attempt:
                        raise
        except OSError as e:
            print(f"probe: {type(e).__name__}: {e}", file=sys.stderr)
            if sock is not None:
                sock.close()
            sock = None
        lines.append(f"{t0} {time.monotonic_ns() - t0} {wait_ns() - w0} {status}")
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            nxt = time.monotonic()
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


class Prober:
    def __init__(self, port: int, interval_ms: float, api_pid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.responsiveness", "--probe", str(port), str(interval_ms), str(api_pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> list[tuple[int, float, float, int]]:
        """(start ns, latency ms, API main-thread runqueue wait ms, status) per probe."""
        out, _ = self.proc.communicate("", timeout=60)
        rows = []
        for line in out.splitlines():
            t0, lat, wait, status = (int(x) for x in line.split())
            rows.append((t0, lat / 1e6, wait / 1e6, status))
        return rows


# -------------------------------------------------------------------------------------------------- the load


def _stream_request(port: int, model: str, prompt: list[int], out_len: int) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": out_len,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (port, len(body))
    ) + body


def run_streams(
    port: int, model: str, concurrency: int, num_requests: int, input_len: int, out_len: int
) -> tuple[int, int, float]:
    """`concurrency` keep-alive connections streaming until `num_requests` finished: (ok, output tokens, s)."""
    rng = random.Random(0)
    tokens = 0

    def done(buf: bytes) -> None:
        nonlocal tokens
        m = re.search(rb'"completion_tokens": ?(\d+)', buf)
        tokens += int(m.group(1)) if m else 0

    ok, seconds = run_raw_streams(
        port,
        concurrency,
        num_requests,
        lambda i: _stream_request(port, model, [rng.randrange(1000, 50000) for _ in range(input_len)], out_len),
        done,
    )
    return ok, tokens, seconds


class _Closed(ConnectionError):
    pass


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a content-length (the server keeps the connection open)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise (_Closed if not raw else ConnectionError)("the server closed the connection")
        raw += chunk
    head, body = raw.split(b"\r\n\r\n", 1)
    m = re.search(rb"content-length: *(\d+)", head, re.I)
    need = int(m.group(1)) if m else 0
    parts = [body]
    got = len(body)
    while got < need:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return head + b"\r\n\r\n" + b"".join(parts)


def run_serve_client(port: int, args: argparse.Namespace) -> tuple[int, int, float]:
    """The same load from bench.serve (httpx, asyncio: a heavier client that also wants a core)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.serve",
            "--url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            str(args.num_requests),
            "--concurrency",
            str(args.streams),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def field(name: str) -> float:
        m = re.search(rf"{re.escape(name)}: *([\d.]+)", out)
        return float(m.group(1)) if m else float("nan")

    ok = int(field("Successful requests"))
    return ok, ok * args.output_len, field("Benchmark duration (s)")  # ignore_eos: every request its max_tokens


def tokenize_once(port: int, text: str) -> tuple[int, int, int]:
    """POST /tokenize {"prompt": text}: (start ns, end ns, token count)."""
    body = json.dumps({"prompt": text}).encode()
    head = (
        b"POST /tokenize HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    t0 = time.monotonic_ns()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head + body)
        raw = _read_response(sock)
    t1 = time.monotonic_ns()
    if b" 200 " not in raw[:16]:
        raise SystemExit(f"/tokenize failed: {raw[:300]!r}")
    m = re.search(rb'"count": ?(\d+)', raw)
    return t0, t1, int(m.group(1)) if m else -1


def long_text(n_chars: int) -> str:
    rng = random.Random(0)
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "über", "数据", "lazy", "dog", "1234", "\n"]
    parts: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(words)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_chars]


# ------------------------------------------------------------------------------------------------ reporting


class Phase:
    """Samples the server's threads' schedstat over a phase."""

    def __init__(self, api_pid: int, kids: dict[str, list[int]]) -> None:
        self.api_pid, self.kids = api_pid, kids
        self.t0 = time.monotonic_ns()
        self.s0 = self._sample()

    def _sample(self) -> dict[str, tuple[int, int]]:
        out = {"api main": schedstat(self.api_pid, self.api_pid) if self.api_pid else (0, 0)}
        for name, pids in self.kids.items():
            run = wait = 0
            for p in pids:
                r, w = schedstat(p)
                run, wait = run + r, wait + w
            out[name] = (run, wait)
        return out

    def end(self) -> dict[str, tuple[float, float]]:
        """name -> (CPUs used, CPUs' worth of runnable-but-waiting), averaged over the phase."""
        self.t1 = time.monotonic_ns()
        s1 = self._sample()
        dt = self.t1 - self.t0
        return {k: ((s1[k][0] - self.s0[k][0]) / dt, (s1[k][1] - self.s0[k][1]) / dt) for k in s1}


def report(
    name: str,
    probes: list[tuple[int, float, float, int]],
    lag: list[tuple[float, float]] | None,
    cpu: dict[str, tuple[float, float]],
    extra: str = "",
) -> None:
    lat = [p[1] for p in probes if p[3] == 200]
    bad = sum(1 for p in probes if p[3] != 200)
    line = (
        f"{name:10s} probes {len(lat):5d}{f' ({bad} failed)' if bad else ''}  /health ms p50 {pct(lat, 50):6.2f} "
        f"p99 {pct(lat, 99):6.2f} max {max(lat, default=float('nan')):6.2f}"
    )
    if lag is not None:
        late = [x for x, _ in lag]
        line += f"  | loop lag ms p50 {pct(late, 50):5.2f} p99 {pct(late, 99):6.2f} max {max(late, default=0):6.2f}"
    print(line)
    if lag:
        busy = [max(x - w, 0.0) for x, w in lag]  # lateness not explained by waiting for a CPU: the loop was busy
        print(
            f"{'':10s} loop lag less the loop thread's CPU wait (the loop busy) ms: p50 {pct(busy, 50):5.2f} "
            f"p99 {pct(busy, 99):6.2f} max {max(busy):6.2f}"
        )
    if lat:
        cut = pct(lat, 99)
        slow = [p for p in probes if p[3] == 200 and p[1] >= cut]
        share = sum(p[2] for p in slow) / max(sum(p[1] for p in slow), 1e-9)
        print(
            f"{'':10s} slowest 1% of probes: {len(slow)}, mean {sum(p[1] for p in slow) / len(slow):6.2f} ms, "
            f"{share * 100:4.0f}% of it the API main thread waiting for a CPU"
        )
    cpus = "  ".join(f"{k} {run:4.2f} run / {wait:4.2f} wait" for k, (run, wait) in cpu.items())
    print(f"{'':10s} CPUs: {cpus}{extra}")


# ------------------------------------------------------------------------------------------------------ main


def _wait_healthy(port: int, proc: subprocess.Popen[bytes] | None, log: Path | None) -> None:
    for _ in range(3000):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.1)
    raise SystemExit("the server did not become healthy")


def _get_json(port: int, path: str) -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
        raw = _read_response(s)
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _describe(api_pid: int, kids: dict[str, list[int]]) -> Iterator[str]:
    for name, pids in (("api", [api_pid] if api_pid else []), *kids.items()):
        for p in pids:
            prio = sorted({nice_and_policy(p, t) for t in thread_ids(p)})
            yield f"{name} {p}: {len(thread_ids(p))} threads, nice/policy {', '.join(f'{n}/{s}' for n, s in prio)}"


def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="spindle-resp-"))
    proc = None
    lag_file: Path | None = None
    if args.url:
        port = int(args.url.rsplit(":", 1)[1].strip("/"))
        api_pid = args.server_pid
    else:
        port = args.port
        lag_file = tmp / "lag.txt"
        log = tmp / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "bench.responsiveness",
            "--serve",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--worker-class",
            args.worker_class,
            "--log-level",
            "warning",
            *(["--model", args.model] if args.model else []),
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "BENCH_RESPONSIVENESS_LAG_FILE": str(lag_file)},
        )
        api_pid = proc.pid
        _wait_healthy(port, proc, log)
    try:
        kids = children(api_pid) if api_pid else {"engine": [], "worker": []}
        if args.child_nice is not None:
            for p in kids["engine"] + kids["worker"]:
                set_priority(p, args.child_nice, args.child_policy)
        model = _get_json(port, "/v1/models")["data"][0]["id"]
        print(
            f"model {model}  worker-class {args.worker_class if not args.url else '?'}  "
            f"probe every {args.probe_interval_ms} ms  load avg {open('/proc/loadavg').read().split()[0]}"
        )
        for line in _describe(api_pid, kids):
            print("  " + line)
        run_streams(port, model, 4, 8, args.input_len, 8)  # warm-up
        text = long_text(args.tokenize_chars)
        tokenize_once(port, text[:100_000])  # warm the worker

        def lag(t0: int, t1: int) -> list[tuple[float, float]] | None:
            return read_lag(lag_file, t0, t1) if lag_file is not None else None

        # idle
        ph = Phase(api_pid, kids)
        pr = Prober(port, args.probe_interval_ms, api_pid)
        time.sleep(args.idle_s)
        probes = pr.stop()
        report("idle", probes, lag(ph.t0, time.monotonic_ns()), ph.end())

        # streams
        ph = Phase(api_pid, kids)
        pr = Prober(port, args.probe_interval_ms, api_pid)
        time.sleep(0.2)
        t0 = time.monotonic_ns()
        if args.client == "raw":
            ok, tokens, secs = run_streams(
                port, model, args.streams, args.num_requests, args.input_len, args.output_len
            )
        else:
            ok, tokens, secs = run_serve_client(port, args)
        t1 = time.monotonic_ns()
        probes = [p for p in pr.stop() if t0 <= p[0] <= t1]
        cpu = ph.end()
        report(
            "streams",
            probes,
            lag(t0, t1),
            cpu,
            f"\n{'':10s} {args.streams} streams: {ok} requests, {tokens} output tokens in {secs:.2f} s: "
            f"output tok/s {tokens / secs:.1f}",
        )

        # tokenize
        windows = []
        ph = Phase(api_pid, kids)
        pr = Prober(port, args.probe_interval_ms, api_pid)
        time.sleep(0.2)
        count = 0
        for _ in range(args.tokenize_reps):
            a, b, count = tokenize_once(port, text)
            windows.append((a, b))
            time.sleep(0.1)
        probes = [p for p in pr.stop() if any(a <= p[0] <= b for a, b in windows)]
        lags = None
        if lag_file is not None:
            lags = [x for a, b in windows for x in read_lag(lag_file, a, b)]
        secs = sum(b - a for a, b in windows) / len(windows) / 1e9
        report(
            "tokenize",
            probes,
            lags,
            ph.end(),
            f"\n{'':10s} {len(text)} chars -> {count} tokens, {secs * 1e3:.0f} ms per /tokenize "
            f"({args.tokenize_reps} in a row)",
        )
    finally:
        if proc is not None:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return _serve_with_ticker(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        return _probe(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="attach to this server instead of starting one")
    ap.add_argument("--server-pid", type=int, default=0, help="with --url: the API process (schedstat, children)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--worker-class", default="trio", choices=["trio", "asyncio", "uvloop"])
    ap.add_argument("--port", type=int, default=8421)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument(
        "--client",
        default="raw",
        choices=["raw", "serve"],
        help="the streams' client: raw sockets in this process (cheap), or bench.serve (httpx)",
    )
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokenize-chars", type=int, default=1_000_000)
    ap.add_argument("--tokenize-reps", type=int, default=3)
    ap.add_argument("--probe-interval-ms", type=float, default=10.0)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument(
        "--child-nice",
        type=int,
        default=None,
        help="set the engine's and workers' threads to this nice after startup (an A/B switch)",
    )
    ap.add_argument(
        "--child-policy",
        default="other",
        choices=["other", "batch"],
        help="with --child-nice: SCHED_OTHER or SCHED_BATCH",
    )
    run(ap.parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
