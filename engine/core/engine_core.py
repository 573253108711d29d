"""The engine core's step: drain aborts, schedule, run the model, sample, report. Knows no text, no HTTP.

`EngineCore` is usable in-process (tests, benchmarks); engine/core/loop.py runs it in the subprocess.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_disk_store import KVDiskStore
from engine.core.kv_offload import KVOffload, default_folder, fitted_bound, model_digest
from engine.core.params import validate_params
from engine.core.scheduler import RequestRefused, Scheduler
from engine.core.state_pool import hybrid_pool
from engine.distributed.tp_runner import TPModelRunner
from engine.execution.kernel_warmup import prepare_kernels
from engine.execution.model_runner import ModelRunner, step_threads
from engine.execution.pooler import Pooler
from engine.execution.sampler import Sampler
from engine.messages import AddRequest, EngineStats, PoolingInfo, Ready, RequestOutput, TokenLogprobs
from engine.models.loader import ModelLoadError, read_config, resolve_model
from engine.models.pooling_archs import check_runner, load_score_head
from engine.multimodal.audio_runner import AudioRunner
from engine.pooling_config import pooling_info
from engine.spec.speculator import Speculator
from engine.spec.verify import sampled_rows, verify
from engine.spec_config import SpecConfig, parse_spec_config
from engine.structured.backend import StructuredBackend
from engine.structured.manager import StructuredOutputManager
from engine.types.sequence import ScheduledSeq, SeqStatus, Sequence

if TYPE_CHECKING:
    from engine.spec.draft_model import DraftModel

log = logging.getLogger("engine")

COMPILE_WAIT = 0.05  # seconds a step with nothing to run waits for a grammar compile (new frames wait as long)


def make_runner(config: EngineConfig) -> ModelRunner:
    """This process's runner: the whole model, or rank 0 of a tensor-parallel group (which starts the others)."""
    if config.tensor_parallel_size > 1:
        return TPModelRunner(config)
    return ModelRunner(config)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        check_runner(read_config(resolve_model(config.model)), config.runner)  # no LM head: pooling only
        self.runner = make_runner(config)  # tensor parallel: rank 0, which starts the other ranks
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        # runner "pooling": one pooled output per request, no tokens sampled (engine/execution/pooler.py)
        self.pooling: PoolingInfo | None = None
        self.pooler = self._make_pooler() if config.runner == "pooling" else None
        # MEAN pooling reads every prompt position's hidden state: a prefix-cache hit would skip some
        caching = config.enable_prefix_caching and not (self.pooler is not None and self.pooler.needs_all_rows)
        # Whisper: a decoder block's K/V depend on the audio (cross-attention), not only on its tokens (as vLLM)
        caching = caching and getattr(self.runner, "audio", None) is None
        # a hybrid model's recurrent state: a slot per sequence, prefix hits only where a snapshot is
        state = hybrid_pool(self.runner.states)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.runner.block_size,
            caching and (state is None or state.interval > 0),
            window=self.runner.kv_window,
            state=state,
            disk=self._disk_store() if state is None else None,  # a hybrid model's state is not on disk
        )
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_manager=self.block_manager,
            policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        if self.runner.lora is not None:  # live requests' adapters stay loaded on CPU (engine/lora/manager.py)
            self.runner.lora.live_digests = self._live_adapters
        self.sampler = Sampler(self.vocab_size, list(self.runner.eos_token_ids), self.runner.device)
        self.structured = StructuredOutputManager(self._grammar_backend, self.runner.device, self.eos_token_ids)
        self._pending: list[RequestOutput] = []  # refusals and aborts, reported with the next step
        spec = parse_spec_config(config.speculative_config)  # --speculative-config (engine/spec/)
        self.spec: Speculator | None = None
        if spec is not None and self.pooler is None:
            self.spec = Speculator(spec, self.max_model_len, self._drafter(spec))
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        if self.runner.device.type == "cpu":  # before Ready: the first request's step builds and times no kernel
            prepare_kernels(self.runner.dtype)

    def _disk_store(self) -> KVOffload | None:
        """--kv-disk-cache-size: full blocks leaving the pool kept on disk (one process's caches: not under TP)."""
        c = self.config
        if c.kv_disk_cache_size == 0 or c.tensor_parallel_size > 1:
            return None
        folder = Path(c.kv_disk_cache_dir) if c.kv_disk_cache_dir else default_folder()
        digest = model_digest(resolve_model(c.model), c.quantization)
        bound = fitted_bound(folder, c.kv_disk_cache_size)
        log.info("KV disk store: %s, at most %.2f GiB (--kv-disk-cache-size)", folder, bound / (1 << 30))
        return KVOffload(KVDiskStore(folder, bound), self.runner.kv_caches, digest)

    def _drafter(self, spec: SpecConfig) -> DraftModel | None:
        """method draft_model: the draft checkpoint, loaded beside the target (engine/spec/draft_model.py)."""
        if spec.method != "draft_model":
            return None
        from engine.spec.draft_model import DraftModel  # why late: only a draft model's engine needs it

        return DraftModel(spec, self.config, self.runner)

    def _grammar_backend(self) -> StructuredBackend:
        """Built by the first constrained request, in the compile thread (the LLTokenizer takes ~1.5 s)."""
        # why late: llguidance is loaded only by an engine that compiles a grammar
        from engine.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend.from_checkpoint(
            resolve_model(self.config.model), self.vocab_size, sorted(self.eos_token_ids)
        )

    def _make_pooler(self) -> Pooler:
        """The task and pooler (engine/pooling_config.py) and, for a classifier, its score head."""
        folder = resolve_model(self.config.model)
        overrides = self.config.pooler_config
        info = self.pooling = pooling_info(
            folder, read_config(folder), self.config.convert, overrides, self.runner.model.args.hidden_size
        )
        model = self.runner.model
        head = load_score_head(folder, model.dtype, model.device) if info.task == "classify" else None
        returned = overrides.get("returned_token_ids")
        width = head.shape[0] if head is not None else info.hidden_size
        if returned is not None and max(returned) >= width:
            raise ModelLoadError(
                f"--pooler-config: returned_token_ids must be below the output width {width}, got {max(returned)}"
            )
        return Pooler(info.pooling_type, head, overrides.get("step_tag_id"), returned)

    def ready_message(self) -> Ready:
        return Ready(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            model_dtype=self.runner.model_dtype,
            generation_defaults=dict(self.runner.generation_defaults),
            pooling=self.pooling,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished

    def add_request(self, req: AddRequest) -> None:
        try:
            validate_params(req.params, self.vocab_size)
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestRefused(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            params = req.params
            if self.pooler is not None:  # prefill only: no output token needs room in the context
                params = msgspec.structs.replace(params, max_tokens=0, prompt_logprobs=None)
            seq = Sequence.new(req.request_id, req.prompt_token_ids, params, req.arrival_time, req.priority)
            if req.lora is not None:
                if self.runner.lora is None:
                    raise RequestRefused("this server runs no LoRA adapters; start it with --enable-lora")
                self.runner.lora.register(req.lora)  # AdapterError (a ValueError): refused, naming why
                seq.lora = req.lora
            if req.mm_inputs:
                if self.runner.images is None:
                    raise RequestRefused("this model takes no images here; send text only")
                seq.mm = self.runner.images.seq_images(req.mm_inputs, req.prompt_token_ids)
            self._attach_audio(seq, req)
            constrained = params.structured_outputs is not None and self.pooler is None
            self.scheduler.add(seq, hold=constrained)  # refuses what can never fit
            if constrained:
                self.structured.submit(seq)  # compiles off the step; the scheduler holds seq meanwhile
        except ValueError as e:
            self._pending.append(
                RequestOutput(req.request_id, [], finish_reason="error", error=str(e), arrival_time=req.arrival_time)
            )
            return
        if req.params.prompt_logprobs is not None:
            self._prompt_logprobs[req.request_id] = [None]

    def _live_adapters(self) -> set[str]:
        return {s.lora.digest for s in self.scheduler.live() if s.lora is not None}

    def _attach_audio(self, seq: Sequence, req: AddRequest) -> None:
        """A speech model's request must carry audio, and only a speech model's may (RequestRefused)."""
        audio = getattr(self.runner, "audio", None)
        if req.audio is None and audio is not None:
            raise RequestRefused("this speech-to-text model needs audio; use /v1/audio/transcriptions")
        if req.audio is not None:
            if audio is None:
                raise RequestRefused("this model takes no audio")
            seq.audio = audio.seq_audio(req.audio, req.prompt_token_ids)

    def abort(self, request_ids: list[str]) -> None:
        for seq in self.scheduler.abort(request_ids):
            AudioRunner.release(seq)
            self.structured.release(seq)
            self._prompt_logprobs.pop(seq.request_id, None)
            if self.pooler is not None:
                self.pooler.forget(seq.request_id)
            self._pending.append(self._output(seq, [], None))

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        # the encoder caches' hits: images (Qwen2-VL) or audio windows (Whisper)
        hits = sum(
            r.cache_hits
            for r in (getattr(self.runner, "images", None), getattr(self.runner, "audio", None))
            if r is not None
        )
        if hits:
            stats = msgspec.structs.replace(stats, image_cache_hits=hits)
        if self.runner.lora is not None:
            live = [s for s in self.scheduler.live() if s.lora is not None]
            running = sorted({s.lora.name for s in live if s.status is SeqStatus.RUNNING and s.lora is not None})
            waiting = sorted({s.lora.name for s in live if s.status is not SeqStatus.RUNNING and s.lora is not None})
            stats = msgspec.structs.replace(stats, lora_running=running, lora_waiting=waiting)
        if (spec := self.spec) is not None:
            stats = msgspec.structs.replace(
                stats,
                spec_num_drafts=spec.num_drafts,
                spec_num_draft_tokens=spec.num_draft_tokens,
                spec_num_accepted_tokens=spec.num_accepted_tokens,
                spec_accepted_per_pos=list(spec.accepted_per_pos),
            )
        return stats

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.structured.num_compiling:
            outputs += self._admit_compiled()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch and self.structured.num_compiling and not outputs:
            self.structured.wait(COMPILE_WAIT)  # only held requests left: sleep until a compile lands
            outputs += self._admit_compiled()
            batch = self.scheduler.schedule()
        if not batch:
            return outputs
        if self.pooler is not None:
            return outputs + self._pool_step(batch, self.pooler)
        began = time.process_time()  # the cost fit's clock: CPU time, blind to other processes on shared cores
        # a small step on one intra-op thread: the LM head spreads over the runner's own threads instead
        with step_threads(self.runner, batch):
            rows = sampled_rows(batch)  # one per logits row: a verification has one per draft token and one more
            masks = self.structured.start_masks(rows.seqs) if self.structured.num_live else None
            result = self.runner.execute(batch)
            audio = getattr(self.runner, "audio", None)
            if audio is not None and rows.seqs:  # Whisper's suppress / timestamp rules, as transformers' generate
                audio.mask_logits(result.logits, rows.seqs)
            for i, logits in result.prompt_logits.items():
                self._collect_prompt_logprobs(batch[i].seq, batch[i].start, logits)
            if masks is not None:
                # the grammar's ban goes in before the sampler, as in vLLM: logprobs (raw by the sampler's
                # convention) are then those of the allowed distribution, and every draw is an allowed token
                self.structured.mask_logits(result.logits, masks)
            # the runner's logits buffer is rewritten next step: the sampler may work in it
            emitted = verify(self.sampler, result.logits, rows) if rows.seqs else []
        if self.spec is not None and all(s.samples and s.num_new_tokens == s.num_draft + 1 for s in batch):
            self.spec.record_step(
                sum(s.num_new_tokens for s in batch), any(s.num_draft for s in batch), time.process_time() - began
            )
        return outputs + self._advance(batch, emitted)

    def _advance(
        self, batch: list[ScheduledSeq], emitted: list[tuple[Sequence, list[int], list[TokenLogprobs | None]]]
    ) -> list[RequestOutput]:
        """Append each sequence's emitted tokens up to the first that ends it; count verifications' outcomes."""
        now = time.time()
        finished: list[Sequence] = []
        outputs = []
        drafted = {s.seq: s for s in batch if s.num_draft}
        for seq, tokens, lps in emitted:
            if not seq.first_token_time:
                seq.first_token_time = now
            n = 0
            for token in tokens:
                verdict = self.structured.accept(seq, token) if seq.structured is not None else None
                if verdict is not None and verdict != "stop":  # rejected: never emitted, never a crash
                    seq.finish_reason, seq.error = "error", verdict
                    break
                seq.token_ids.append(token)
                n += 1
                # a complete grammar ends the request ("stop") even under ignore_eos or min_tokens: nothing
                # more could be generated (the mask would allow only eos)
                reason = "stop" if verdict == "stop" else self._check_stop(seq, token)
                if reason is not None:
                    seq.finish_reason = reason
                    break
            if (s := drafted.get(seq)) is not None and self.spec is not None:
                self.spec.record(seq, s.num_draft, len(tokens) - 1)
                if self.runner.states is not None:  # a hybrid's state: back to its last accepted position
                    self.runner.states.accept(seq, len(tokens) - 1)
                s.num_new_tokens -= s.num_draft - (len(tokens) - 1)  # only accepted positions' K/V count
            if seq.finish_reason is not None:
                finished.append(seq)
            outputs.append(self._output(seq, tokens[:n], lps[:n]))
        self.scheduler.update(batch)
        for seq in finished:
            self.scheduler.finish(seq, seq.finish_reason or "stop")
            AudioRunner.release(seq)
            if seq.structured is not None:
                self.structured.release(seq)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Release requests whose grammar is ready; finish those whose compile failed with "error"."""
        ready, failed = self.structured.poll()
        for seq in ready:
            self.scheduler.release(seq)
        outputs = []
        for seq, why in failed:
            seq.error = why
            self.scheduler.finish(seq, "error")
            self._prompt_logprobs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [], None))
        return outputs

    def _pool_step(self, batch: list[ScheduledSeq], pooler: Pooler) -> list[RequestOutput]:
        """Runner "pooling": prefill; a request whose prompt is done gets its output and frees its blocks."""
        with step_threads(self.runner, batch):
            hidden = self.runner.execute_pooling(batch, pooler.needs_all_rows)
            done = pooler.pool(batch, hidden)
        now = time.time()
        self.scheduler.update(batch)
        outputs = []
        for seq, pooled in done:
            seq.first_token_time = now
            self.scheduler.finish(seq, "stop")  # no KV kept: the blocks go back now
            outputs.append(msgspec.structs.replace(self._output(seq, [], None), pooled=pooled))
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

    def _output(self, seq: Sequence, new: list[int], lps: list[TokenLogprobs | None] | None) -> RequestOutput:
        prompt_lps = None
        if new and seq.num_output_tokens == 1 and seq.request_id in self._prompt_logprobs:
            prompt_lps = self._prompt_logprobs.pop(seq.request_id)
        reason = seq.finish_reason
        if reason == "abort":
            self._prompt_logprobs.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id,
            new,
            finish_reason=reason,
            stop_token_id=seq.stop_token_id,
            error=seq.error,
            logprobs=[lp for lp in lps if lp is not None] or None if lps else None,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            arrival_time=seq.arrival_time,
            scheduled_time=seq.scheduled_time,
            first_token_time=seq.first_token_time,
            num_preemptions=seq.num_preemptions,
            no_speech_prob=seq.audio.no_speech if seq.audio is not None and reason is not None else None,
        )

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
        targets = seq.token_ids[first + 1 : end + 1]
        acc.extend(
            self.sampler.prompt_logprobs(
                logits[first - start : end - start],  # type: ignore[index]
                targets,
                seq.params.prompt_logprobs,
            )
        )
