"""server/reasoning/: splitting <think>...</think>, prompts that open or close reasoning, tags split across deltas."""

from __future__ import annotations

import msgspec
import pytest

from engine.messages import StructuredOutputs
from server.config import ServerConfig
from server.reasoning.parser import DeepSeekR1Parser, Qwen3Parser, prompt_in_reasoning
from server.structured.parsing import request_constraint


@pytest.mark.parametrize(
    "cls, text, in_prompt, want",
    [
        (Qwen3Parser, "<think>hmm</think>\n\nHi", None, ("hmm", "Hi")),
        (Qwen3Parser, "Hi there", None, (None, "Hi there")),  # thinking off: all answer
        (Qwen3Parser, "  <think>a</think>b", None, ("a", "b")),
        (Qwen3Parser, "plan</think>Hi", True, ("plan", "Hi")),  # the template opened <think>
        (Qwen3Parser, "<think>cut", None, ("cut", None)),
        (Qwen3Parser, "<thi", None, (None, "<thi")),
        (DeepSeekR1Parser, "plan</think>Hi", None, ("plan", "Hi")),
        (DeepSeekR1Parser, "all thinking", None, ("all thinking", None)),
        (DeepSeekR1Parser, "<think>x</think>y", None, ("x", "y")),
        (DeepSeekR1Parser, "answer", False, (None, "answer")),  # the prompt closed reasoning
    ],
)
def test_extract(cls: type, text: str, in_prompt: bool | None, want: tuple[str | None, str | None]) -> None:
    assert cls.extract(text, in_prompt) == want


def test_split_tags_are_held_back() -> None:
    p = Qwen3Parser()
    assert (p.feed("<th").reasoning, p.feed("ink>abc</th").reasoning) == ("", "abc")
    out = p.feed("ink>Hi")
    assert (out.reasoning, out.content) == ("", "Hi")


def test_prompt_state() -> None:
    assert prompt_in_reasoning("<|im_start|>assistant\n<think>\n") is True
    assert prompt_in_reasoning("<think>\n\n</think>\n\n") is False
    assert prompt_in_reasoning("no tags") is None


def test_constraint_starts_after_reasoning_unless_the_prompt_closed_it() -> None:
    so = StructuredOutputs("json_object")
    on = ServerConfig.from_settings(reasoning_parser="qwen3")
    assert request_constraint(None, so, on, "<think>\n").reasoning_end == "</think>"
    assert request_constraint(None, so, on, "no tags").reasoning_end == "</think>"
    assert request_constraint(None, so, on, "<think>\n\n</think>\n\n").reasoning_end is None
    assert request_constraint(None, so, ServerConfig(), "<think>\n") == so
    assert msgspec.structs.replace(so, reasoning_end=None) == so


def test_config_checks_parser_names() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerConfig.from_settings(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig.from_settings(tool_call_parser="nope")
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig.from_settings(enable_auto_tool_choice=True)
