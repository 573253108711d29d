"""The render/tokenize worker process: `python -m server.render.worker`, driven by server/render/worker_pool.py.

Frames on stdin/stdout: 4-byte big-endian length + msgpack. The first frame in is the config; the worker
answers [0, pid] once its tokenizer is loaded and its memory cap set. Then one request at a time:
["render", {...}] | ["encode", text, add_special_tokens] | ["decode", ids, skip_special_tokens]
-> [0, result] | [1, message the client may see] | [2, internal error].
It runs untrusted templates, so it holds nothing worth stealing, exits with its parent, caps its memory
while rendering, and the parent kills it (SIGKILL) when a render overruns.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import struct
import threading
from typing import Any

import msgspec
import tokenizers

from server.render import template_sandbox

OK, USER_ERROR, INTERNAL_ERROR = 0, 1, 2
_HEADER = struct.Struct(">I")


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _die_with_parent() -> None:
    # Exit when our stdin's writer (the parent) goes away, even mid-render. Not PR_SET_PDEATHSIG: Trio
    # spawns from a worker thread, and that signal fires when the spawning *thread* exits.
    def watch() -> None:
        poller = select.poll()
        poller.register(0, 0)  # no events asked: poll() still reports POLLHUP/POLLERR
        while True:
            for _fd, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _MemoryCap:
    """RLIMIT_AS while a template renders: current size + budget, so a giant string fails fast.

    Only around rendering: HF tokenizers need ~100x a text's size and abort the process (not raise) when an
    allocation fails, and reading the next request must not fail either. Their inputs are bounded by the
    request size instead.
    """

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        linux = os.path.exists("/proc/self/statm")
        self._statm = os.open("/proc/self/statm", os.O_RDONLY) if budget > 0 and linux else -1
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> None:
        if self._statm < 0:
            return
        size = int(os.pread(self._statm, 64, 0).split()[0]) * self._page  # VmSize: the address space in use
        limit = size + self._budget
        if self._hard != resource.RLIM_INFINITY:
            limit = min(limit, self._hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, self._hard))

    def __exit__(self, *exc: object) -> None:
        if self._statm >= 0:
            resource.setrlimit(resource.RLIMIT_AS, (self._hard, self._hard))


def _handle(
    request: list[Any], tok: tokenizers.Tokenizer, cap: _MemoryCap, default_template: str | None, max_output_chars: int
) -> Any:
    op = request[0]
    try:
        if op == "encode":
            return tok.encode(request[1], add_special_tokens=request[2]).ids
        if op == "decode":
            return tok.decode(request[1], skip_special_tokens=request[2])
    except (TypeError, ValueError, OverflowError) as e:  # bad input, not a broken worker
        raise template_sandbox.TemplateRenderError(f"cannot {op}: {e}") from None
    if op == "render":
        args = request[1]
        source = args["source"] if args["source"] is not None else default_template
        if source is None:
            raise template_sandbox.TemplateRenderError("no chat template")
        with cap:
            return template_sandbox.render(
                source,
                args["messages"],
                add_generation_prompt=args["add_generation_prompt"],
                continue_final_message=args["continue_final_message"],
                tools=args["tools"],
                documents=args["documents"],
                kwargs=args["kwargs"],
                max_output_chars=max_output_chars,
            )
    raise ValueError(f"unknown worker op {op!r}")


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent shuts us down
    _die_with_parent()
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the frame stream
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def receive() -> Any:
        header = _read_exactly(0, 4)
        if header is None:
            return None
        body = _read_exactly(0, _HEADER.unpack(header)[0])
        return None if body is None else decoder.decode(body)

    def send(obj: Any) -> None:
        try:
            body = encoder.encode(obj)
        except (MemoryError, UnicodeEncodeError, TypeError, OverflowError) as e:  # e.g. a lone surrogate
            body = encoder.encode([USER_ERROR, f"the result cannot be sent back: {type(e).__name__}"])
        _write_all(out_fd, _HEADER.pack(len(body)) + body)

    config = receive()
    if config is None:
        return
    tok = tokenizers.Tokenizer.from_file(config["tokenizer_file"])
    default_template = config["default_template"]
    if default_template is not None:
        try:
            template_sandbox.compile_template(default_template)  # fail startup on a broken template
        except template_sandbox.TemplateRenderError as e:
            send([USER_ERROR, str(e)])
            return
    cap = _MemoryCap(config["memory_limit"])
    send([OK, os.getpid()])
    while (request := receive()) is not None:
        try:
            reply = [OK, _handle(request, tok, cap, default_template, config["max_output_chars"])]
        except template_sandbox.TemplateRenderError as e:
            reply = [USER_ERROR, str(e)]
        except MemoryError:
            reply = [USER_ERROR, "the request ran out of the renderer's memory limit"]
        except Exception as e:  # noqa: BLE001 - report and stay alive for the next request
            reply = [INTERNAL_ERROR, f"{type(e).__name__}: {template_sandbox.safe_message(e)}"]
        send(reply)


if __name__ == "__main__":
    main()
