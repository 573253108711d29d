"""The GGUF tensor types spindle loads, by the ids the file format fixes (gguf's GGMLQuantizationType values).

Here rather than from the gguf package because importing gguf pulls in mistral_common (+0.5 s of CPU per
process); gguf is imported only where a GGUF file is read or its blocks are checked (tests compare these ids).
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """The float types and the block quantizations with a dequantizer."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
