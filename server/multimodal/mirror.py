"""The API's mirror of the engine's vision-encoder cache: which image hashes the engine holds, so an image sent
again crosses the pipe as its hash only.

The engine (engine/multimodal/image_runner.py `EncoderCache`) keeps encoder outputs by hash, LRU within
ENCODER_CACHE_BYTES; the mirror keeps the same budget with each entry sized as the engine sizes it (the image's
tokens x hidden size x the model dtype's bytes). An entry is recorded only when its request was handed to the
engine (committed), never when a request failed before. The two can still drift (the engine inserts when the
encoder runs, not when the request arrives; a request aborted before its prefill never gets encoded; with
several engines each has its own cache), so the engine's miss is the safety net: a request sent by hash that the
engine no longer holds is refused with "ImageCacheMiss:", and AsyncLLM resends it with pixels, once, before
the client sees anything (server/request/async_llm.py).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.messages import ImageInput

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class EngineImageMirror:
    def __init__(self, max_bytes: int, hidden_size: int, model_dtype: str) -> None:
        self.max_bytes = max_bytes
        self.bytes_per_token = hidden_size * _DTYPE_BYTES.get(model_dtype.removeprefix("torch."), 2)
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def strip(self, inputs: list[ImageInput]) -> tuple[list[ImageInput], int]:
        """`inputs` with the pixels of images the engine holds left out, and how many were."""
        out, hits = [], 0
        for img in inputs:
            if img.data is not None and img.hash in self._entries:
                self._entries.move_to_end(img.hash)
                out.append(ImageInput(img.hash, img.offset, img.length, img.grid_thw, None, img.shape, img.dtype))
                hits += 1
            else:
                out.append(img)
        return out, hits

    def record(self, inputs: list[ImageInput]) -> None:
        """The request holding `inputs` was handed to the engine: it will hold their encoder outputs."""
        for img in inputs:
            if img.hash in self._entries:
                self._entries.move_to_end(img.hash)
                continue
            size = img.length * self.bytes_per_token
            self._entries[img.hash] = size
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            size = self._entries.pop(key, None)
            if size is not None:
                self._bytes -= size
