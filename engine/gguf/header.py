"""Reading a GGUF file's header: metadata and the tensor table, checked against the file's size.

The gguf package's GGUFReader builds a numpy view per metadata element (seconds on a 262k-token vocabulary);
this reads the header sequentially over a memory map, keeps arrays of numbers as numpy arrays, and fails with
one line naming the problem on a damaged file.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.gguf import limits
from engine.gguf.ggml_types import GGMLType

MAGIC = b"GGUF"
# The tensor types spindle loads: the float types and the block quantizations with a dequantizer.
SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in GGMLType)


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType  # why late: gguf imports mistral_common (+0.5 s); only a GGUF file needs it

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


_SCALARS: dict[int, tuple[str, int]] = {  # GGUF value type -> (struct format, size)
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the problem in one line."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first (GGUF lists dimensions innermost first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    path: Path
    size: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class _Cursor:
    """Sequential little-endian reads over the file's bytes; running past the end (or past `end`, the limit on the
    header) raises GGUFError."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path
        self.end = len(buf)

    def room(self, n: int, what: str) -> None:
        """GGUFError unless `n` more bytes are there to read."""
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: {what} runs past the end of the file (at byte {self.pos}, "
                f"{n} bytes wanted, file is {len(self.buf)} bytes): truncated or damaged"
            )
        if self.pos + n > self.end:
            raise GGUFError(
                f"{self.path}: {what} passes the limit of {limits.MAX_HEADER_BYTES >> 20} MiB on the header "
                f"(metadata and tensor table; at byte {self.pos}, {n} bytes wanted)"
            )

    def take(self, n: int, what: str) -> int:
        self.room(n, what)
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, f"metadata {key!r}")
        if vtype == _STRING:
            return self.string(f"metadata {key!r}")
        if vtype == _ARRAY:
            item, count = self.u32(f"metadata {key!r}"), self.u64(f"metadata {key!r}")
            _check_array(self.path, key, count, depth)
            what = f"metadata {key!r} ({count} items)"
            if item in _NUMPY:
                import numpy as np  # why late: the API process reads a GGUF header only for a GGUF model (+0.1 s)

                start = self.take(count * _SCALARS[item][1], what)
                return np.frombuffer(self.buf, dtype=_NUMPY[item], count=count, offset=start).copy()
            if item == _STRING:
                self.room(count * 8, what)  # every string's length at least: a huge count fails before the list
                return [self.string(f"metadata {key!r} item {i}") for i in range(count)]
            if item == _ARRAY:
                self.room(count * 12, what)  # every array's item type and count at least
                return [self.value(_ARRAY, key, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.path}: metadata {key!r} has an unknown value type {vtype}: damaged file")


def _check_array(path: Path, key: str, count: int, depth: int) -> None:
    """The limits on a metadata array, checked before any of its items is read."""
    if key in limits.VOCABULARY_KEYS and count > limits.MAX_VOCABULARY:
        raise GGUFError(
            f"{path}: metadata {key!r} holds a vocabulary of {count} tokens, over the limit of {limits.MAX_VOCABULARY}"
        )
    if count > limits.MAX_ARRAY_LENGTH:
        raise GGUFError(
            f"{path}: metadata {key!r} is an array of {count} items, over the limit of {limits.MAX_ARRAY_LENGTH}"
        )
    if depth >= limits.MAX_ARRAY_DEPTH:
        raise GGUFError(
            f"{path}: metadata {key!r} nests arrays deeper than the limit of {limits.MAX_ARRAY_DEPTH} levels"
        )


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("a tensor name")
    n_dims = cur.u32(f"tensor {name!r}")
    if n_dims > _MAX_DIMS:
        raise GGUFError(f"{cur.path}: tensor {name!r} claims {n_dims} dimensions: damaged file")
    dims = tuple(cur.u64(f"tensor {name!r}") for _ in range(n_dims))
    return name, dims[::-1], cur.u32(f"tensor {name!r}"), cur.u64(f"tensor {name!r}")


def _nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # why late: see type_name

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name!r} has an unknown {type_name(ggml_type)}") from None
    count = math.prod(shape)  # Python integers: a product past 2^64 stays huge (and past the end), never wraps
    if shape and shape[-1] % block:
        raise GGUFError(f"{path}: tensor {name!r} rows of {shape[-1]} are not whole {block}-weight blocks")
    return count // block * size


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    align = metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int):
        shown = repr(align[:40]) if isinstance(align, str) else f"a {type(align).__name__}"
        raise GGUFError(f"{path}: metadata 'general.alignment' is {shown}, not an integer: damaged file")
    if align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: metadata 'general.alignment' is {align}, not a power of two: damaged file")
    return align


def _read_metadata(cur: _Cursor, count: int) -> dict[str, Any]:
    if count > limits.MAX_METADATA_KEYS:
        raise GGUFError(f"{cur.path}: {count} metadata keys, over the limit of {limits.MAX_METADATA_KEYS}")
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = cur.string("a metadata key")
        metadata[key] = cur.value(cur.u32(f"metadata {key!r}"), key)
    return metadata


def _parse(buf: mmap.mmap | bytes, path: Path) -> Header:
    cur = _Cursor(buf, path)
    magic = bytes(buf[cur.take(4, "the magic number") : 4]) if len(buf) >= 4 else bytes(buf)
    if magic != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    version = cur.u32("the version")
    if version not in (2, 3):
        raise GGUFError(
            f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a huge version)"
        )
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the metadata count")
    if n_tensors > limits.MAX_TENSORS:
        raise GGUFError(f"{path}: {n_tensors} tensors, over the limit of {limits.MAX_TENSORS}")
    cur.end = limits.MAX_HEADER_BYTES
    metadata = _read_metadata(cur, n_kv)
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    cur.end = len(buf)
    align = _alignment(path, metadata)
    data_start = -(-cur.pos // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        nbytes = _nbytes(path, name, shape, ggml_type)
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFError(
                f"{path}: tensor {name!r} ({nbytes} bytes at {start}) runs past the end of the file "
                f"({len(buf)} bytes): truncated or damaged"
            )
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    return Header(path, len(buf), metadata, tensors)


def open_mapped(path: Path) -> mmap.mmap:
    """The file memory-mapped read-only (GGUFError if it cannot be opened or is empty)."""
    try:
        with open(path, "rb") as f:
            if not f.seek(0, 2):
                raise GGUFError(f"{path} is empty, not a GGUF file")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"{path}: cannot be read ({e.strerror or e})") from e


def read_header(path: Path, buf: mmap.mmap | None = None) -> Header:
    """The header of the GGUF file at `path` (over `buf` when given: the caller's map of it)."""
    return _parse(buf if buf is not None else open_mapped(path), path)
