"""Audio inside the engine (Whisper): per-request audio state, the encoder cache, cross-attention inputs and
Whisper's logits rules.

A request's `AudioInput` (engine/messages.py) carries one window's log-mel features and their hash. `AudioRunner`
(one per ModelRunner of a Whisper model) encodes the requests of a step that have no cross-attention K/V yet in
one batch (encoder outputs cached by hash, so the same audio twice, or a language-detection request followed by
its transcription, runs the encoder once), computes each request's K/V once and keeps them on its `SeqAudio`
(preemption recomputes only the decoder's self-attention), and drops them when the request ends.

The logits rules are transformers' WhisperForConditionalGeneration.generate's, in its order: the begin-suppress
tokens at the first generated position, the suppress tokens always, then (with timestamps) the timestamp
rules of WhisperTimeStampLogitsProcessor, so greedy tokens equal transformers' for the same features and prompt.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.messages import AudioInput
from engine.models.step import CrossBatch
from engine.models.whisper import WhisperModel
from engine.multimodal.image_runner import EncoderCache
from engine.multimodal.processing import ENCODER_CACHE_BYTES
from engine.types.image_state import SeqAudio
from engine.types.sequence import ScheduledSeq, Sequence

ENCODE_BATCH = 8  # windows per encoder call: a large model's attention over 1500 frames is big per window


class WhisperRules:
    """Whisper's generation rules from generation_config.json."""

    def __init__(self, gen: dict[str, Any], eos: int) -> None:
        self.suppress = [int(t) for t in gen.get("suppress_tokens") or ()]
        self.begin_suppress = [int(t) for t in gen.get("begin_suppress_tokens") or ()]
        no_ts = gen.get("no_timestamps_token_id")
        self.no_timestamps = int(no_ts) if no_ts is not None else None
        self.timestamp_begin = self.no_timestamps + 1 if self.no_timestamps is not None else None
        initial = gen.get("max_initial_timestamp_index")
        self.max_initial = int(initial) if initial is not None else None
        self.eos = eos

    def apply(self, row: torch.Tensor, audio: SeqAudio, tokens: list[int]) -> None:
        """Mask one sampling row's logits [vocab] in place; tokens: the sequence's tokens so far."""
        generated = tokens[audio.begin :]
        inf = float("-inf")
        if not generated and self.begin_suppress:
            row[self.begin_suppress] = inf
        if self.suppress:
            row[self.suppress] = inf
        if audio.timestamps and self.timestamp_begin is not None:
            self._timestamps(row, generated)

    def _timestamps(self, row: torch.Tensor, seq: list[int]) -> None:
        """WhisperTimeStampLogitsProcessor for one row: pairs, no decrease, the first token a timestamp."""
        tb, inf = self.timestamp_begin, float("-inf")
        assert tb is not None and self.no_timestamps is not None
        row[self.no_timestamps] = inf
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penultimate_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penultimate_ts:
                row[tb:] = inf  # a pair is complete: text next
            else:
                row[: self.eos] = inf  # after one timestamp: another, or the end
        stamps = [t for t in seq if t >= tb]
        if stamps:
            floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
            row[tb:floor] = inf
        if not seq:
            row[:tb] = inf
            if self.max_initial is not None:
                row[tb + self.max_initial + 1 :] = inf
        logprobs = torch.log_softmax(row.float(), dim=-1)
        if logprobs[tb:].logsumexp(dim=-1) > logprobs[:tb].max():
            row[:tb] = inf


class AudioRunner:
    """The audio half of a Whisper step: encodes new requests, gives the decoder each request's K/V."""

    def __init__(
        self, model: WhisperModel, gen: dict[str, Any], eos: int, cache_bytes: int = ENCODER_CACHE_BYTES
    ) -> None:
        self.model = model
        self.rules = WhisperRules(gen, eos)
        self.sot = int(gen.get("decoder_start_token_id", 50258))
        # Whisper's <|nospeech|> is the token before <|notimestamps|> (transformers' WhisperNoSpeechDetection)
        no_ts = self.rules.no_timestamps
        self.no_speech_id = no_ts - 1 if no_ts is not None else None
        self.cache = EncoderCache(cache_bytes)
        self.encoder_runs = 0  # windows encoded (tests: once per content)
        self.cache_hits = 0

    def seq_audio(self, audio: AudioInput, prompt: list[int]) -> SeqAudio:
        """Check a request's audio; ValueError (the request is refused) when its features do not fit the model."""
        want = [self.model.w.num_mel_bins, self.model.num_frames]
        if list(audio.shape) != want:
            raise ValueError(f"audio features of shape {list(audio.shape)} do not fit this model (expected {want})")
        if len(audio.features) != want[0] * want[1] * 4:
            raise ValueError(
                f"audio features hold {len(audio.features)} bytes; shape {want} float32 needs {want[0] * want[1] * 4}"
            )
        features = torch.frombuffer(bytearray(audio.features), dtype=torch.float32).reshape(want)
        sot = prompt.index(self.sot) if self.sot in prompt else None
        return SeqAudio(audio.hash, features, audio.timestamps, audio.rules, len(prompt), sot_index=sot)

    def _encode_new(self, seqs: list[SeqAudio]) -> None:
        """Cross-attention K/V for the requests that have none: cached encoder outputs, the rest in one batch."""
        todo: list[SeqAudio] = []
        outs: dict[str, torch.Tensor] = {}
        for a in seqs:
            cached = self.cache.get(a.hash)
            if cached is not None:
                self.cache_hits += 1
                outs[a.hash] = cached
            elif a.hash not in outs and all(t.hash != a.hash for t in todo):
                todo.append(a)
        for k in range(0, len(todo), ENCODE_BATCH):
            part = todo[k : k + ENCODE_BATCH]
            encoded = self.model.encode(torch.stack([a.features for a in part if a.features is not None]))
            self.encoder_runs += len(part)
            for a, e in zip(part, encoded):
                outs[a.hash] = e
                self.cache.put(a.hash, e)
        hashes = list(dict.fromkeys(a.hash for a in seqs))
        kvs: dict[str, Any] = {}
        for k in range(0, len(hashes), ENCODE_BATCH):
            part_h = hashes[k : k + ENCODE_BATCH]
            kvs.update(zip(part_h, self.model.cross_kv(torch.stack([outs[h] for h in part_h]))))
        for a in seqs:
            a.cross, a.features = kvs[a.hash], None

    def cross_batch(self, batch: list[ScheduledSeq]) -> CrossBatch:
        """The step's cross-attention inputs; every sequence must carry audio (RuntimeError otherwise)."""
        audios = []
        for s in batch:
            if s.seq.audio is None:
                raise RuntimeError(f"request {s.seq.request_id} has no audio; a Whisper model needs it")
            audios.append(s.seq.audio)
        new = [a for a in audios if a.cross is None]
        if new:
            self._encode_new(new)
        spans, row = [], 0
        for s, a in zip(batch, audios):
            spans.append((row, s.num_new_tokens, a.cross))
            row += s.num_new_tokens
        return CrossBatch(spans)

    def note_no_speech(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Each request's <|nospeech|> probability from the raw logits at its <|startoftranscript|> row, when that
        row is in this step (Whisper's no_speech_prob)."""
        if self.no_speech_id is None:
            return
        row = 0
        for s in batch:
            a = s.seq.audio
            at = a.sot_index if a is not None else None
            if (
                a is not None
                and at is not None
                and a.rules
                and a.no_speech is None
                and s.start <= at < s.start + s.num_new_tokens
            ):
                logits = self.model.compute_logits(hidden[row + at - s.start][None])
                a.no_speech = float(torch.softmax(logits[0].float(), dim=-1)[self.no_speech_id])
            row += s.num_new_tokens

    @torch.inference_mode()
    def mask_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Whisper's rules on the sampling rows (in `seqs` order), in place, before the sampler."""
        for i, seq in enumerate(seqs):
            audio = seq.audio
            if audio is not None and audio.rules:
                self.rules.apply(logits[i], audio, seq.token_ids)

    @staticmethod
    def release(seq: Sequence) -> None:
        """The request ended: its cross-attention K/V go now, not when the Sequence is collected."""
        if seq.audio is not None:
            seq.audio.cross = seq.audio.features = None
