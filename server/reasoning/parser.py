"""Reasoning parsers: split `<think>...</think>` from the answer, streamed or not, with one code path.

`feed(delta, final)` returns the reasoning and content text that became certain; a tag split across
deltas is held back. The non-streamed split is the same parser fed the whole text, so a stream's
concatenated deltas equal it for every way the text was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

_WS = " \t\n\r"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_in_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool | None:
    """True: the prompt opened reasoning and left it open (the output starts inside it); False: the prompt
    closed it (e.g. Qwen3 with enable_thinking false); None: the prompt has no reasoning tags."""
    opened, closed = prompt.rfind(start), prompt.rfind(end)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    # True: output before the end tag is reasoning even without a start tag (DeepSeek-R1's template puts
    # `<think>` in the prompt); False: reasoning needs the start tag, in the output or left open by the prompt.
    implicit_start = False

    def __init__(self, prompt_in_reasoning: bool | None = None) -> None:
        # "before": nothing but whitespace yet; "in": reasoning; "after": the answer (content, leading ws dropped)
        self._state = "in" if prompt_in_reasoning or (self.implicit_start and prompt_in_reasoning is None) else "before"
        self._buf = ""
        self._lead = self._state == "in"  # a start tag the model writes anyway, first thing, is dropped
        self._answer_started = False
        self.saw_end = prompt_in_reasoning is False  # reasoning is over (for the constraint's start)
        self.ended = False  # the output wrote the end tag: its text up to the first end tag was reasoning

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while True:
            if self._state == "before":
                stripped = self._buf.lstrip(_WS)
                if stripped.startswith(self.start):
                    self._buf = stripped[len(self.start) :]
                    self._state = "in"
                    continue
                if not final and self.start.startswith(stripped):
                    break  # maybe the start tag, still coming
                self._state = "after"
                self._answer_started = True  # no reasoning: the text is the answer as written
                continue
            if self._state == "in":
                if self._lead:
                    stripped = self._buf.lstrip(_WS)
                    if stripped.startswith(self.start):
                        self._buf = stripped[len(self.start) :]
                    elif not final and self.start.startswith(stripped):
                        break  # maybe the start tag, still coming
                    self._lead = False
                pos = self._buf.find(self.end)
                if pos >= 0:
                    out.reasoning += self._buf[:pos]
                    self._buf = self._buf[pos + len(self.end) :]
                    self._state = "after"
                    self.saw_end = self.ended = True
                    continue
                cut = len(self._buf) - (0 if final else _held(self._buf, self.end))
                out.reasoning += self._buf[:cut]
                self._buf = self._buf[cut:]
                break
            if not self._answer_started:  # whitespace right after </think> only separates
                self._buf = self._buf.lstrip(_WS)
                if not self._buf:
                    break
                self._answer_started = True
            out.content += self._buf
            self._buf = ""
            break
        return out

    @property
    def reasoning_open(self) -> bool:
        """The output is in reasoning now (its end tag not written yet)."""
        return self._state == "in"

    @classmethod
    def extract(cls, text: str, prompt_in_reasoning: bool | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where empty."""
        out = cls(prompt_in_reasoning).feed(text, final=True)
        return (out.reasoning or None), (out.content or None)


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: the output starts inside reasoning (its template opens `<think>`); the answer follows
    `</think>`. A `<think>` the model writes itself is accepted too."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3Parser(ReasoningParser):
    """Qwen3: `<think>...</think>` then the answer; no tags (thinking off): all answer. A template that leaves
    `<think>` open in the prompt starts the output inside reasoning."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}") from None
