"""A JSON schema no answer of which fits max_tokens is a 400 naming the tokens needed
(server/structured/answer_budget.py): the vocabulary's bytes as the engine's tokenizer reads them, the 400 at,
just under and just over the bound, and what is never judged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import tokenizers

from engine.messages import StructuredOutputs
from engine.structured.answer_floor import min_answer_tokens
from engine.structured.llguidance_backend import load_tokenizer
from engine.structured.relaxed_schema import relax
from server.config import RequestCaps
from server.http.errors import APIError
from server.request.openai_protocol import ChatCompletionRequest
from server.structured import constraint as structured
from server.structured.answer_budget import check_answer_fits, token_bytes, vocabulary

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
SCHEMA = json.loads((CORPUS / "github-webhooks" / "workflow-run.json").read_text())
PARAM = "response_format.json_schema.schema"


def tokenizer(ckpt: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen(qwen2_ckpt: Path) -> tokenizers.Tokenizer:
    return tokenizer(qwen2_ckpt)


def floor_of(tok: tokenizers.Tokenizer, spec: str) -> int:
    vocab = vocabulary(tok)
    assert vocab is not None
    return min_answer_tokens(json.loads(spec), vocab)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_token_bytes_are_the_engines(arch: str, qwen2_ckpt: Path, llama_ckpt: Path) -> None:
    """Byte-level BPE (Qwen2) and byte fallback (Llama's SentencePiece): every token's bytes as llguidance, which
    the engine's grammar runs on, reads them."""
    ckpt = qwen2_ckpt if arch == "qwen2" else llama_ckpt
    tok = tokenizer(ckpt)
    mine = token_bytes(tok)
    assert mine is not None
    config = json.loads((ckpt / "config.json").read_text())
    ll = load_tokenizer(ckpt, config["vocab_size"], [config["eos_token_id"]])
    special = set(tok.get_added_tokens_decoder())
    ids = [i for i in range(min(len(mine), ll.vocab_size)) if i not in special]
    differ = [i for i in ids if mine[i] != bytes(ll.decode_bytes([i]))]
    assert all(bytes(ll.decode_bytes([i])) == b"" for i in differ) and len(differ) < 4  # 0xff: llguidance drops it


def test_another_kind_of_vocabulary_is_not_judged() -> None:
    word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert token_bytes(word) is None and vocabulary(word) is None
    assert token_bytes(object()) is None


@pytest.mark.anyio
async def test_at_just_under_and_over_the_floor(qwen: tokenizers.Tokenizer) -> None:
    so = StructuredOutputs("json", json.dumps(relax(SCHEMA, {"whitespace_flexible": False}).schema))
    floor = floor_of(qwen, so.spec)
    assert floor > 384
    await check_answer_fits(so, floor, "max_tokens", PARAM, qwen)
    await check_answer_fits(so, floor + 1, "max_tokens", PARAM, qwen)
    with pytest.raises(APIError) as e:
        await check_answer_fits(so, floor - 1, "max_completion_tokens", PARAM, qwen)
    assert e.value.status == 400 and e.value.param == "max_completion_tokens"
    assert f"at least {floor} tokens" in e.value.message and PARAM in e.value.message


@pytest.mark.anyio
async def test_what_is_never_judged(qwen: tokenizers.Tokenizer) -> None:
    spec = json.dumps(SCHEMA)
    await check_answer_fits(StructuredOutputs("json", spec), None, "max_tokens", PARAM, qwen)  # no max_tokens
    await check_answer_fits(StructuredOutputs("json", spec), 1, "max_tokens", PARAM, None)  # no tokenizer
    await check_answer_fits(StructuredOutputs("json", spec, whitespace_pattern=" ?"), 1, "max_tokens", PARAM, qwen)
    await check_answer_fits(StructuredOutputs("regex", "[a-z]{500}"), 1, "max_tokens", PARAM, qwen)
    await check_answer_fits(StructuredOutputs("json", "{not json"), 1, "max_tokens", PARAM, qwen)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


@pytest.mark.anyio
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_the_request_path_names_the_field_that_set_the_budget(qwen: tokenizers.Tokenizer, field: str) -> None:
    structured.clear_cache()
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    assert await structured.structured_outputs(chat(response_format=rf, **{field: 384}), RequestCaps()) is not None
    with pytest.raises(APIError) as e:
        await structured.structured_outputs(chat(response_format=rf, **{field: 384}), RequestCaps(), tokenizer=qwen)
    assert e.value.param == field and f"{field} is 384" in e.value.message
    found = await structured.structured_outputs(
        chat(response_format=rf, **{field: 4000}), RequestCaps(), tokenizer=qwen
    )
    assert found is not None
