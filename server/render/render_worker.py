"""The render/tokenize worker process: `python -m server.render.render_worker`, driven by server/render/worker_pool.py.

Frames on stdin/stdout, as engine/transport/ipc.py defines them (4-byte big-endian length + msgpack). The first frame in
is the config; the worker answers [0, pid] once its tokenizer is loaded and its memory cap set. Then one request
at a time:
["render", {...}] | ["encode", text, add_special_tokens] | ["encode_pair", text, pair, add_special_tokens]
| ["decode", ids, skip_special_tokens]
-> [0, result] | [1, message the client may see] | [2, internal error].
It runs untrusted templates, so it holds nothing worth stealing (the pool starts it with a scrubbed environment),
exits with its parent, caps its memory while rendering or (de)tokenizing, and the parent kills it (SIGKILL)
when a request overruns its time limit.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import tokenizers

from server.render import template_sandbox
from server.render.child import INTERNAL_ERROR, OK, USER_ERROR, start_child


class _MemoryCap:
    """RLIMIT_AS while a template renders or a text is (de)tokenized: current size + budget, so a giant
    string fails fast.

    HF tokenizers need many times a text's size and abort the process (not raise) when an allocation fails:
    the pool then replaces the worker and the request gets an error. Never while reading the next request,
    which must not fail.
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
            with cap:
                return tok.encode(request[1], add_special_tokens=request[2]).ids
        if op == "encode_pair":
            with cap:
                return tok.encode(request[1], request[2], add_special_tokens=request[3]).ids
        if op == "decode":
            with cap:
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
    receive, writer = start_child()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort at the memory cap must not dump a core

    def send(obj: Any) -> None:
        try:
            writer.send(obj)  # encodes whole before writing: a failure leaves the stream intact
        except (MemoryError, UnicodeEncodeError, TypeError, OverflowError) as e:  # e.g. a lone surrogate
            writer.send([USER_ERROR, f"the result cannot be sent back: {type(e).__name__}"])

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
