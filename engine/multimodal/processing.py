"""Qwen2-VL image preprocessing shared by the API's image worker and the tests: PIL image -> ImageInput pieces.

Uses transformers' `Qwen2VLImageProcessorPil` (PIL/NumPy, no torchvision), built from the checkpoint's
preprocessor_config.json with no hub access. Placeholders are expanded here, as Qwen2VLProcessor does:
tokens per image = grid t*h*w // merge_size**2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

IMAGE_PAD_ID = 151655
# Vision-encoder outputs the engine keeps by image hash (LRU, bytes); the API's mirror of that cache
# (server/multimodal/mirror.py) assumes the same budget, so it sends by hash only what the engine likely holds.
ENCODER_CACHE_BYTES = 256 << 20
_PROCESSOR_KEYS = (
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "min_pixels",
    "max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)


def read_preprocessor_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "preprocessor_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    out = {k: data[k] for k in _PROCESSOR_KEYS if k in data}
    size = data.get("size") or {}
    out.setdefault("min_pixels", size.get("shortest_edge", 56 * 56))
    out.setdefault("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    return out


def make_processor(config: dict[str, Any]) -> Any:
    # why late: transformers is heavy; the API server's image workers load it, the engine never does
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**config)


def process_image(
    processor: Any, image: Any, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[np.ndarray, list[int]]:
    """One PIL image -> (pixel_values float32 [patches, patch_dim], grid [t, h, w])."""
    kwargs: dict[str, Any] = {}
    if min_pixels is not None or max_pixels is not None:
        size = {"shortest_edge": processor.size["shortest_edge"], "longest_edge": processor.size["longest_edge"]}
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        kwargs["size"] = size
    import numpy as np  # why late: only the image workers process images; the API process imports this module too

    out = processor(images=[image], return_tensors="np", **kwargs)
    pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    grid = [int(x) for x in out["image_grid_thw"][0]]
    return pixels, grid


def image_hash(pixels: np.ndarray, grid: list[int]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([grid, list(pixels.shape), str(pixels.dtype)]).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()[:32]


def num_image_tokens(grid: list[int], merge: int = 2) -> int:
    return grid[0] * grid[1] * grid[2] // merge**2


def expand_placeholders(ids: list[int], counts: list[int], pad_id: int = IMAGE_PAD_ID) -> tuple[list[int], list[int]]:
    """Each of the prompt's `pad_id` tokens (one per image, in order) -> counts[i] copies; returns the ids and
    each image's offset. ValueError when the prompt's placeholders and the images disagree in number."""
    out: list[int] = []
    offsets: list[int] = []
    k = 0
    for t in ids:
        if t == pad_id:
            if k >= len(counts):
                raise ValueError("the prompt holds more image placeholders than images were sent")
            offsets.append(len(out))
            out.extend([pad_id] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise ValueError(f"the prompt holds {k} image placeholders for {len(counts)} images")
    return out, offsets
