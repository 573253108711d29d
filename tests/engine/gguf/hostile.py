"""Hand-written hostile GGUF files: each claims something past a limit of engine/gguf/limits.py (or a value a
header must not take on trust) in as few bytes as the claim needs."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.gguf import limits

STRING, ARRAY, U32 = 8, 9, 4


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_string(key: str, value: str | bytes) -> bytes:
    return _str(key) + struct.pack("<I", STRING) + _str(value)


def kv_u32(key: str, value: int) -> bytes:
    return _str(key) + struct.pack("<II", U32, value)


def kv_strings(key: str, count: int) -> bytes:
    """An array of `count` empty strings."""
    return _str(key) + struct.pack("<IIQ", ARRAY, STRING, count) + b"\0" * 8 * count


def kv_nested(key: str, depth: int) -> bytes:
    """Arrays of one array, `depth` levels down to an empty array of u32."""
    return _str(key) + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", U32, 0)


def tensor(name: str, dims: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    """A tensor table entry, dimensions innermost first as GGUF lists them."""
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def write(
    path: Path,
    kvs: list[bytes],
    tensors: Sequence[bytes] = (),
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    data: int = 64,
) -> Path:
    """A GGUF v3 file of these metadata pairs and tensor entries (the counts as given, else as many as there are),
    then `data` bytes of tensor data after padding to 32 bytes."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, n_kv or len(kvs))
    body = head + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(body + b"\0" * (-len(body) % 32 + data))
    return path


ARCH = kv_string("general.architecture", "llama")
VOCAB, ARRAY_LENGTH = limits.MAX_VOCABULARY, limits.MAX_ARRAY_LENGTH
# what each file tries -> (its name, its metadata pairs, its tensor entries, its counts, the words its line holds)
HOSTILE: dict[str, tuple[str, Callable[[], list[bytes]], list[bytes], dict[str, int], str]] = {
    "deep nesting": ("deep", lambda: [ARCH, kv_nested("deep", 200_000)], [], {}, "'deep' nests arrays deeper"),
    "vocabulary": (
        "vocab",
        lambda: [ARCH, kv_strings("tokenizer.ggml.tokens", 10**7)],
        [],
        {},
        f"'tokenizer.ggml.tokens' holds a vocabulary of 10000000 tokens, over the limit of {VOCAB}",
    ),
    "array length": (
        "array",
        lambda: [ARCH, kv_strings("tokenizer.ggml.merges", ARRAY_LENGTH + 1)],
        [],
        {},
        f"'tokenizer.ggml.merges' is an array of {ARRAY_LENGTH + 1} items, over the limit of {ARRAY_LENGTH}",
    ),
    "header bytes": (
        "big",
        lambda: [ARCH, kv_string("general.notes", b"x" * limits.MAX_HEADER_BYTES)],
        [],
        {},
        "metadata 'general.notes' passes the limit of 64 MiB on the header",
    ),
    "metadata keys": (
        "keys",
        lambda: [ARCH],
        [],
        {"n_kv": 1 << 40},
        f"1099511627776 metadata keys, over the limit of {limits.MAX_METADATA_KEYS}",
    ),
    "tensor count": (
        "tensors",
        lambda: [ARCH],
        [],
        {"n_tensors": 1 << 40},
        f"1099511627776 tensors, over the limit of {limits.MAX_TENSORS}",
    ),
    "dimension product": (
        "wrap",
        lambda: [ARCH],
        [tensor("token_embd.weight", (1 << 32, 1 << 32))],
        {},
        "tensor 'token_embd.weight' (73786976294838206464 bytes at",
    ),
    "alignment string": (
        "align",
        lambda: [ARCH, kv_string("general.alignment", "32")],
        [tensor("a", (8,))],
        {},
        "metadata 'general.alignment' is '32', not an integer",
    ),
}


def hostile_file(root: Path, what: str) -> tuple[Path, str]:
    """The hostile file HOSTILE[what] written in `root`, and the words its one line must hold."""
    name, kvs, tensors, counts, words = HOSTILE[what]
    return write(root / f"{name}.gguf", kvs(), tensors, **counts), words
