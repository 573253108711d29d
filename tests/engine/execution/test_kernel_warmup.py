"""The CPU kernels are made ready while the engine starts, before it could say Ready: the kernel library is loaded
(built where its sources changed) even for a model whose first kernel call is inside a step, and a GGUF model's
projection kernels are timed; the first request's steps (a prefill and one-row decodes) build and time nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest

from engine.cache_root import cache_root
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.cpu_kernels import build, chooser
from engine.layers.quant_linear import unchosen
from engine.messages import AddRequest, SamplingParams
from engine.models.loader import resolve_model
from tests.engine.gguf.files import write_llama


@pytest.fixture
def q4_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    built = cache_root() / "cpu_kernels"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_kernels").symlink_to(built, target_is_directory=True)  # the built library, shared
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))  # no kernel choice cached yet
    monkeypatch.setenv("SPINDLE_GGUF_DEQUANTIZE", "0")  # blocks kept however small the tensors
    monkeypatch.delenv("SPINDLE_KERNEL_CHOICE", raising=False)
    path = tmp_path / "small-q4.gguf"
    write_llama(path, qtype=gguf.GGMLQuantizationType.Q4_0)
    chooser.forget()
    return resolve_model(str(path))


def serve_one(core: EngineCore) -> list[int]:
    core.add_request(AddRequest("r", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0), 0.0))
    tokens: list[int] = []
    while core.has_work:
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


def test_kernels_are_timed_at_start_not_by_the_first_request(q4_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine")
    core = EngineCore(EngineConfig(model=str(q4_folder), dtype="float32", num_blocks=32, block_size=16))
    at_start = chooser.measured()
    assert at_start, "no kernel was timed at start-up"
    assert not unchosen(core.runner.dtype)
    assert any(r.getMessage().startswith("timing kernels: done") for r in caplog.records)
    assert len(serve_one(core)) == 4
    assert chooser.measured() == at_start  # the first request's prefill and decodes timed nothing


def test_the_kernel_library_is_loaded_before_the_first_step(qwen2_ckpt: Path) -> None:
    """A float32 model calls its first kernel in the sampler: the library (a compile when its sources changed)
    must not wait for the first request."""
    build.load.cache_clear()  # as in a fresh engine process
    core = EngineCore(EngineConfig(model=str(qwen2_ckpt), dtype="float32", num_blocks=32, block_size=16))
    assert build.load.cache_info().currsize == 1  # loaded (or found off) during start-up
    loads = build.load.cache_info().misses
    assert len(serve_one(core)) == 4
    assert build.load.cache_info().misses == loads
