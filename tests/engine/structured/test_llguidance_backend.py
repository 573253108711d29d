"""The llguidance backend: padded logits rows are never allowed; matchers are independent copies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.messages import SamplingParams, StructuredOutputs
from engine.structured.backend import allocate_bitmask
from engine.structured.grammar import GrammarError
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.triton_kernels.token_bitmask_ref import unpack_bitmask
from tests.conftest import TINY
from tests.engine.structured.conftest import make_core, run
from tests.helpers.engine import tokens

PADDED_VOCAB = 32_070  # a Llama tokenizer's 32,000 tokens in a padded head; not a multiple of 32


@pytest.fixture(scope="module")
def padded_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from demo.checkpoints import write_random_checkpoint

    return write_random_checkpoint(
        tmp_path_factory.mktemp("padded") / "llama",
        "llama",
        **TINY,
        vocab_size=PADDED_VOCAB,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
    )


@pytest.fixture(scope="module")
def backend(padded_ckpt: Path) -> LLGuidanceBackend:
    return LLGuidanceBackend.from_checkpoint(padded_ckpt, PADDED_VOCAB, [2])


def test_padded_rows_are_never_allowed(backend: LLGuidanceBackend) -> None:
    assert backend.vocab_size == PADDED_VOCAB
    grammars = [
        backend.compile(StructuredOutputs(k, s))
        for k, s in [("json_object", ""), ("regex", ".*"), ("grammar", "start: /(.|\\n)*/")]
    ]
    bitmask = allocate_bitmask(len(grammars), PADDED_VOCAB)
    backend.fill_bitmasks([(g, i) for i, g in enumerate(grammars)], bitmask)
    allowed = unpack_bitmask(bitmask, bitmask.shape[1] * 32)
    assert not allowed[:, 32_000:].any()  # past the tokenizer, and past the vocabulary in the last word
    assert allowed[1:, :32_000].sum(-1).min() > 20_000  # ".*": most real tokens are fine


def test_engine_output_on_padded_vocab(padded_ckpt: Path) -> None:
    core = make_core(padded_ckpt)
    so = StructuredOutputs(
        "json",
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["n"],
                "properties": {"n": {"type": "integer"}},
            }
        ),
    )
    outs = run(
        core,
        [
            (f"r{s}", [1, 450, 4996], SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs=so))
            for s in range(4)
        ],
    )
    for o in outs.values():
        assert o[-1].finish_reason == "stop"
        ids = [t for t in tokens(o) if t != 2]
        assert max(ids) < 32_000
        assert set(json.loads(core.structured.backend().decode_bytes(ids).decode())) == {"n"}


def test_copies_are_independent_and_rollback(backend: LLGuidanceBackend) -> None:
    template = backend.compile(StructuredOutputs("choice", '["ab", "cd"]'))
    a, b = template.copy(), template.copy()
    ids = backend.tokenizer.tokenize_str("ab")
    assert a.accept_tokens(ids) and a.is_terminated()
    assert not b.is_terminated()
    assert not b.accept_tokens(backend.tokenizer.tokenize_str("x")) and b.error()
    a.rollback(len(ids))
    assert not a.is_terminated()
    mask = allocate_bitmask(1, backend.vocab_size)
    a.fill_bitmask(mask, 0)
    assert unpack_bitmask(mask, backend.vocab_size)[0, ids[0]]


def test_compile_errors_raise(backend: LLGuidanceBackend) -> None:
    with pytest.raises((GrammarError, ValueError)):
        backend.compile(StructuredOutputs("regex", "(unclosed"))
    with pytest.raises(GrammarError):
        backend.compile(StructuredOutputs("json", "{not json"))
    assert torch.int32 == allocate_bitmask(1, 40).dtype
