"""What every reasoning parser gives: a choice's text split into its reasoning and its content (vLLM's
ReasoningParser, as a pure function of the text so far, as the tool parsers are).

``split(text, final)`` is called on the whole output so far each time it grows; while ``final`` is false an end
of text that may begin a marker is held back, so the reasoning and the content each only grow. A parser is made
per request from its prompt, which may already have opened the reasoning (a chat template that ends with
``<think>``)."""
from __future__ import annotations

from serving.tool_parsers.abstract import partial_marker

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, prompt: str):
        self.prompt = prompt

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(the reasoning, None when there is none; the content)."""
        raise NotImplementedError


def split_think(text: str, final: bool, opened: bool) -> tuple[str | None, str]:
    """A <think>...</think> block: reasoning from the start when ``opened``, else only when the output begins with
    <think> (the rest is then content); everything up to </think> is reasoning, all of it when the block never
    closes (the output was cut short)."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START):]
    elif not final and START.startswith(body):
        return ("" if opened else None), ""  # nothing yet, or the start of <think>
    elif not opened:
        return None, text
    else:
        body = text
    end = body.find(END)
    if end >= 0:
        return body[:end], body[end + len(END):]
    return (body if final else body[:len(body) - partial_marker(body, (END,))]), ""
