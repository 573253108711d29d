"""The image worker process (server/multimodal/image_worker.py via server/render/worker_pool.py): preprocessing runs in
another pid, a repeated picture hits the processor cache, a hung or dead worker is replaced and its request gets a
clear error."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from server.http.errors import APIError
from server.multimodal.images import call_image_worker, image_support, open_image_worker, process_images

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def data_url(seed: int, h: int, w: int, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image = Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8))
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


async def test_worker_process_cache_and_replacement(qwen2_vl_ckpt: Path) -> None:
    support = image_support(str(qwen2_vl_ckpt))
    assert support is not None
    async with open_image_worker(support, 64 << 20) as pool:
        (pid,) = pool.pids
        assert pid != os.getpid()
        (a,) = await process_images(support, [data_url(1, 60, 90)], (), None, pool)
        assert not a.cached and a.num_tokens > 0
        # the same pixels re-encoded (lossless WebP): the processor cache holds them, same result
        (b,) = await process_images(support, [data_url(1, 60, 90, "WEBP")], (), None, pool)
        assert b.cached and (b.hash, b.data) == (a.hash, a.data)
        (c,) = await process_images(support, [data_url(1, 60, 90)], (), {"max_pixels": 56 * 56}, pool)
        assert not c.cached and c.hash != a.hash  # other processor settings: another entry
        with pytest.raises(APIError, match="longer than 0.5 s") as hung:
            await call_image_worker(pool, ["hang"], timeout=0.5)
        assert hung.value.status == 500
        (again,) = await process_images(support, [data_url(1, 60, 90)], (), None, pool)  # a fresh worker
        assert again.hash == a.hash and pool.pids != [pid]
        pid2 = pool.pids[0]
        with pytest.raises(APIError, match="image worker failed") as died:
            await call_image_worker(pool, ["exit"])
        assert died.value.status == 500
        assert (await process_images(support, [data_url(1, 60, 90)], (), None, pool))[0].hash == a.hash
        assert pool.pids not in ([pid], [pid2])
