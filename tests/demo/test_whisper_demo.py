"""`spindle make-demo --whisper`: the checkpoint loads in transformers, and its tokenizer is Whisper's own
(openai-whisper's tiktoken encoding: the same ids for text and for every special token)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

TEXTS = ["Hello world!", " The quick brown fox, 1234 times.", "Ça va? 日本語のテキスト", "  spaces\n\nand lines"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("w") / "demo"
    cli = "import sys; from server.cli import main; sys.exit(main())"
    out = subprocess.run(
        [sys.executable, "-c", cli, "make-demo", "--whisper", str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(path)
    return path


def test_tokenizer_is_whispers(demo: Path) -> None:
    from whisper.tokenizer import get_encoding  # openai-whisper's own

    enc = get_encoding("multilingual", num_languages=99)
    tok = tokenizers.Tokenizer.from_file(str(demo / "tokenizer.json"))
    assert tok.get_vocab_size() == enc.n_vocab == 51865
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == enc.encode(text)
    for name, tid in enc._special_tokens.items():
        assert tok.token_to_id(name) == tid
    assert tok.decode([50258, 50259, 50359, 50363, 15947, 1002, 50257], skip_special_tokens=True) == "Hello world"


def test_transformers_loads_it(demo: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig, WhisperConfig

    hf = AutoTokenizer.from_pretrained(demo)
    assert hf.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>", "<|0.00|>"]
    ) == [50258, 50259, 50359, 50363, 50364]
    gen = GenerationConfig.from_pretrained(demo)
    assert gen.lang_to_id["<|fr|>"] == 50265 and gen.task_to_id == {"transcribe": 50359, "translate": 50358}
    cfg = WhisperConfig.from_pretrained(demo)
    assert (cfg.eos_token_id, cfg.decoder_start_token_id, cfg.vocab_size) == (50257, 50258, 51865)
