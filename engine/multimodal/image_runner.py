"""Images inside the engine: per-request image state, M-RoPE positions, the vision-encoder output cache.

A request's images arrive as `ImageInput`s (engine/messages.py): pixel values (bytes + shape + dtype, as the
API's Qwen2-VL image processor made them), the grid (t, h, w) in patches, the content hash, and where the
image's placeholder tokens sit in the prompt. `SeqImages` (on `Sequence.mm`; engine/types/image_state.py) holds
them with the prompt's M-RoPE positions and the position delta later tokens use. `ImageRunner` (one per ModelRunner of a
vision
model) splices the encoder's output over the placeholder rows of each step; the encoder runs once per image
content (`EncoderCache`, by hash), so chunked prefill cutting through an image, preemption and a second request
with the same image reuse it. Prefix-cache keys of blocks holding image tokens carry the image hash and
offset (`SeqImages.block_extra`), so different images behind the same text never share KV blocks.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.messages import IMAGE_CACHE_MISS, ImageInput
from engine.models.qwen2_vl import Qwen2VLCausalLM, mrope_positions
from engine.multimodal.processing import ENCODER_CACHE_BYTES
from engine.types.image_state import Image, SeqImages
from engine.types.sequence import ScheduledSeq

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ImageCacheMiss(ValueError):
    """An image sent by hash only (its pixels were sent before) is no longer in the engine's cache.

    The request's error text starts with "ImageCacheMiss:" (IMAGE_CACHE_MISS): the API resends it with pixels."""


def decode_pixels(img: ImageInput) -> torch.Tensor:
    dtype = _DTYPES.get(img.dtype)
    if dtype is None:
        raise ValueError(f"image pixel dtype {img.dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    n = 1
    for d in img.shape:
        n *= d
    if img.data is None or len(img.data) != n * dtype.itemsize:
        raise ValueError(
            f"image pixel data holds {len(img.data or b'')} bytes, shape {img.shape} needs {n * dtype.itemsize}"
        )
    return torch.frombuffer(bytearray(img.data), dtype=dtype).reshape(img.shape)


class EncoderCache:
    """Vision-encoder outputs by image hash, least recently used evicted beyond `max_bytes`."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        out = self._entries.get(key)
        if out is not None:
            self._entries.move_to_end(key)
        return out

    def put(self, key: str, value: torch.Tensor) -> None:
        if key in self._entries:
            return
        self._entries[key] = value
        self._bytes += value.numel() * value.element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def __contains__(self, key: str) -> bool:
        return key in self._entries


class ImageRunner:
    """The vision half of a step: M-RoPE positions for the flat batch and the input embeddings with images."""

    def __init__(self, model: Qwen2VLCausalLM, cache_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.model = model
        self.cache = EncoderCache(cache_bytes)
        self.encoder_runs = 0  # images encoded (tests: once per content)
        self.cache_hits = 0  # images whose encoder output came from the cache (EngineStats.image_cache_hits)
        vision = model.vl.vision
        self.merge = vision.spatial_merge_size
        self.patch_dim = vision.patch_dim
        self.image_token_id = model.vl.image_token_id

    def seq_images(self, inputs: list[ImageInput], prompt: list[int]) -> SeqImages:
        """Check a request's images against its prompt; ValueError (the request is refused) if they disagree."""
        images: list[Image] = []
        end = 0
        for k, img in enumerate(sorted(inputs, key=lambda i: i.offset)):
            if len(img.grid_thw) != 3 or min(img.grid_thw) < 1:
                raise ValueError(f"image {k}: grid_thw must be three positive numbers, not {img.grid_thw}")
            t, h, w = img.grid_thw
            if h % self.merge or w % self.merge:
                raise ValueError(f"image {k}: grid {img.grid_thw} is not a multiple of the merge size {self.merge}")
            length = t * h * w // self.merge**2
            if img.length != length or img.offset < end or img.offset + length > len(prompt):
                raise ValueError(
                    f"image {k}: {img.length} placeholder tokens at {img.offset} do not fit the prompt "
                    f"or its grid {img.grid_thw} ({length} tokens)"
                )
            if any(tok != self.image_token_id for tok in prompt[img.offset : img.offset + length]):
                raise ValueError(
                    f"image {k}: the prompt's tokens at {img.offset}..{img.offset + length - 1} are "
                    f"not all the image token {self.image_token_id}"
                )
            cached = None
            if img.data is None:
                cached = self.cache.get(img.hash)
                if cached is None:
                    raise ImageCacheMiss(
                        f"{IMAGE_CACHE_MISS} image {img.hash} was sent by hash but is not in the engine's cache"
                    )
                self.cache_hits += 1
                pixels = None
            else:
                pixels = decode_pixels(img)
                if tuple(pixels.shape) != (t * h * w, self.patch_dim):
                    raise ValueError(
                        f"image {k}: pixel values {tuple(pixels.shape)} do not match grid "
                        f"{img.grid_thw} ({t * h * w} x {self.patch_dim})"
                    )
            images.append(
                Image(img.hash, img.offset, length, (t, h, w), pixels, None if img.data is not None else cached)
            )
            end = img.offset + length
        axes, delta = mrope_positions(len(prompt), [(i.offset, i.length, i.grid) for i in images], self.merge)
        return SeqImages(images, torch.tensor(axes, dtype=torch.long), delta)

    def encoded(self, img: Image) -> torch.Tensor:
        """The image's encoder output: held by its request, else cached by hash, else computed (and cached)."""
        out = img.encoded
        if out is None:
            out = self.cache.get(img.hash)
            if out is not None:
                self.cache_hits += 1
        if out is None:
            assert img.pixels is not None, "an image sent by hash holds its encoder output from the start"
            out = self.model.visual.encode(img.pixels, img.grid)
            self.encoder_runs += 1
            self.cache.put(img.hash, out)
        img.encoded, img.pixels = out, None  # the pixels are not needed again
        return out

    def step_inputs(self, batch: list[ScheduledSeq], input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] and input embeddings [T, hidden] of the flat batch (rows in batch order)."""
        parts: list[torch.Tensor] = []
        splices: list[tuple[int, torch.Tensor]] = []
        row = 0
        for s in batch:
            start, n, mm = s.start, s.num_new_tokens, s.seq.mm
            if mm is None:
                parts.append(torch.arange(start, start + n, dtype=torch.long).expand(3, -1))
            else:
                parts.append(mm.positions(start, n))
                for img in mm.images:
                    lo, hi = max(start, img.offset), min(start + n, img.offset + img.length)
                    if lo < hi:
                        splices.append((row + lo - start, self.encoded(img)[lo - img.offset : hi - img.offset]))
            row += n
        device = self.model.device
        positions = torch.cat(parts, dim=1).to(device)
        embeds = self.model.embed_tokens(input_ids)
        for r, e in splices:
            embeds[r : r + e.shape[0]] = e.to(embeds.dtype)
        return positions, embeds
