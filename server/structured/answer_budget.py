"""A JSON-schema constraint against the request's max_tokens: a 400 up front when no answer of the schema fits.

OpenAI answers such a request with JSON cut at max_tokens (finish_reason "length"); spindle promises JSON that
parses, and the engine's forced finish (engine/structured/forced_finish.py) closes every answer whose finish fits.
Where even the shortest answer cannot fit, as the names of the schema's required members alone prove
(engine/structured/answer_floor.py), the request is refused before it runs, naming the tokens needed. The
tokenizer's vocabulary (as bytes) is read once per tokenizer in a worker thread; each spec's bound is kept in a
small LRU.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import anyio.to_thread
import tokenizers
from tokenizers import decoders

from engine.messages import StructuredOutputs
from engine.structured.answer_floor import Vocabulary, min_answer_tokens
from server.http.errors import bad_request

CACHE_SIZE = 512  # bounds kept, by a digest of the spec
_VOCABS: dict[int, tuple[Any, Vocabulary | None]] = {}  # id(tokenizer) -> (the tokenizer, kept alive; its vocabulary)
_FLOORS: OrderedDict[bytes, int] = OrderedDict()


async def check_answer_fits(
    so: StructuredOutputs, max_tokens: int | None, param: str, spec_param: str, tokenizer: Any
) -> None:
    """400 naming `param` (max_tokens or max_completion_tokens) when every answer to `so` takes more tokens.

    Only a JSON schema written compactly is judged (a whitespace pattern lets tokens fall anywhere), and only an
    explicit max_tokens."""
    if max_tokens is None or tokenizer is None or so.kind != "json" or so.whitespace_pattern is not None:
        return
    key = (
        hashlib.blake2b(so.spec.encode(), digest_size=16, person=b"answer-floor").digest() + str(id(tokenizer)).encode()
    )
    if key in _FLOORS:
        _FLOORS.move_to_end(key)
        floor = _FLOORS[key]
    else:
        floor = _FLOORS[key] = await anyio.to_thread.run_sync(_floor, so.spec, tokenizer)
        while len(_FLOORS) > CACHE_SIZE:
            _FLOORS.popitem(last=False)
    if floor > max_tokens:
        raise bad_request(
            f"{param} is {max_tokens}, but every answer to {spec_param} takes at least {floor} tokens (the names "
            f"of its required members alone), so no answer within {max_tokens} tokens could be complete JSON. "
            f"Raise {param} to at least {floor}, or require fewer members.",
            param,
        )


def _floor(spec: str, tokenizer: Any) -> int:
    vocab = vocabulary(tokenizer)
    try:
        schema = json.loads(spec)
    except ValueError:
        return 0
    return 0 if vocab is None else min_answer_tokens(schema, vocab)


def vocabulary(tokenizer: Any) -> Vocabulary | None:
    """The tokenizer's tokens as bytes, indexed (~1 s for 150k tokens, once per tokenizer); None for a vocabulary
    whose bytes are not known here (only byte-level BPE and byte-fallback ones are read)."""
    hit = _VOCABS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    found = token_bytes(tokenizer)
    vocab = None if found is None else Vocabulary(found)
    _VOCABS[id(tokenizer)] = (tokenizer, vocab)
    return vocab


def token_bytes(tokenizer: Any) -> list[bytes] | None:
    """Every token's bytes: byte-level BPE (GPT-2's byte-to-character map) or byte fallback (`▁` a space,
    `<0x0A>` a byte); None for another kind. Added tokens come as their text: extra tokens only lower the bound."""
    if not isinstance(tokenizer, tokenizers.Tokenizer):
        return None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = [tokenizer.id_to_token(i) or "" for i in range(n)]
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        return [_mapped(p, byte_of) for p in pieces]
    if getattr(tokenizer.model, "byte_fallback", False):
        return [_fallback(p) for p in pieces]
    return None


def _mapped(piece: str, byte_of: dict[str, int]) -> bytes:
    if all(ch in byte_of for ch in piece):
        return bytes(byte_of[ch] for ch in piece)
    return piece.encode()  # an added token's plain text


def _fallback(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the character byte-level BPE writes for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
