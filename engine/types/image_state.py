"""A request's images and audio inside the engine (`Sequence.mm`, `Sequence.audio`). engine/multimodal/image_runner.py
builds the images (`ImageRunner.seq_images`) and reads them each step; audio_runner.py does the same for audio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Image:
    hash: str
    offset: int
    length: int
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None  # None: sent by hash only (the encoder cache held its output)
    encoded: torch.Tensor | None = None  # the encoder's output, held while the request lives


class SeqImages:
    """One request's images, its prompt's M-RoPE positions and the delta of every later position."""

    def __init__(self, images: list[Image], prompt_positions: torch.Tensor, delta: int) -> None:
        """prompt_positions [3, num_prompt_tokens]; a later token's position is its index + delta on every axis."""
        self.images = images
        self.prompt_positions = prompt_positions
        self.delta = delta
        self.num_prompt_tokens = prompt_positions.shape[1]

    def positions(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of tokens start .. start + n - 1 (outputs after the prompt: index + delta)."""
        p = self.num_prompt_tokens
        head = self.prompt_positions[:, start : min(start + n, p)]
        if start + n <= p:
            return head
        tail = torch.arange(max(start, p), start + n, dtype=torch.long) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)

    def block_extra(self, lo: int, hi: int) -> tuple[tuple[str, int], ...]:
        """What besides token ids names the KV of tokens [lo, hi): (hash, first offset in the image) per image."""
        return tuple(
            (i.hash, max(lo, i.offset) - i.offset) for i in self.images if i.offset < hi and lo < i.offset + i.length
        )


@dataclass
class SeqAudio:
    """One Whisper request's audio (`Sequence.audio`): its features until encoded, then its cross-attention K/V
    (engine/models/whisper.py CrossKV), held while the request lives and dropped when it finishes."""

    hash: str
    features: torch.Tensor | None  # [mels, frames] float32; None once encoded
    timestamps: bool  # Whisper's timestamp rules on the sampled tokens
    rules: bool  # suppress tokens / timestamp rules at all (off for language detection)
    begin: int  # the first generated token's index (the decoder prompt's length)
    cross: Any = None  # CrossKV once encoded (Any: this leaf module imports no model)
    sot_index: int | None = None  # where <|startoftranscript|> sits in the prompt
    no_speech: float | None = None  # <|nospeech|>'s probability there, once that row ran
