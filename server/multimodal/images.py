"""Images in chat requests (a Qwen2-VL checkpoint): `image_url` parts -> processed pixels + placeholder tokens.

`data:` URLs (base64 PNG, JPEG, WebP, GIF: first frame) always; `http(s)` URLs only for hosts in
`--allowed-media-domains` (none by default), with a byte cap, a timeout and no redirect off the list; any other
scheme is a 400. Decoding (PIL) and preprocessing (transformers' Qwen2-VL image processor) run in the image
worker process (server/multimodal/image_worker.py), one image request at a time, not in the render workers, so text
requests never queue behind an image. The chat template sees `{"type": "image"}` parts and renders `<|image_pad|>`
once per image; `expand` then repeats it grid t*h*w / merge**2 times, as transformers' Qwen2VLProcessor does, so
`usage.prompt_tokens`, `max_model_len` and admission all count the image's tokens.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit

import anyio

from engine.messages import ImageInput
from engine.multimodal.processing import expand_placeholders, read_preprocessor_config
from server.config import ServerConfig
from server.http import unavailable
from server.http.errors import APIError, bad_request
from server.render.worker_pool import PoolOverloaded, WorkerCrashed, WorkerPool, WorkerTimeout, WorkerUserError

MAX_IMAGE_BYTES = 20 << 20  # one encoded image, from a data: URL or a fetch
FETCH_TIMEOUT = 10.0  # seconds for one http(s) image
MAX_REDIRECTS = 3
_ARCHITECTURE = "Qwen2VLForConditionalGeneration"


class ImagePool(Protocol):
    """The image worker (a WorkerPool of one running server/multimodal/image_worker.py)."""

    async def call(self, request: list[Any], timeout: float | None = None) -> Any: ...


class _CacheHits(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _ImageCacheMetrics(Protocol):
    @property
    def mm_processor_cache_hits(self) -> _CacheHits: ...


class _MetricsHolder(Protocol):
    """The AsyncLLM, as far as image preparation counts its cache hits."""

    @property
    def metrics(self) -> _ImageCacheMetrics | None: ...


class ImageContext(Protocol):
    """What `prepare_images` needs of the routes' AppState."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def mm_pool(self) -> ImagePool | None: ...
    @property
    def llm(self) -> _MetricsHolder | None: ...


@dataclass(frozen=True)
class ImageSupport:
    """What the checkpoint's image processor needs; min/max pixels are the server's bounds for requests."""

    preprocessor: dict[str, Any]
    pad_id: int
    merge: int
    min_pixels: int
    max_pixels: int
    hidden_size: int  # the language model's: one image token's encoder output is this long


@functools.cache
def image_support(model_dir: str) -> ImageSupport | None:
    """The checkpoint's image settings, or None for a text-only model."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if _ARCHITECTURE not in (cfg.get("architectures") or []) or "vision_config" not in cfg:
        return None
    pre = read_preprocessor_config(model_dir)
    merge = int(pre.get("merge_size", cfg["vision_config"].get("spatial_merge_size", 2)))
    hidden = int((cfg.get("text_config") or {}).get("hidden_size", cfg.get("hidden_size", 0)))
    return ImageSupport(
        pre, int(cfg.get("image_token_id", 151655)), merge, int(pre["min_pixels"]), int(pre["max_pixels"]), hidden
    )


def has_images(messages: list[Any] | None) -> bool:
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in m["content"])
        for m in messages or ()
    )


def split_images(messages: list[Any], limit: int) -> tuple[list[Any], list[str]]:
    """Messages with each image part replaced by {"type": "image"} (the template's marker), and the URLs."""
    urls: list[str] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str):
                    raise bad_request(
                        f'messages[{i}] has an image part without "image_url": {{"url": "..."}}', "messages"
                    )
                urls.append(url)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    if len(urls) > limit:
        raise bad_request(
            f"at most {limit} images per request are accepted here (--limit-mm-per-prompt), got {len(urls)}", "messages"
        )
    return out, urls


def pixel_bounds(support: ImageSupport, kwargs: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """mm_processor_kwargs: min_pixels / max_pixels within the server's bounds; anything else is a 400."""
    if not kwargs:
        return None, None
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
    if unknown:
        raise bad_request(
            f"mm_processor_kwargs accepts min_pixels and max_pixels only, not {', '.join(unknown)}",
            "mm_processor_kwargs",
        )
    got: list[int | None] = []
    for name in ("min_pixels", "max_pixels"):
        value = kwargs.get(name)
        if value is not None and (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not support.min_pixels <= value <= support.max_pixels
        ):
            raise bad_request(
                f"mm_processor_kwargs.{name} must be an integer in [{support.min_pixels}, "
                f"{support.max_pixels}], got {value!r}",
                "mm_processor_kwargs",
            )
        got.append(value)
    lo, hi = got
    if lo is not None and hi is not None and lo > hi:
        raise bad_request("mm_processor_kwargs.min_pixels exceeds max_pixels", "mm_processor_kwargs")
    return lo, hi


def decode_data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad_request("an image data: URL must look like data:image/png;base64,<data>", "messages")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_request(f"an image is larger than {MAX_IMAGE_BYTES} bytes", "messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("an image data: URL holds invalid base64", "messages") from None


async def fetch_image(url: str, allowed: tuple[str, ...]) -> bytes:
    """GET an http(s) image from an allowed host: capped bytes, a timeout, redirects only to allowed hosts."""
    import httpx  # only a server that fetches images (--allowed-media-domains) pays its ~0.3 s import

    async with httpx.AsyncClient(follow_redirects=False, timeout=FETCH_TIMEOUT) as client:
        for _ in range(MAX_REDIRECTS + 1):
            host = (urlsplit(url).hostname or "").lower()
            if host not in allowed:
                raise bad_request(f"image host {host!r} is not in --allowed-media-domains", "messages")
            try:
                with anyio.fail_after(FETCH_TIMEOUT):
                    async with client.stream("GET", url) as resp:
                        if resp.is_redirect:
                            url = urljoin(url, resp.headers.get("location", ""))
                            continue
                        if resp.status_code != 200:
                            raise bad_request(f"fetching the image gave HTTP {resp.status_code}", "messages")
                        data = bytearray()
                        async for chunk in resp.aiter_bytes():
                            data += chunk
                            if len(data) > MAX_IMAGE_BYTES:
                                raise bad_request(f"an image is larger than {MAX_IMAGE_BYTES} bytes", "messages")
                        return bytes(data)
            except (httpx.HTTPError, TimeoutError) as e:
                raise bad_request(f"the image could not be fetched ({type(e).__name__})", "messages") from None
    raise bad_request("the image URL redirects too often", "messages")


async def load_image(url: str, allowed: tuple[str, ...]) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url)
    if scheme in ("http", "https"):
        if not allowed:
            raise bad_request(
                "image URLs are not fetched by this server (no --allowed-media-domains); send the image as a data: URL",
                "messages",
            )
        return await fetch_image(url, allowed)
    raise bad_request(f"image URLs with scheme {scheme or '(none)'!r} are refused; send a data: URL", "messages")


MM_TIMEOUT = 60.0  # seconds one request's images may take in the image worker before it is killed


@asynccontextmanager
async def open_image_worker(support: ImageSupport, cache_bytes: int) -> AsyncIterator[WorkerPool]:
    """The image worker (server/multimodal/image_worker.py): one process, killed and replaced as a render worker is."""
    config = {"preprocessor": support.preprocessor, "cache_bytes": cache_bytes}
    async with WorkerPool.open(1, config, max_waiting=64, module="server.multimodal.image_worker") as pool:
        yield pool


@dataclass
class ProcessedImage:
    data: bytes
    shape: list[int]
    grid: list[int]
    hash: str
    num_tokens: int
    cached: bool = False  # the image worker's processor cache held it


async def call_image_worker(pool: ImagePool | None, request: list[Any], timeout: float = MM_TIMEOUT) -> Any:
    """One request to the image worker; its failures as the client's error (400 for a bad image, 500 when the
    worker hung past `timeout` or died: it is killed and replaced, the next request gets a fresh one)."""
    if pool is None:
        raise unavailable.unavailable("The image worker is not running; retry in a moment.")
    try:
        return await pool.call(request, timeout=timeout)
    except WorkerUserError as e:
        raise bad_request(str(e), "messages") from None
    except WorkerTimeout:
        raise APIError(
            f"preprocessing the images took longer than {timeout:g} s; the image worker was restarted", status=500
        ) from None
    except WorkerCrashed as e:
        raise APIError(
            f"the image worker failed ({e}); it is being restarted, retry the request", status=500, retry_after=1
        ) from None
    except PoolOverloaded as e:
        raise unavailable.overloaded(str(e)) from None


async def process_images(
    support: ImageSupport,
    urls: list[str],
    allowed: tuple[str, ...],
    kwargs: dict[str, Any] | None,
    pool: ImagePool | None,
    timeout: float = MM_TIMEOUT,
) -> list[ProcessedImage]:
    """Load, decode and preprocess a request's images in the image worker process.

    Not anyio.to_process: its child re-runs the parent's __main__ as __mp_main__ (as multiprocessing's spawn
    does), and server/__main__.py has no `if __name__ == "__main__"` guard, so under `python -m server` the
    child started a second server instead of answering: the request hung.
    """
    lo, hi = pixel_bounds(support, kwargs)
    blobs = [await load_image(u, allowed) for u in urls]
    result = await call_image_worker(pool, ["process", blobs, lo, hi], timeout)
    m2 = support.merge**2
    return [ProcessedImage(d, s, g, h, g[0] * g[1] * g[2] // m2, bool(c)) for d, s, g, h, c in result]


async def prepare_images(
    state: ImageContext, messages: list[Any], mm_processor_kwargs: dict[str, Any] | None
) -> tuple[list[ProcessedImage], list[Any]]:
    """A request's images, processed in the image worker, and its messages with image parts as the template's
    markers ({"type": "image"}). `state`: the routes' AppState. 400 for a text-only model."""
    config = state.config
    support = image_support(config.model.model_path)
    if support is None:
        raise no_images_error()
    limit = int(config.media.limit_mm_per_prompt.get("image", 4))
    messages, urls = split_images(messages, limit)
    images = await process_images(support, urls, config.media.allowed_media_domains, mm_processor_kwargs, state.mm_pool)
    metrics = state.llm.metrics if state.llm is not None else None
    hits = sum(im.cached for im in images)
    if metrics is not None and hits:
        metrics.mm_processor_cache_hits.inc(hits)
    return images, messages


def expand(ids: list[int], images: list[ProcessedImage], pad_id: int) -> tuple[list[int], list[ImageInput]]:
    """The rendered prompt's one pad token per image -> the image's token count; the engine's image inputs."""
    try:
        out, offsets = expand_placeholders(ids, [im.num_tokens for im in images], pad_id)
    except ValueError as e:
        raise bad_request(f"{e}; the chat template must render one <|image_pad|> per image", "messages") from None
    return out, [
        ImageInput(im.hash, off, im.num_tokens, im.grid, im.data, im.shape, "float32")
        for im, off in zip(images, offsets)
    ]


def expand_for_model(
    ids: list[int], images: list[ProcessedImage], model_dir: str
) -> tuple[list[int], list[ImageInput]]:
    """`expand` with the model's image pad token (a text-only model: the 400 `prepare_images` gives)."""
    support = image_support(model_dir)
    if support is None:
        raise no_images_error()
    return expand(ids, images, support.pad_id)


def no_images_error() -> APIError:
    return bad_request("this model takes no images; send text content only", "messages")
