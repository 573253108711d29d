"""Images in chat requests (a Qwen2-VL checkpoint): `image_url` parts -> processed pixels + placeholder tokens.

`data:` URLs (base64 PNG, JPEG, WebP, GIF: first frame) always; `http(s)` URLs only for hosts in
`--allowed-media-domains` (none by default), with a byte cap, a timeout and no redirect off the list; any other
scheme is a 400. Decoding (PIL) and preprocessing (transformers' Qwen2-VL image processor) run off the event
loop, one at a time, not in the render workers, so text requests never queue behind an image there. The chat template sees `{"type": "image"}` parts and renders `<|image_pad|>` once per image;
`expand` then repeats it grid t*h*w / merge**2 times, as transformers' Qwen2VLProcessor does, so
`usage.prompt_tokens`, `max_model_len` and admission all count the image's tokens.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import anyio
import anyio.to_thread

from engine.messages import ImageInput
from server.http.errors import APIError, bad_request

MAX_IMAGE_BYTES = 20 << 20  # one encoded image, from a data: URL or a fetch
FETCH_TIMEOUT = 10.0  # seconds for one http(s) image
MAX_REDIRECTS = 3
_ARCHITECTURE = "Qwen2VLForConditionalGeneration"


@dataclass(frozen=True)
class ImageSupport:
    """What the checkpoint's image processor needs; min/max pixels are the server's bounds for requests."""

    preprocessor: dict[str, Any]
    pad_id: int
    merge: int
    min_pixels: int
    max_pixels: int


@functools.cache
def image_support(model_dir: str) -> ImageSupport | None:
    """The checkpoint's image settings, or None for a text-only model."""
    from engine.multimodal.processing import read_preprocessor_config

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if _ARCHITECTURE not in (cfg.get("architectures") or []) or "vision_config" not in cfg:
        return None
    pre = read_preprocessor_config(model_dir)
    merge = int(pre.get("merge_size", cfg["vision_config"].get("spatial_merge_size", 2)))
    return ImageSupport(pre, int(cfg.get("image_token_id", 151655)), merge, int(pre["min_pixels"]),
                        int(pre["max_pixels"]))


def has_images(messages: list[Any] | None) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in m["content"])
               for m in messages or ())


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
                    raise bad_request(f'messages[{i}] has an image part without "image_url": {{"url": "..."}}',
                                      "messages")
                urls.append(url)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    if len(urls) > limit:
        raise bad_request(f"at most {limit} images per request are accepted here (--limit-mm-per-prompt), got "
                          f"{len(urls)}", "messages")
    return out, urls


def pixel_bounds(support: ImageSupport, kwargs: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """mm_processor_kwargs: min_pixels / max_pixels within the server's bounds; anything else is a 400."""
    if not kwargs:
        return None, None
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
    if unknown:
        raise bad_request(f"mm_processor_kwargs accepts min_pixels and max_pixels only, not {', '.join(unknown)}",
                          "mm_processor_kwargs")
    got: list[int | None] = []
    for name in ("min_pixels", "max_pixels"):
        value = kwargs.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not support.min_pixels <= value <= support.max_pixels):
            raise bad_request(f"mm_processor_kwargs.{name} must be an integer in [{support.min_pixels}, "
                              f"{support.max_pixels}], got {value!r}", "mm_processor_kwargs")
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
    import httpx

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
            raise bad_request("image URLs are not fetched by this server (no --allowed-media-domains); send the "
                              "image as a data: URL", "messages")
        return await fetch_image(url, allowed)
    raise bad_request(f"image URLs with scheme {scheme or '(none)'!r} are refused; send a data: URL", "messages")


_processor: Any = None


def _process(preprocessor: dict[str, Any], blobs: list[bytes], min_pixels: int | None, max_pixels: int | None
             ) -> list[tuple[bytes, list[int], list[int], str]] | str:
    """In the image worker process: decode and preprocess; a str is the reason for a 400."""
    global _processor
    from PIL import Image, UnidentifiedImageError

    from engine.multimodal.processing import image_hash, make_processor, process_image

    if _processor is None or _processor[0] != preprocessor:
        _processor = (preprocessor, make_processor(preprocessor))
    out = []
    for k, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob)) as im:
                im.seek(0)  # an animation's first frame
                rgb = im.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            return f"image {k} could not be decoded ({type(e).__name__}); send PNG, JPEG, WebP or GIF"
        pixels, grid = process_image(_processor[1], rgb, min_pixels, max_pixels)
        out.append((pixels.tobytes(), list(pixels.shape), grid, image_hash(pixels, grid)))
    return out


_limiter: anyio.CapacityLimiter | None = None


@dataclass
class ProcessedImage:
    data: bytes
    shape: list[int]
    grid: list[int]
    hash: str
    num_tokens: int


async def process_images(support: ImageSupport, urls: list[str], allowed: tuple[str, ...],
                         kwargs: dict[str, Any] | None) -> list[ProcessedImage]:
    global _limiter
    lo, hi = pixel_bounds(support, kwargs)
    blobs = [await load_image(u, allowed) for u in urls]
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(1)  # one image process: images wait for each other, never for text
    # TODO(issue 16): a worker process of its own; anyio.to_process hung under `python -m server` (not debugged),
    # so a single thread for now: PIL and NumPy release the GIL for most of the work
    result = await anyio.to_thread.run_sync(_process, support.preprocessor, blobs, lo, hi, limiter=_limiter)
    if isinstance(result, str):
        raise bad_request(result, "messages")
    m2 = support.merge ** 2
    return [ProcessedImage(d, s, g, h, g[0] * g[1] * g[2] // m2) for d, s, g, h in result]


def expand(ids: list[int], images: list[ProcessedImage], pad_id: int) -> tuple[list[int], list[ImageInput]]:
    """The rendered prompt's one pad token per image -> the image's token count; the engine's image inputs."""
    from engine.multimodal.processing import expand_placeholders

    try:
        out, offsets = expand_placeholders(ids, [im.num_tokens for im in images], pad_id)
    except ValueError as e:
        raise bad_request(f"{e}; the chat template must render one <|image_pad|> per image", "messages") from None
    return out, [ImageInput(im.hash, off, im.num_tokens, im.grid, im.data, im.shape, "float32")
                 for im, off in zip(images, offsets)]


def no_images_error() -> APIError:
    return bad_request("this model takes no images; send text content only", "messages")
