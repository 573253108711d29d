"""What a GGUF header may claim before it is read any further: each limit is checked before anything proportional
to it is allocated, so a hostile file ends in one line (docs/gguf.md "Limits"), never in a swollen process.

The real files served hold 33 metadata keys, 236-272 tensors and a 6.2 MiB header at most (Gemma-3's
262,144-token vocabulary); the limits leave room for the largest vocabularies and tensor tables in use.
"""

from __future__ import annotations

MAX_HEADER_BYTES = 64 << 20  # the metadata (keys and values) and the tensor table: about 10x Gemma-3's
MAX_METADATA_KEYS = 65_536
MAX_ARRAY_LENGTH = 1 << 22  # items in one metadata array (a vocabulary's merges: about 300k at most in use)
MAX_ARRAY_DEPTH = 8  # arrays of arrays (llama.cpp writes none)
MAX_VOCABULARY = 1 << 19  # tokens: 2x the largest vocabularies in use (256k); transformers' conversion of one
# costs about 800 bytes a token
VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
MAX_TENSORS = 65_536  # per file (a split model: per part)
