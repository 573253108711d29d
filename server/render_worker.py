"""The render/tokenize worker process: `python -m server.render_worker`, driven by server/worker_pool.py.

Frames on stdin/stdout: 4-byte big-endian length + msgpack. The first frame in is the config; the worker
answers [0, pid] once its tokenizer is loaded and its memory cap set. Then one request at a time:
["render", {...}] | ["encode", text, add_special_tokens] | ["decode", ids, skip_special_tokens]
-> [0, result] | [1, message the client may see] | [2, internal error].
It runs untrusted templates, so it holds nothing worth stealing, dies with its parent, caps its memory
while rendering, and the parent kills it (SIGKILL) when a render overruns.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys
from typing import Any

import msgspec
import tokenizers

from server import template_sandbox

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
    # Linux: SIGKILL us when the parent dies, even mid-render (stdin EOF only helps when idle).
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


class _MemoryCap:
    """RLIMIT_AS for templates only: current size + budget while rendering, so a giant string fails fast.

    Tokenization runs uncapped (the soft limit is raised back): HF tokenizers need ~100x the text's size
    and abort the process, not raise, when an allocation fails; their input is bounded by the request size.
    """

    def __init__(self, budget: int) -> None:
        self._budget = budget if sys.platform.startswith("linux") else 0
        self._capped = False
        self._hard = resource.getrlimit(resource.RLIMIT_AS)[1]

    def render(self) -> None:
        if self._budget <= 0 or self._capped:
            return
        with open("/proc/self/status") as f:
            vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = vm_kb * 1024 + self._budget
        if self._hard != resource.RLIM_INFINITY:
            limit = min(limit, self._hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, self._hard))
        self._capped = True

    def tokenize(self) -> None:
        if self._capped:
            resource.setrlimit(resource.RLIMIT_AS, (self._hard, self._hard))
            self._capped = False


def _handle(
    request: list[Any], tok: tokenizers.Tokenizer, cap: _MemoryCap, default_template: str | None, max_output_chars: int
) -> Any:
    op = request[0]
    if op != "render":
        cap.tokenize()
    try:
        if op == "encode":
            return tok.encode(request[1], add_special_tokens=request[2]).ids
        if op == "decode":
            return tok.decode(request[1], skip_special_tokens=request[2])
    except (TypeError, ValueError, OverflowError) as e:  # bad input, not a broken worker
        raise template_sandbox.TemplateRenderError(f"cannot {op}: {e}") from None
    if op == "render":
        cap.render()
        args = request[1]
        source = args["source"] if args["source"] is not None else default_template
        if source is None:
            raise template_sandbox.TemplateRenderError("no chat template")
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
