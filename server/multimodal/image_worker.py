"""The image worker process: `python -m server.multimodal.image_worker`, driven by server/render/worker_pool.py (one
worker, its own pool), so decoding and preprocessing load neither the API's event loop nor its GIL, and text
requests never queue behind an image.

Frames as server/render/render_worker.py speaks them. The first frame in is the config
{"preprocessor": {...}, "cache_bytes": int}; the worker answers [0, pid]. Then one request at a time:
["process", [encoded image bytes, ...], min_pixels | None, max_pixels | None]
-> [0, [[pixel bytes, shape, grid, hash, cache hit], ...]] | [1, message the client may see] | [2, internal error].
A speech model's worker (config {"audio_model": dir, ...}) answers ["audio", file bytes, max seconds] with
[0, {"duration", "windows": [{features, shape, hash, start, seconds}, ...]}] (server/multimodal/audio_decode.py).
The preprocessed result is cached (LRU, `cache_bytes` of pixel data; --mm-processor-cache-gb) by a hash of the
decoded RGB pixels plus the processor settings, so the same picture sent again (even re-encoded) skips the
processor. ["hang"] and ["exit"] exist for tests of the pool's kill-and-replace.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections import OrderedDict
from typing import Any

from server.render.child import INTERNAL_ERROR, OK, USER_ERROR, start_child

_Result = list[Any]  # [pixel bytes, shape, grid, hash]


class ProcessorCache:
    """Preprocessed images by input key, least recently used evicted beyond `max_bytes` of pixel data."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Result] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> _Result | None:
        out = self._entries.get(key)
        if out is not None:
            self._entries.move_to_end(key)
        return out

    def put(self, key: str, value: _Result) -> None:
        size = len(value[0])
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= len(old[0])


def _input_key(rgb: Any, settings: list[Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([list(rgb.size), settings], sort_keys=True).encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def process(
    processor: Any,
    settings: dict[str, Any],
    cache: ProcessorCache,
    blobs: list[bytes],
    min_pixels: int | None,
    max_pixels: int | None,
) -> list[list[Any]] | str:
    """Decode and preprocess; a str is the reason for a 400."""
    # numpy and PIL load after start_child's nice +10, so the threads they start (BLAS) inherit it
    from PIL import Image, UnidentifiedImageError

    from engine.multimodal.processing import image_hash, process_image

    out = []
    for k, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob)) as im:
                im.seek(0)  # an animation's first frame
                rgb = im.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            return f"image {k} could not be decoded ({type(e).__name__}); send PNG, JPEG, WebP or GIF"
        key = _input_key(rgb, [settings, min_pixels, max_pixels])
        got = cache.get(key)
        if got is not None:
            out.append([*got, True])
            continue
        pixels, grid = process_image(processor, rgb, min_pixels, max_pixels)
        result = [pixels.tobytes(), list(pixels.shape), grid, image_hash(pixels, grid)]
        cache.put(key, result)
        out.append([*result, False])
    return out


def main() -> None:
    receive, writer = start_child()
    config = receive()
    if config is None:
        return
    # after the nice +10: see `process`
    from engine.multimodal.processing import make_processor
    from server.multimodal import audio_decode

    settings = config.get("preprocessor")
    processor = make_processor(settings) if settings is not None else None
    extractor = audio_decode.make_extractor(config["audio_model"]) if config.get("audio_model") else None
    cache = ProcessorCache(int(config["cache_bytes"]))
    writer.send([OK, os.getpid()])
    while (request := receive()) is not None:
        op = request[0]
        try:
            if op == "process" and processor is not None and settings is not None:
                result = process(processor, settings, cache, request[1], request[2], request[3])
                reply = [USER_ERROR, result] if isinstance(result, str) else [OK, result]
            elif op == "audio" and extractor is not None:
                got = audio_decode.process(extractor, request[1], float(request[2]))
                reply = [USER_ERROR, got] if isinstance(got, str) else [OK, got]
            elif op == "hang":
                time.sleep(3600)
                reply = [OK, None]
            elif op == "exit":
                os._exit(3)
            else:
                reply = [INTERNAL_ERROR, f"unknown image worker op {op!r}"]
        except MemoryError:
            reply = [USER_ERROR, "the input is too large to preprocess here"]
        except Exception as e:  # noqa: BLE001 - report and stay alive for the next request
            reply = [INTERNAL_ERROR, f"{type(e).__name__}: {e}"]
        writer.send(reply)


if __name__ == "__main__":
    main()
