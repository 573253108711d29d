"""Whether a draft model's token ids mean what the target's do, without torch: the API process checks it at
start-up (server/config/server.py) and the engine again when it loads the draft (engine/spec/draft_model.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.gguf.folder import resolve_gguf
from engine.models.checkpoint_meta import eos_token_ids, read_config, read_generation_config, tokenizer_token_count
from engine.spec_config import FLAG, parse_spec_config

MISMATCH = "the draft model's vocabulary does not match the target's"


def special_tokens(folder: Path) -> dict[str, int]:
    """tokenizer.json's special added tokens, text -> id (empty: no readable tokenizer.json)."""
    try:
        data = json.loads((folder / "tokenizer.json").read_text())
        return {str(t["content"]): int(t["id"]) for t in data.get("added_tokens") or () if t.get("special")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _eos(folder: Path) -> list[int]:
    return sorted(set(eos_token_ids(read_config(folder), read_generation_config(folder))))


def vocab_mismatch(target: Path, draft: Path) -> str | None:
    """Why the draft's token ids do not mean the target's (None: they do): the tokenizers' sizes, their special
    tokens' ids, the eos ids. Two checkpoint folders (a GGUF file's derived folder)."""
    sizes = tokenizer_token_count(target), tokenizer_token_count(draft)
    if sizes[0] != sizes[1] and None not in sizes:
        return f"the target's tokenizer has {sizes[0]} tokens, the draft's {sizes[1]}"
    ours, theirs = special_tokens(target), special_tokens(draft)
    for text, tid in sorted(ours.items(), key=lambda t: t[1]):
        if theirs.get(text) != tid:
            return f"special token {text!r} is id {tid} in the target, {theirs.get(text)} in the draft"
    extra = sorted(set(theirs) - set(ours))
    if extra:
        return f"the draft has special token {extra[0]!r} (id {theirs[extra[0]]}), the target has not"
    if _eos(target) != _eos(draft):
        return f"eos token ids {_eos(target)} in the target, {_eos(draft)} in the draft"
    return None


def check_draft_vocab(target: str | None, speculative_config: dict[str, Any]) -> None:
    """A draft model whose vocabulary is not the target's stops start-up (ValueError, one line); a target or
    draft that is not a local folder or GGUF file is left to the engine's load."""
    spec = parse_spec_config(speculative_config)
    if spec is None or spec.model is None or target is None or not Path(target).is_dir():
        return
    gguf = resolve_gguf(spec.model)
    draft = gguf[0] if gguf is not None else Path(spec.model)
    if draft.is_dir() and (why := vocab_mismatch(Path(target), draft)) is not None:
        raise ValueError(f"{FLAG}: {MISMATCH}: {why}")
