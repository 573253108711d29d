"""The engine core: drain aborts, schedule, run the model, sample, report. Knows no text, no HTTP.

`EngineCore` is usable in-process (tests, benchmarks); `serve` is the subprocess loop around it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time

from engine.config import EngineConfig
from engine.ipc import FrameReader, FrameWriter
from engine.kv_cache import BlockManager
from engine.messages import (
    AbortRequests, AddRequest, EngineStats, Heartbeat, Ready, RequestOutput, SamplingParams,
    Shutdown, StepOutputs, ToEngine, TokenLogprobs,
)
from engine.model_runner import ModelRunner, one_intra_op_thread
from engine.sampler import Sampler
from engine.scheduler import RequestRefused, Scheduler
from engine.sequence import Sequence

log = logging.getLogger("engine")
INT64_MAX = (1 << 63) - 1


def validate_params(p: SamplingParams, vocab_size: int) -> None:
    """Engine-side guard: the server validates too, but nothing a request carries may crash the engine."""
    floats = {"temperature": p.temperature, "top_p": p.top_p, "min_p": p.min_p,
              "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
              "repetition_penalty": p.repetition_penalty}
    for name, value in floats.items():
        if not math.isfinite(value):
            raise RequestRefused(f"{name} must be a finite number, got {value}")
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be at least 1, got {p.max_tokens}"),
        (p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {p.top_k}"),
        (p.repetition_penalty > 0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (0 <= p.min_tokens, f"min_tokens must be >= 0, got {p.min_tokens}"),
        (p.seed is None or -INT64_MAX - 1 <= p.seed <= INT64_MAX, "seed must fit in int64"),
        (p.logprobs is None or 0 <= p.logprobs <= vocab_size, "logprobs out of range"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= vocab_size,
         "prompt_logprobs out of range"),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestRefused(message)
    ids = list(p.stop_token_ids) + list(p.allowed_token_ids or ()) + list(p.logit_bias or ())
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestRefused(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if p.logit_bias and not all(math.isfinite(v) for v in p.logit_bias.values()):
        raise RequestRefused("logit_bias values must be finite numbers")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise RequestRefused("allowed_token_ids must not be empty")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   block_manager=self.block_manager)
        self.sampler = Sampler(self.vocab_size, list(self.runner.eos_token_ids), self.runner.device)
        self._pending: list[RequestOutput] = []  # refusals and aborts, reported with the next step
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}

    def ready_message(self) -> Ready:
        return Ready(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                     eos_token_ids=sorted(self.eos_token_ids), num_blocks=self.runner.num_blocks,
                     block_size=self.runner.block_size, model_dtype=self.runner.model_dtype,
                     generation_defaults=dict(self.runner.generation_defaults))

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished

    def add_request(self, req: AddRequest) -> None:
        try:
            validate_params(req.params, self.vocab_size)
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestRefused(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            seq = Sequence.new(req.request_id, req.prompt_token_ids, req.params,
                               req.arrival_time, req.priority)
            self.scheduler.add(seq)  # refuses what can never fit
        except ValueError as e:
            self._pending.append(RequestOutput(req.request_id, [], finish_reason="error",
                                               error=str(e), arrival_time=req.arrival_time))
            return
        if req.params.prompt_logprobs is not None:
            self._prompt_logprobs[req.request_id] = [None]

    def abort(self, request_ids: list[str]) -> None:
        for seq in self.scheduler.abort(request_ids):
            self._prompt_logprobs.pop(seq.request_id, None)
            self._pending.append(self._output(seq, [], None))

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        # one intra-op thread: the LM head spreads over the runner's own threads instead
        with one_intra_op_thread() if self.runner.device.type == "cpu" else contextlib.nullcontext():
            result = self.runner.execute(batch)
            for i, logits in result.prompt_logits.items():
                self._collect_prompt_logprobs(batch[i].seq, batch[i].start, logits)
            sampling = [s.seq for s in batch if s.samples]
            # the runner's logits buffer is rewritten next step: the sampler may work in it
            sampled = self.sampler.sample(result.logits, sampling, scratch=True) if sampling else None
        now = time.time()
        finished: list[Sequence] = []
        if sampled is not None:
            for seq, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
                seq.token_ids.append(token)
                if not seq.first_token_time:
                    seq.first_token_time = now
                reason = self._check_stop(seq, token)
                if reason is not None:
                    seq.finish_reason = reason
                    finished.append(seq)
                outputs.append(self._output(seq, [token], lp))
        self.scheduler.update(batch)
        for seq in finished:
            self.scheduler.finish(seq, seq.finish_reason or "stop")
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:  # the sampler masks eos / stop ids before that
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_token_id = token
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int], lp: TokenLogprobs | None) -> RequestOutput:
        prompt_lps = None
        if new and seq.num_output_tokens == 1 and seq.request_id in self._prompt_logprobs:
            prompt_lps = self._prompt_logprobs.pop(seq.request_id)
        reason = seq.finish_reason
        if reason == "abort":
            self._prompt_logprobs.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id, new, finish_reason=reason, stop_token_id=seq.stop_token_id,
            logprobs=[lp] if lp is not None else None, prompt_logprobs=prompt_lps,
            num_cached_tokens=max(seq.num_cached_tokens, 0), arrival_time=seq.arrival_time,
            scheduled_time=seq.scheduled_time, first_token_time=seq.first_token_time,
            num_preemptions=seq.num_preemptions)

    def _collect_prompt_logprobs(self, seq: Sequence, start: int, logits: object) -> None:
        acc = self._prompt_logprobs.get(seq.request_id)
        if acc is None or seq.params.prompt_logprobs is None:
            return
        # position p's logits predict token p + 1; only prompt tokens are scored
        # acc[k] scores prompt token k; a recompute after preemption repeats positions already scored
        first = max(start, len(acc) - 1)
        end = min(start + logits.shape[0], seq.num_prompt_tokens - 1)  # type: ignore[attr-defined]
        if end <= first:
            return
        targets = seq.token_ids[first + 1:end + 1]
        acc.extend(self.sampler.prompt_logprobs(logits[first - start:end - start],  # type: ignore[index]
                                                targets, seq.params.prompt_logprobs))


def serve(config: EngineConfig, reader: FrameReader[ToEngine], writer: FrameWriter) -> None:
    """The subprocess loop. Returns on Shutdown or when the parent closes the pipe."""
    core = EngineCore(config)
    gc.collect()
    gc.freeze()  # the model and startup objects live for the process: full collections skip them
    writer.send(core.ready_message())
    log.info("engine ready: %d KV blocks of %d tokens", core.runner.num_blocks, core.runner.block_size)
    last_sent = time.monotonic()
    while True:
        # busy: just drain what arrived; idle: wait for work, but beat the heart meanwhile
        msgs = reader.poll(0 if core.has_work else config.heartbeat_interval)
        aborts: list[str] = []
        for msg in msgs:
            if isinstance(msg, AddRequest):
                core.add_request(msg)
            elif isinstance(msg, AbortRequests):
                aborts.extend(msg.request_ids)
            elif isinstance(msg, Shutdown):
                return
        if aborts:
            core.abort(aborts)  # before scheduling, so their blocks are free for this very step
        if reader.eof:
            return  # the parent is gone
        if core.has_work:
            outputs = core.step()
            writer.send(StepOutputs(outputs, time.time(), core.stats()))
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent >= config.heartbeat_interval:
            writer.send(Heartbeat(time.time(), core.stats()))
            last_sent = time.monotonic()
