"""server/multimodal/audio.py: a Whisper checkpoint's special tokens read from its files, the decoder prompt as
Whisper builds it, language names and codes; None for any other model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.http.errors import APIError
from server.multimodal.audio import speech_support
from tests.helpers.audio import demo_whisper


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_whisper(str(tmp_path_factory.mktemp("w")))


def test_special_tokens(ckpt: Path) -> None:
    s = speech_support(str(ckpt))
    assert s is not None and s.multilingual
    assert (s.sot, s.eot, s.no_timestamps, s.timestamp_begin, s.prev_sot) == (50258, 50257, 50363, 50364, 50361)
    assert len(s.lang_to_id) == 99 and s.lang_to_id["en"] == 50259 and s.code_of(50265) == "fr"
    assert s.seconds(50364 + 150) == pytest.approx(3.0)


def test_decoder_prompt(ckpt: Path) -> None:
    s = speech_support(str(ckpt))
    assert s is not None
    assert s.decoder_prompt("en", "transcribe", False, []) == [50258, 50259, 50359, 50363]
    assert s.decoder_prompt("fr", "translate", True, []) == [50258, 50265, 50358]
    long = list(range(500))
    got = s.decoder_prompt("en", "transcribe", False, long)
    assert got[0] == 50361 and got[1:224] == long[-223:] and got[224:] == [50258, 50259, 50359, 50363]


def test_language_names_and_codes(ckpt: Path) -> None:
    s = speech_support(str(ckpt))
    assert s is not None
    assert s.language_code("French") == "fr" and s.language_code(" EN ") == "en"
    with pytest.raises(APIError, match="ISO-639-1"):
        s.language_code("klingon")


def test_other_models(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert speech_support(str(tmp_path)) is None
    assert speech_support(str(tmp_path / "missing")) is None
