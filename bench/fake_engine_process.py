"""A FAKE engine core process, for benchmarks and tests only: no model, tokens as fast as the API server takes them.

    SPINDLE_ENGINE_COMMAND="python -m bench.fake_engine_process" spindle --model DEMO_DIR [--api-server-count N]

`engine/client/process_client.py` `engine_command` starts this instead of `python -m engine` when SPINDLE_ENGINE_COMMAND
says
so, with the same arguments (`--config JSON`, and `--channels fd,...` under `--api-server-count`). It speaks
the real protocol by running the real loop around a fake core: `engine/core/loop.py` `run` on stdin / stdout
(`Pipes`)
or on the launcher's socketpairs (`engine/transport/channels.py` `ChannelSet`), so the frames, the one `StepOutputs` per
step (per channel), the heartbeats and the lifeline are exactly the real engine's. `Ready` comes from the model
folder's config.json (vocabulary, context length, eos ids). Every step gives each running request one token (ids
of a real English text, cycled, so the server's detokenizer does real work; never an eos id) and finishes it with
"length" at max_tokens ("stop" on one of its stop_token_ids); steps follow each other without a pause, so the only
brake is the pipe: a step's write blocks while the API server has not read the last ones. No logprobs, no
embeddings, no images, no constraints (they are ignored). It runs at the real engine's nice +10.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from engine.__main__ import run_below_server
from engine.config import EngineConfig
from engine.core.loop import Links, Pipes, run
from engine.messages import AddRequest, EngineStats, LoadFailed, Ready, RequestOutput, ToEngine
from engine.transport.channels import ChannelSet, wait_for_lifeline
from engine.transport.ipc import FrameReader, FrameWriter, die_with_parent

_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then, as if nothing had happened, it sits down by the "
    "river to watch the boats go by. Numbers such as 42, 3.14 and 1,000,000 appear now and then; so do names "
    "like London, Marie Curie or the Pacific Ocean.\nA new line starts here: short words, long words, "
    'punctuation (brackets, quotes "like these", dashes - and colons) and plain sentences follow each other.\n'
)


class _Running:
    __slots__ = ("request_id", "max_tokens", "stop_ids", "arrival", "scheduled", "first_token", "count")

    def __init__(self, req: AddRequest, now: float) -> None:
        self.request_id = req.request_id
        self.max_tokens = req.params.max_tokens
        self.stop_ids = req.params.stop_token_ids
        self.arrival = req.arrival_time
        self.scheduled = now
        self.first_token = 0.0
        self.count = 0


class FakeCore:
    """What engine/core/loop.py's `Core` protocol asks, without a model: one token per running request per step."""

    def __init__(self, config: EngineConfig) -> None:
        folder = Path(config.model)
        cfg = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json")
        vocab = int(cfg.get("vocab_size", 32000))
        ids = list(range(100, 1100))
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            vocab = min(vocab, tok.get_vocab_size())
            ids = tok.encode(_TEXT).ids
        eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
        self.token_ids = [t for t in ids if 0 <= t < vocab and t not in eos] or [0]
        self.num_blocks = config.num_blocks or 1000
        self.ready = Ready(
            max_model_len=config.max_model_len or int(cfg.get("max_position_embeddings", 4096)),
            vocab_size=vocab,
            eos_token_ids=sorted(eos),
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            model_dtype="float32",
        )
        self.running: dict[str, _Running] = {}
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step as the real core does

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self._pending)

    def add_request(self, req: AddRequest) -> None:
        self.running[req.request_id] = _Running(req, time.time())

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            r = self.running.pop(rid, None)
            if r is not None:
                self._pending.append(self._output(r, [], "abort"))

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), 0, 0, self.num_blocks, 0, 0, 0)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        now = time.time()
        ids, n = self.token_ids, len(self.token_ids)
        done: list[str] = []
        for r in self.running.values():
            token = ids[r.count % n]
            r.count += 1
            if not r.first_token:
                r.first_token = now
            reason = None
            if token in r.stop_ids:
                reason = "stop"
            elif r.count >= r.max_tokens:
                reason = "length"
            outputs.append(self._output(r, [token], reason))
            if reason is not None:
                done.append(r.request_id)
        for rid in done:
            del self.running[rid]
        return outputs

    @staticmethod
    def _output(r: _Running, new: list[int], reason: str | None) -> RequestOutput:
        return RequestOutput(
            r.request_id,
            new,
            reason,
            arrival_time=r.arrival,
            scheduled_time=r.scheduled,
            first_token_time=r.first_token,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def main() -> None:
    """engine/__main__.py's `main`, with the fake core."""
    parser = argparse.ArgumentParser(prog="python -m bench.fake_engine_process")
    parser.add_argument("--config", required=True)
    parser.add_argument("--channels", default="")
    args = parser.parse_args()
    run_below_server()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out_fd = os.dup(1)
    os.dup2(2, 1)
    links: Links
    if args.channels:
        links = ChannelSet([int(fd) for fd in args.channels.split(",")])
    else:
        links = Pipes(FrameReader(0, ToEngine), FrameWriter(out_fd))
    try:
        config = EngineConfig(**json.loads(args.config))
        core = FakeCore(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent as the real engine does
        links.broadcast(LoadFailed(f"fake engine: {type(e).__name__}: {e}"))
        sys.exit(1)
    links.broadcast(core.ready)
    try:
        run(core, config.heartbeat_interval, links)
    except (BrokenPipeError, KeyboardInterrupt):
        return
    if args.channels:
        wait_for_lifeline()


if __name__ == "__main__":
    main()
