"""A draft model for speculative decoding: a smaller checkpoint (or the target itself) in the engine process,
with its own KV cache, proposing k greedy tokens per speculating sequence, batched across them. A proposal is
the argmax after the request's penalties, logit bias and bans, as the target's greedy row would pick it.

Each sequence has a shadow Sequence over the draft's cache: its tokens, how many of them have K/V there, and
its own block table. Before a proposal the shadow catches up from the longest prefix it still shares with the
sequence (the accepted tokens and the bonus token are the new part), then argmax decodes k tokens. Greedy
proposals make the draft distribution one-hot, which verification already handles exactly (verify.py).
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import torch

from engine.config import EngineConfig
from engine.execution.model_runner import ModelRunner, step_threads
from engine.execution.sampler import Sampler
from engine.models.checkpoint_meta import max_model_len
from engine.models.loader import read_config, resolve_model
from engine.models.weights import ModelLoadError
from engine.spec.vocab import MISMATCH, vocab_mismatch
from engine.spec_config import FLAG, SpecConfig
from engine.types.sequence import ScheduledSeq, Sequence


class DraftModel:
    """The draft's runner (a ModelRunner over the draft checkpoint) and the shadows of the sequences it drafts
    for. Its cache has as many blocks as the target's: the draft never holds more of a sequence than the
    target does during its verification, and a sequence that finds no free block simply does not draft."""

    def __init__(self, spec: SpecConfig, config: EngineConfig, target: ModelRunner) -> None:
        assert spec.model is not None
        try:
            path = resolve_model(spec.model)
        except ModelLoadError as e:
            raise ModelLoadError(f"{FLAG}: draft model: {e}") from e
        if (why := vocab_mismatch(resolve_model(config.model), path)) is not None:  # before loading the weights
            raise ModelLoadError(f"{FLAG}: {MISMATCH}: {why}")
        limit = min(max_model_len(read_config(path), None), target.max_model_len)
        draft_config = dataclasses.replace(
            config,
            model=str(path),
            max_model_len=limit,
            num_blocks=target.num_blocks,
            quantization=None,
            enable_lora=False,
            tensor_parallel_size=1,
            speculative_config={},
        )
        self.runner = ModelRunner(draft_config, use_triton=target.use_triton)
        if self.runner.states is not None:  # its recurrent state would need a pool and rollback of its own
            raise ModelLoadError(f"{FLAG}: the draft model must not be a hybrid recurrent model; {spec.model} is")
        if self.runner.images is not None or self.runner.audio is not None:
            raise ModelLoadError(f"{FLAG}: the draft model must be a text-only decoder; {spec.model} is not")
        if self.runner.vocab_size != target.vocab_size:
            why = f"vocab_size {target.vocab_size} in the target, {self.runner.vocab_size} in the draft"
            raise ModelLoadError(f"{FLAG}: {MISMATCH}: {why}")
        self.max_model_len = limit
        self.sampler = Sampler(target.vocab_size, list(target.eos_token_ids), target.device)
        self.free: list[int] = list(range(self.runner.num_blocks))
        self.shadows: dict[Sequence, Sequence] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def retain(self, seqs: set[Sequence]) -> None:
        """Drop the shadows (and blocks) of sequences no longer running: finished, aborted or preempted."""
        for seq in [s for s in self.shadows if s not in seqs]:
            self.free += self.shadows.pop(seq).block_table

    def _shadow(self, seq: Sequence, k: int) -> Sequence | None:
        """seq's shadow set to catch up on its new tokens, with blocks for k proposals; None: no room."""
        n = seq.num_tokens
        if n + k - 1 > self.max_model_len:
            return None
        shadow = self.shadows.get(seq)
        if shadow is None:
            params = msgspec.structs.replace(seq.params, temperature=0.0, logprobs=None, prompt_logprobs=None)
            shadow = self.shadows[seq] = Sequence.new(seq.request_id, [], params, 0.0)
            shadow.num_prompt_tokens = seq.num_prompt_tokens  # penalties count the output tokens
        bs = self.runner.block_size
        need = -(-(n + k - 1) // bs) - len(shadow.block_table)  # positions 0 .. n + k - 2 are written
        if need > len(self.free):
            return None
        if need > 0:
            shadow.block_table += self.free[-need:]
            del self.free[-need:]
        valid, old = 0, shadow.token_ids
        limit = min(shadow.num_computed_tokens, n - 1)  # the last token is always run: its row proposes
        while valid < limit and old[valid] == seq.token_ids[valid]:
            valid += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = valid
        return shadow

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[float, int, int]]:
        """Set seq.draft to k greedy draft tokens for each (seq, k); a sequence without room drafts nothing.
        Returns each forward's CPU seconds (its sampling included), longest chunk and tokens
        (engine/spec/adaptive.py DraftCost)."""
        forwards: list[tuple[float, int, int]] = []
        todo: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in wanted:
            shadow = self._shadow(seq, k)
            if shadow is not None:
                seq.draft = []
                todo.append((seq, shadow, k))
        while todo:
            batch = [ScheduledSeq(sh, sh.num_tokens - sh.num_computed_tokens) for _, sh, _ in todo]
            began = time.process_time()  # the clock of the target's step cost fit
            with step_threads(self.runner, batch):
                logits = self.runner.execute(batch).logits
            # the target's greedy row applies the request's penalties, bias and bans: the draft's pick does too
            proposed = self.sampler.sample(logits, [s.seq for s in batch], scratch=True).token_ids
            sizes = [s.num_new_tokens for s in batch]
            forwards.append((time.process_time() - began, max(sizes), sum(sizes)))
            for s, token in zip(batch, proposed):
                s.seq.num_computed_tokens += s.num_new_tokens
                s.seq.token_ids.append(token)
            for (seq, _, _), token in zip(todo, proposed):
                seq.draft.append(token)
            todo = [(seq, sh, k) for seq, sh, k in todo if len(seq.draft) < k]
        for seq, _ in wanted:  # the last proposal was never run: it is not in the cache
            if (shadow := self.shadows.get(seq)) is not None and shadow.num_tokens > shadow.num_computed_tokens:
                shadow.token_ids.pop()
        return forwards
