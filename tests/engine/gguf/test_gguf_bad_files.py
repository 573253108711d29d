"""Damaged and unsupported GGUF files fail at start-up with one line naming the problem (engine/gguf/header.py,
source.py), never a hang or a traceback."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.gguf.header import GGUFError, read_header
from engine.gguf.source import gguf_file_of, open_model, split_parts
from tests.engine.gguf.files import write_llama
from tests.engine.gguf.hostile import HOSTILE, hostile_file


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.gguf"
    write_llama(path)
    return path


def _damaged(src: Path, dst: Path, at: int, value: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at : at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def _one_line(e: pytest.ExceptionInfo[GGUFError]) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_a_good_file_opens(good: Path) -> None:
    model = open_model(good)
    assert model.architecture == "llama" and len(model.tensors()) == 20 and model.name == "good"


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a model" * 4)
    with pytest.raises(GGUFError) as e:
        open_model(path)
    assert "is not a GGUF file" in _one_line(e)


def test_a_file_not_named_gguf_without_the_magic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(GGUFError) as e:
        open_model(path)
    assert "not a GGUF file" in _one_line(e)


def test_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFError) as e:
        read_header(path)
    assert "empty" in _one_line(e)


@pytest.mark.parametrize("keep", [3, 10, 100, 1000])
def test_truncated_in_the_header(good: Path, tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:keep])
    with pytest.raises(GGUFError) as e:
        read_header(cut)
    line = _one_line(e)
    assert "past the end of the file" in line or "not a GGUF file" in line


def test_truncated_in_the_tensor_data(good: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(GGUFError) as e:
        read_header(cut)
    line = _one_line(e)
    assert "runs past the end of the file" in line and "tensor 'blk.1." in line


def test_a_metadata_length_past_the_end(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    key = data.index(b"general.architecture")  # then the value type (u32 8: string) and the value's length
    at = key + len(b"general.architecture") + 4
    assert struct.unpack_from("<Q", data, at)[0] == len(b"llama")
    bad = _damaged(good, tmp_path / "bad.gguf", at, struct.pack("<Q", 1 << 40))
    with pytest.raises(GGUFError) as e:
        read_header(bad)
    assert "metadata 'general.architecture' runs past the end of the file" in _one_line(e)


def test_a_huge_array_count_fails_at_once(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    key = data.index(b"tokenizer.ggml.tokens")
    at = key + len(b"tokenizer.ggml.tokens") + 4 + 4  # value type (array), item type (string), then the count
    bad = _damaged(good, tmp_path / "bad.gguf", at, struct.pack("<Q", 400_000))  # within the limits: past the end
    with pytest.raises(GGUFError) as e:
        read_header(bad)
    assert "metadata 'tokenizer.ggml.tokens' (400000 items) runs past the end" in _one_line(e)


def test_a_tensor_offset_past_the_end(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    name = data.index(b"blk.0.attn_q.weight")  # n_dims u32, 2 dims u64, type u32, then the offset u64
    at = name + len(b"blk.0.attn_q.weight") + 4 + 16 + 4
    bad = _damaged(good, tmp_path / "bad.gguf", at, struct.pack("<Q", len(data)))
    with pytest.raises(GGUFError) as e:
        read_header(bad)
    assert "tensor 'blk.0.attn_q.weight'" in (line := _one_line(e)) and "past the end" in line


def test_an_unknown_tensor_type_number(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    name = data.index(b"blk.0.attn_q.weight")
    bad = _damaged(good, tmp_path / "bad.gguf", name + len(b"blk.0.attn_q.weight") + 4 + 16, struct.pack("<I", 99))
    with pytest.raises(GGUFError) as e:
        read_header(bad)
    assert "tensor 'blk.0.attn_q.weight' has an unknown type 99" in _one_line(e)


def test_an_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as e:
        open_model(path)
    line = _one_line(e)
    assert "tensor 'blk.0.attn_q.weight' has type IQ4_NL, which is not supported" in line and "Q4_K" in line


def test_an_unknown_architecture_names_the_supported(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    write_llama(path, arch="bert")
    with pytest.raises(GGUFError) as e:
        open_model(path)
    line = _one_line(e)
    assert "architecture 'bert' is not supported" in line
    assert "llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3" in line


def test_a_folder_holding_one_file_and_split_parts(tmp_path: Path) -> None:
    write_llama(tmp_path / "one.gguf")
    assert gguf_file_of(tmp_path) == tmp_path / "one.gguf"
    split = tmp_path / "split"
    split.mkdir()
    w = gguf.GGUFWriter(str(split / "m.gguf"), "llama", split_max_tensors=8)
    for i in range(20):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(64, i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(split.glob("*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf_file_of(split) == parts[0]
    assert split_parts(parts[1]) == tuple(parts)
    model = open_model(parts[0])
    assert len(model.tensors()) == 20 and model.name == "m"
    parts[2].unlink()
    with pytest.raises(GGUFError) as e:
        open_model(parts[0])
    assert "m-00003-of-00003.gguf missing" in _one_line(e)


def test_a_folder_of_two_models_asks_which(tmp_path: Path) -> None:
    write_llama(tmp_path / "a.gguf")
    write_llama(tmp_path / "b.gguf")
    with pytest.raises(GGUFError) as e:
        gguf_file_of(tmp_path)
    assert "several GGUF models (a.gguf, b.gguf)" in _one_line(e)


@pytest.mark.parametrize("what", HOSTILE)
def test_a_hostile_file_ends_in_one_line_naming_the_limit(what: str, tmp_path: Path) -> None:
    path, words = hostile_file(tmp_path, what)
    with pytest.raises(GGUFError) as e:
        read_header(path)
    line = _one_line(e)
    assert line.startswith(str(path)) and words in line, line
