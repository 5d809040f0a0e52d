"""What every tool parser gives: the text that is not a tool call, and the calls (vLLM's ToolParser, as a pure
function of the text so far).

``parse(text, final)`` is called on the whole output so far, each time it grows. While ``final`` is false it
may hold back what it cannot decide yet (the start of a marker, a call whose name is not complete), so that for
well-formed output each call's content and arguments only ever grow: what was sent in a stream is a prefix of
the next parse and of the final one. A malformed output is the parser's business only at the end: then it is
all content, as in vLLM.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text as the model wrote it; while streaming, a prefix of it


@dataclasses.dataclass
class Parsed:
    content: str
    calls: list[ToolCall]


class ToolParser:
    keeps_special_tokens = False  # True: the markers are special tokens, which the detokenizer must keep

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that is a proper beginning of one of the markers."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(len(m) > k and text.endswith(m[:k]) for m in markers):
            return k
    return 0


def content_until(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before the first marker and where the marker starts (-1: none yet); while streaming, an end
    of text that may begin the marker is held back."""
    first = text.find(marker)
    if first >= 0:
        return text[:first], first
    return text if final else text[:len(text) - partial_marker(text, (marker,))], -1
